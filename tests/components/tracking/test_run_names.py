"""A training run's name: the Prefect flow run, the MLflow run and the checkpoints carry one name; and a run nested
under a parent MLflow run (a sweep's trials)."""

import re

from mlflow.tracking import MlflowClient

from components.tracking import run
from components.tracking.run import RunSession, flow_run_namer, named_after_flow_run
from models.config import RLHFConfig


def test_a_training_flow_run_is_named_after_its_run(monkeypatch):
    monkeypatch.setattr(run.flow_run, "get_parameters", lambda: {"config": {"run_name": "mine", "algorithm": "ppo"}})
    assert flow_run_namer("rloo")() == "mine"
    # no run_name: '<the flow's algorithm>-<timestamp>', decided once by the namer; the flow reads it back
    monkeypatch.setattr(run.flow_run, "get_parameters", lambda: {"config": RLHFConfig(algorithm="ppo")})
    name = flow_run_namer("rloo")()
    assert re.fullmatch(r"rloo-\d{8}-\d{6}", name), name
    monkeypatch.setattr(run.flow_run, "get_name", lambda: name)
    cfg = named_after_flow_run(RLHFConfig(algorithm="ppo"), "rloo")
    assert (cfg.run_name, cfg.algorithm) == (name, "rloo")
    assert named_after_flow_run(RLHFConfig(run_name="given"), "ppo").run_name == "given"


def test_a_run_with_a_parent_is_nested_under_it(tmp_path, mlflow_uri):
    client = MlflowClient(mlflow_uri)
    parent = client.create_run(client.create_experiment("nest"), run_name="sweep").info.run_id
    cfg = RLHFConfig(state_dir=str(tmp_path), run_name="sweep-t0",
                     tracking={"uri": mlflow_uri, "experiment": "nest", "parent_run_id": parent, "system_metrics": False})
    session = RunSession.open(cfg)
    session.close("FINISHED")
    child = client.get_run(session.tracker.run_id)
    assert child.info.run_name == "sweep-t0" and child.data.tags["mlflow.parentRunId"] == parent
    assert child.data.params["tracking.parent_run_id"] == parent
    alone = RunSession.open(cfg.model_copy(update={"run_name": "alone", "tracking": cfg.tracking.model_copy(
        update={"parent_run_id": None})}))
    alone.close("FINISHED")
    assert "mlflow.parentRunId" not in client.get_run(alone.tracker.run_id).data.tags
