"""The jobs other than an RL run as Prefect flows: one per kind of stage trained on the actor's ranks, made from its
declaration (models/kinds.py: `sft/default`, `reward-model/default`, `dpo/default`, `kto/default`), its run through
the one job builder (components/runs.py), each named step a task of the flow run; and the whole pipeline
(`pipeline/default`: components/pipeline/run.py), each stage a task, a reused one Cached.

Like the training flows, each takes what it trains (`config`) and where its parts run (`deploy`), each deep-merged
over its deployment's own parameters, so `--param config='{"sft": {"epochs": 2}}'` keeps every other field."""

from __future__ import annotations

from typing import Literal, Optional

from prefect import Flow, flow
from prefect.runtime import flow_run

from components.pipeline.config import STAGE_ORDER, PipelineConfig
from components.pipeline.run import run_pipeline
from components.tasks import FlowSteps, merged_parameters, reported_failure, stage_flow
from models.deploy import DeployConfig
from models.kinds import KINDS, JobKind


def stage_flow_of(kind: JobKind) -> Flow:
    """The flow of a kind of stage trained on the actor's ranks: named after its command (its deployment is
    '<command>/default'), its parameters its run config (`config`) and where its parts run (`deploy`), both typed so
    that the Prefect form shows their fields and refuses bad values. Bound to this module as `<job>` (the deployment's
    entrypoint is flows/stages.py:<job>)."""
    def run(config, deploy):
        return stage_flow(kind.job, config, deploy)

    run.__name__ = run.__qualname__ = kind.job
    run.__module__ = __name__
    run.__doc__ = f"{kind.summary[0].upper()}{kind.summary[1:]}, on the actor's ranks; returns the run's summary."
    run.__annotations__ = {"config": kind.config_class, "deploy": DeployConfig, "return": dict}
    run.__defaults__ = (kind.config_class(), DeployConfig())
    return flow(run, name=kind.command, description=kind.summary)


# one flow per kind of stage trained on the actor's ranks (models/kinds.py), each a name of this module
STAGE_FLOWS: dict[str, Flow] = {kind.job: stage_flow_of(kind) for kind in KINDS if kind.trains_on_ranks}
globals().update(STAGE_FLOWS)


def pipeline_name() -> str:
    """The pipeline's flow run is named after the pipeline."""
    config = flow_run.get_parameters().get("config")
    return config.name if isinstance(config, PipelineConfig) else str((config or {}).get("name", "pipeline"))


@flow(name="pipeline", flow_run_name=pipeline_name)
def pipeline(config: PipelineConfig = PipelineConfig(), deploy: DeployConfig = DeployConfig(),
             rerun_from: Optional[Literal[STAGE_ORDER]] = None) -> dict:
    """sft -> reward_model -> rl -> eval (or sft -> dpo -> eval with a `dpo` section, sft -> kto -> eval with `kto`),
    each stage reused when its key (config, data, upstream models, code) matches a record beside the checkpoints (its
    task Cached); `rerun_from` builds that stage and every later one again. Returns the summary: {stages: {stage:
    {cached, model, metrics}}}."""
    with reported_failure():
        merged = merged_parameters(config, deploy)
        return run_pipeline(PipelineConfig.model_validate(merged["config"]),
                            DeployConfig.model_validate(merged["deploy"]),
                            FlowSteps(), rerun_from)
