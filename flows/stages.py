"""The jobs other than an RL run as Prefect flows: one per kind of stage trained on the actor's ranks (models/kinds.py:
`sft/default`, `reward-model/default`, `dpo/default`), its run through the one job builder (components/runs.py), each
named step a task of the flow run; and the whole pipeline (`pipeline/default`: components/pipeline/run.py), each stage a task, a
reused one Cached.

Like the training flows, each takes what it trains (`config`) and where its parts run (`deploy`), each deep-merged
over its deployment's own parameters, so `--param config='{"sft": {"epochs": 2}}'` keeps every other field."""

from __future__ import annotations

from typing import Literal, Optional

from prefect import flow
from prefect.runtime import flow_run

from components.pipeline.config import STAGE_ORDER, PipelineConfig
from components.pipeline.run import run_pipeline
from components.tasks import FlowSteps, merged_parameters, reported_failure, stage_flow
from models.deploy import DeployConfig
from models.kinds import BY_JOB, KINDS
from models.stages.config import DPORunConfig, RewardModelRunConfig, SFTRunConfig
from models.stages.kto import KTORunConfig


# one flow per kind of stage trained on the actor's ranks (models/kinds.py: its command names the flow and its
# deployment), each a plain `def` so Prefect finds it by its entrypoint without importing the module (`prefect deploy`
# reads a flow's parameters from its source); tests/test_kinds.py checks every such kind has its flow here
@flow(name=BY_JOB["sft"].command, description=BY_JOB["sft"].summary)
def sft(config: SFTRunConfig = SFTRunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """Supervised fine-tuning on the actor's ranks; returns the run's summary (its model, the held-out loss)."""
    return stage_flow("sft", config, deploy)


@flow(name=BY_JOB["reward_model"].command, description=BY_JOB["reward_model"].summary)
def reward_model(config: RewardModelRunConfig = RewardModelRunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """A Bradley-Terry reward model on the actor's ranks; returns the run's summary (its model, the held-out
    accuracy, margin and reward statistics)."""
    return stage_flow("reward_model", config, deploy)


@flow(name=BY_JOB["dpo"].command, description=BY_JOB["dpo"].summary)
def dpo(config: DPORunConfig = DPORunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """DPO on the actor's ranks; returns the run's summary (its model, the held-out implicit-reward accuracy and
    margins)."""
    return stage_flow("dpo", config, deploy)


@flow(name=BY_JOB["kto"].command, description=BY_JOB["kto"].summary)
def kto(config: KTORunConfig = KTORunConfig(), deploy: DeployConfig = DeployConfig()) -> dict:
    """KTO on the actor's ranks; returns the run's summary (its model, the held-out implicit rewards)."""
    return stage_flow("kto", config, deploy)


STAGE_FLOWS = {kind.job: globals()[kind.job] for kind in KINDS if kind.trains_on_ranks}  # what flows/serve.py serves


def pipeline_name() -> str:
    """The pipeline's flow run is named after the pipeline."""
    config = flow_run.get_parameters().get("config")
    return config.name if isinstance(config, PipelineConfig) else str((config or {}).get("name", "pipeline"))


@flow(name="pipeline", flow_run_name=pipeline_name)
def pipeline(config: PipelineConfig = PipelineConfig(), deploy: DeployConfig = DeployConfig(),
             rerun_from: Optional[Literal[STAGE_ORDER]] = None) -> dict:
    """sft -> reward_model -> rl -> eval (or sft -> dpo -> eval with a `dpo` section), each stage reused when its key
    (config, data, upstream models, code) matches a record beside the checkpoints (its task Cached); `rerun_from`
    builds that stage and every later one again. Returns the summary: {stages: {stage: {cached, model, metrics}}}."""
    with reported_failure():
        merged = merged_parameters(config, deploy)
        return run_pipeline(PipelineConfig.model_validate(merged["config"]), DeployConfig.model_validate(merged["deploy"]),
                            FlowSteps(), rerun_from)
