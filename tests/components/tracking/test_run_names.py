"""A training run's name: the Prefect flow run, the MLflow run and the checkpoints carry one name; and a run nested
under a parent MLflow run (a sweep's trials)."""

import re

from mlflow.tracking import MlflowClient

import pytest

from components import tasks
from components.runs import JOBS
from components.tracking.run import RunSession
from components.tasks import flow_config, flow_run_namer
from models.config import RLHFConfig, RunConfig
from models.deploy import DeployConfig

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


def test_a_training_flow_run_is_named_after_its_run(monkeypatch):
    """A flow called without a deployment (no deployment parameters to merge over): its run_name, else
    '<the run's algorithm>-<timestamp>-<random>', decided once by the namer (the flow reads it back from the flow
    run)."""
    monkeypatch.setattr(tasks.deployment, "get_id", lambda: None)
    monkeypatch.setattr(tasks.flow_run, "get_parameters", lambda: {"config": {"run_name": "mine", "algorithm": "grpo"}})
    assert flow_run_namer("rloo")() == "mine"
    monkeypatch.setattr(tasks.flow_run, "get_parameters", lambda: {"config": RunConfig(algorithm="grpo")})
    name = flow_run_namer("rloo")()
    assert re.fullmatch(r"grpo-\d{8}-\d{6}-[0-9a-f]{4}", name), name
    cfg = flow_config(RunConfig(iterations=3), DeployConfig(state_dir="/tmp/s"), "rloo")
    assert (cfg.algorithm, cfg.iterations, cfg.deploy.state_dir) == ("rloo", 3, "/tmp/s")
    assert flow_config(RunConfig(algorithm="dapo"), DeployConfig(state_dir="/tmp/s"), "rloo").algorithm == "dapo"
    with pytest.raises(ValueError, match="config.algorithm='ppo'.*run ppo/default"):
        flow_config(RunConfig(algorithm="ppo"), DeployConfig(state_dir="/tmp/s"), "rloo")


def test_a_run_with_a_parent_is_nested_under_it(tmp_path, mlflow_uri):
    client = MlflowClient(mlflow_uri)
    parent = client.create_run(client.create_experiment("nest"), run_name="sweep").info.run_id
    cfg = RLHFConfig(run_name="sweep-t0", tracking={"experiment": "nest", "parent_run_id": parent},
                     deploy={"state_dir": str(tmp_path), "tracking": {"uri": mlflow_uri, "system_metrics": False}})
    session = RunSession.open(cfg, JOBS["rl"])
    session.close("FINISHED")
    child = client.get_run(session.tracker.run_id)
    assert child.info.run_name == "sweep-t0" and child.data.tags["mlflow.parentRunId"] == parent
    assert child.data.params["tracking.parent_run_id"] == parent
    alone = RunSession.open(cfg.model_copy(update={"run_name": "alone", "tracking": cfg.tracking.model_copy(
        update={"parent_run_id": None})}), JOBS["rl"])
    alone.close("FINISHED")
    assert "mlflow.parentRunId" not in client.get_run(alone.tracker.run_id).data.tags
