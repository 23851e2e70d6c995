"""How a job's flow runs the job builder (components/runs.py) as Prefect sees it: each named step a task of the flow
run, each message in its log, each table and the progress an artifact; the flow run's config deep-merged over its
deployment's parameters (`merge_parameters`); a failure's first line as the flow run's state message."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable
from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NONE
from prefect.context import FlowRunContext
from prefect.runtime import deployment, flow_run

from components.environment import first_line
from components.runs import train
from models.algorithms import ALGORITHMS
from models.config import RLHFConfig, from_layers, run_name_for
from models.deploy import DeployConfig
from models.kinds import BY_JOB
from models.loop import Steps
from models.sections import deep_merge

FLOW_PARAMETERS = ("config", "deploy")  # a training flow's parameters: what the run trains, where it runs
# the field of each that names its values (a preset, a placement), and its default
NAMED = {"config": (RLHFConfig.named, RLHFConfig.model_fields[RLHFConfig.named].default),
         "deploy": (DeployConfig.named, DeployConfig.model_fields[DeployConfig.named].default)}


class FlowSteps(Steps):
    """The steps of a run as Prefect tasks of the flow run (named as the UI shows them), its messages in the run's
    log, its tables and its progress as artifacts of the flow run."""

    def __init__(self):
        self.progress_id: UUID | None = None

    def __call__(self, name: str, fn: Callable, *args, retries: int = 0, **kwargs):
        return task(fn, name=name, cache_policy=NONE, retries=retries, retry_delay_seconds=2)(*args, **kwargs)

    def log(self, message: str) -> None:
        get_run_logger().info(message)

    def table(self, key: str, rows: list[dict], description: str) -> None:
        create_table_artifact(table=rows, key=key, description=description)

    def progress(self, done: int, total: int, what: str) -> None:
        percent = 100.0 * done / max(total, 1)
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(percent, description=f"{done}/{total} {what}")
        else:
            update_progress_artifact(self.progress_id, percent, description=f"{done}/{total} {what}")

    def tags(self) -> dict[str, str]:
        return {"prefect.flow_run_id": str(flow_run.get_id() or ""),
                "prefect.deployment": str(deployment.get_name() or "")}


def deployment_parameters() -> dict:
    """The parameters the flow run's deployment was given (prefect.yaml, `rlhf up`, or edited in the UI); {} for a
    flow called directly."""
    if (deployment_id := deployment.get_id()) is None:
        return {}
    with get_client(sync_client=True) as client:
        return client.read_deployment(UUID(str(deployment_id))).parameters or {}


def given_parameters() -> dict:
    """The flow run's parameters as they were given (partial JSON), before Prefect filled in the defaults."""
    context = FlowRunContext.get()
    return dict(context.flow_run.parameters or {}) if context is not None else {}


def train_flow(algorithm: str, config, deploy) -> dict:
    """The body of a training flow (ppo, reinforce): its run, as `job_flow` runs it."""
    with reported_failure():
        return job_flow(flow_config(config, deploy, algorithm))


def stage_flow(stage: str, config, deploy) -> dict:
    """The body of a stage's flow (sft, reward-model, dpo): its run, as `job_flow` runs it; the summary without its
    per-step history (the flow run's result: the model, its digests, the held-out evals)."""
    with reported_failure():
        merged = merged_parameters(config, deploy)
        cfg = BY_JOB[stage].run_class.model_validate({**merged["config"], "deploy": merged["deploy"]})
        return {k: v for k, v in job_flow(cfg).items() if k != "history"}


def job_flow(cfg) -> dict:
    """A job (named after the flow run unless it has a name) built and run by the one job builder, its steps as this
    flow run's tasks."""
    return train(cfg.model_copy(update={"run_name": cfg.run_name or flow_run.get_name()}), FlowSteps())


def flow_run_namer(algorithm: str) -> Callable[[], str]:
    """Prefect's `flow_run_name` of the training flow of `algorithm`: the run's name (its merged config's run_name,
    or '<algorithm>-<timestamp>-<random>' decided here, once), so that the flow run, its MLflow run and its
    checkpoints carry one name in both UIs. `train_flow` reads it back from the flow run."""
    def name() -> str:
        parameters = flow_run.get_parameters()
        return run_name_for(flow_config(parameters.get("config"), parameters.get("deploy"), algorithm))
    return name


def flow_config(config, deploy, algorithm: str | None = None) -> RLHFConfig:
    """The config a flow run runs: each of its parameters (`config`: what the run trains, `deploy`: where its parts
    run) deep-merged over its deployment's own, so `--param config='{"iterations": 50}'` keeps what the deployment
    says of every other field (Prefect itself replaces a parameter as a whole); a flow called without a deployment
    runs what it was called with. `algorithm`: the flow's own recipe, the default; the config may name another of the
    same family (reinforce/default runs every critic-free recipe: grpo, dapo, ...; ppo/default the one with a
    critic), and one of the other family is refused naming the deployment that runs it."""
    merged = merged_parameters(config, deploy)
    if algorithm:
        chosen = merged["config"].setdefault("algorithm", algorithm)
        if chosen in ALGORITHMS and ALGORITHMS[chosen].needs_critic != ALGORITHMS[algorithm].needs_critic:
            other = "ppo/default" if ALGORITHMS[chosen].needs_critic else "reinforce/default"
            raise ValueError(f"config.algorithm={chosen!r} is not run by this deployment's flow "
                             f"({'with' if ALGORITHMS[algorithm].needs_critic else 'without'} a critic): run {other}")
    return from_layers({**merged["config"], "deploy": merged["deploy"]})  # over the preset and placement they name


def merged_parameters(config, deploy) -> dict:
    """A flow run's `config` and `deploy` as JSON mappings, each merged over its deployment's own (`merge_parameters`);
    for a flow called without a deployment, what it was called with."""
    base = deployment_parameters()
    if not base:
        return {"config": _plain(config), "deploy": _plain(deploy)}
    return merge_parameters(base, given_parameters())


def merge_parameters(base: dict, given: dict) -> dict:
    """A flow run's parameters (`given`) over its deployment's (`base`), each of `config` and `deploy` deep-merged
    over the deployment's own (Prefect replaces a parameter as a whole), unless it names another preset (config) or
    placement (deploy) than the deployment's: then it stands alone, over the one it names."""
    out = {}
    for name in FLOW_PARAMETERS:
        (field, default), mine, theirs = NAMED[name], _plain(base.get(name)), _plain(given.get(name))
        renamed = field in theirs and theirs[field] != mine.get(field, default)
        out[name] = theirs if renamed else deep_merge(mine, theirs)
    return out


def _plain(value) -> dict:
    """A parameter as a JSON mapping (a pydantic model dumped with only what was set in it)."""
    if value is None:
        return {}
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_unset=True)
    return dict(value)


class RunFailed(RuntimeError):
    """A training run failed; the message is the first line of the cause (chained, with its whole text)."""


@contextmanager
def reported_failure():
    """Let a failing flow end with the cause's first line as its state message (what `prefect deployment run --watch`,
    the UI's run list and `rlhf` show); the whole cause stays chained in the logged traceback."""
    try:
        yield
    except Exception as exc:
        reason = first_line(exc)
        get_run_logger().error(f"run failed: {reason}")
        raise RunFailed(reason) from exc
