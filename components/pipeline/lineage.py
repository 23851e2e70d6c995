"""A pipeline's lineage in MLflow: one parent run per pipeline run, the stages' runs nested under it, each trained
model logged as an MLflow LoggedModel (its files stay in the checkpoint store: an external model) with tags naming
its upstream models and data digests, and registered when `tracking.register_as` is set.

A stage that is reused (cached) adds no run: the parent run's tags name the run and the logged model that built it.
"""

from __future__ import annotations

from mlflow.entities import LoggedModelStatus, RunTag

from components.tracking.run import default_tracking_uri
from components.tracking.tracker import Tracker, get_or_create_experiment
from models.config import RLHFConfig
from models.deploy import DeployConfig
from models.kinds import KINDS

# '<register_as>-<suffix>': each kind's (models/kinds.py) that publishes a model
REGISTERED = {kind.job: kind.registered_as for kind in KINDS if kind.registered_as}


class PipelineRun:
    """The pipeline's MLflow parent run."""

    def __init__(self, cfg, deploy: DeployConfig, tags: dict[str, str] | None = None):
        self.cfg = cfg
        self.tracking_uri = default_tracking_uri(RLHFConfig(deploy=deploy))
        nested = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
        self.tracker = Tracker(self.tracking_uri, cfg.tracking.experiment, cfg.name,
                               tags={"pipeline": cfg.name, **nested, **(tags or {})},
                               system_metrics=deploy.tracking.system_metrics)

    @property
    def run_id(self) -> str:
        return self.tracker.run_id

    def start(self) -> "PipelineRun":
        self.tracker.start(self.cfg.model_dump(mode="json"))
        return self

    def record_stage(self, stage: str, outcome: dict) -> None:
        """Tags naming what the stage is (cached or built, its model, key, run); its metrics at step 0 as
        '<stage>/<name>' (the eval stage's: eval/eval/win_rate...)."""
        tags = {"cached": str(outcome.get("cached", False)).lower(), "model": outcome.get("model"),
                "key": outcome.get("key"), "run": outcome.get("mlflow_run_id"),
                "logged_model": outcome.get("logged_model_id")}
        self.tracker.client.log_batch(self.run_id, tags=[RunTag(f"stage.{stage}.{name}", str(value))
                                                         for name, value in tags.items() if value])
        numbers = {f"{stage}/{k}": v for k, v in (outcome.get("metrics") or {}).items() if isinstance(v, (int, float))}
        if numbers:
            self.tracker.log_side_metrics(numbers, step=0)

    def log_evals(self, evaluations: list[dict]) -> None:
        """An RL stage's held-out evals at their iterations (eval/reward, eval/gold_reward: what a sweep over the
        pipeline reads, as it reads an RL run's)."""
        for evaluation in evaluations:
            self.tracker.log_side_metrics({k: v for k, v in evaluation.items() if k.startswith("eval/")},
                                          step=int(evaluation["iteration"]))

    def log_model(self, stage: str, record: dict, upstream: dict[str, str], data: dict[str, str]) -> str:
        """Log the stage's model as an external MLflow LoggedModel of the run that built it (`record`'s MLflow run,
        else the parent), tagged with its URI, digest, key, upstream models and data digests; registered as
        '<register_as>-<stage>' when tracking.register_as is set. Returns the logged model's id."""
        client = self.tracker.client
        experiment = get_or_create_experiment(client, self.cfg.tracking.experiment, self.tracking_uri)
        tags = {"uri": record["model"], "sha256": record.get("digest", ""), "stage.key": record["key"],
                "pipeline": self.cfg.name, **{f"upstream.{k}": v for k, v in upstream.items()},
                **{f"data.{k}": v for k, v in data.items()}}
        source = record.get("mlflow_run_id") or self.run_id
        model = client.create_logged_model(experiment, name=f"{self.cfg.name}-{REGISTERED.get(stage, stage)}",
                                           source_run_id=source, tags=tags, model_type="external")
        client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        if self.cfg.tracking.register_as and stage in REGISTERED:
            name = f"{self.cfg.tracking.register_as}-{REGISTERED[stage]}"
            if not client.search_registered_models(f"name = '{name}'"):
                client.create_registered_model(name, tags={"pipeline": self.cfg.name})
            client.create_model_version(name, source=record["model"], run_id=source, tags=tags,
                                        model_id=model.model_id)
        return model.model_id

    def close(self, status: str) -> None:
        self.tracker.end(status)
