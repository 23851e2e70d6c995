"""The stages before RL as Prefect flows (`sft/default`, `reward-model/default`): a supervised fine-tuning or
reward-model run on the actor's ranks (components/stages.py), each named step a task of the flow run; and the whole
pipeline (`pipeline/default`: components/pipeline/run.py), each stage a task, a reused one Cached.

Like the training flows, each takes what it trains (`config`) and where its parts run (`deploy`), each deep-merged
over its deployment's own parameters, so `--param config='{"sft": {"epochs": 2}}'` keeps every other field."""

from __future__ import annotations

from typing import Literal, Optional

from prefect import flow
from prefect.runtime import flow_run

from components.pipeline.config import PipelineConfig
from components.pipeline.run import run_pipeline
from components.stages import train_stage
from components.tasks import FlowSteps, merged_parameters, reported_failure
from models.deploy import DeployConfig
from models.stages.config import STAGE_RUNS, RewardModelRunConfig, SFTRunConfig


def stage_flow(stage: str, config, deploy) -> dict:
    with reported_failure():
        merged = merged_parameters(config, deploy)
        cfg = STAGE_RUNS[stage].model_validate({**merged["config"], "deploy": merged["deploy"]})
        result = train_stage(cfg.model_copy(update={"run_name": cfg.run_name or flow_run.get_name()}), FlowSteps())
        return {k: v for k, v in result.items() if k != "history"}


@flow(name="sft")
def sft(config: SFTRunConfig = SFTRunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """Supervised fine-tuning on completions (prompt/completion or messages rows) on the actor's ranks; returns the
    run's summary (its model's URI and sha256s, the held-out loss)."""
    return stage_flow("sft", config, deploy)


@flow(name="reward-model")
def reward_model(config: RewardModelRunConfig = RewardModelRunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """A Bradley-Terry reward model on preference pairs (prompt, chosen, rejected) on the actor's ranks; returns the
    run's summary (its model, the held-out accuracy, margin and reward statistics)."""
    return stage_flow("reward_model", config, deploy)


def pipeline_name() -> str:
    """The pipeline's flow run is named after the pipeline."""
    config = flow_run.get_parameters().get("config")
    return config.name if isinstance(config, PipelineConfig) else str((config or {}).get("name", "pipeline"))


@flow(name="pipeline", flow_run_name=pipeline_name)
def pipeline(config: PipelineConfig = PipelineConfig(), deploy: DeployConfig = DeployConfig(),
             rerun_from: Optional[Literal["sft", "reward_model", "rl", "eval"]] = None) -> dict:
    """sft -> reward_model -> rl -> eval, each stage reused when its key (config, data, upstream models, code)
    matches a record beside the checkpoints (its task Cached); `rerun_from` builds that stage and every later one
    again. Returns the summary: {stages: {stage: {cached, model, metrics}}}."""
    with reported_failure():
        merged = merged_parameters(config, deploy)
        return run_pipeline(PipelineConfig.model_validate(merged["config"]), DeployConfig.model_validate(merged["deploy"]),
                            FlowSteps(), rerun_from)
