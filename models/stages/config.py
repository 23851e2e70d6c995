"""What a job other than an RL run trains or measures (`rlhf sft`, `rlhf reward-model`, `rlhf dpo`, `rlhf eval`, their
deployments, and each such stage of a pipeline): one section per stage, and the run around it. Where its ranks run is
the deployment's (models/deploy.py), as for an RL run. The defaults are the embedded default: the tiny policy, the
shipped task's builtin data, sizes that train in seconds on a 2-core CPU; for a real model lower the learning rate
(~1e-5 SFT, ~1e-5 reward model, ~5e-7 DPO) and raise max_length.

Every run config of a job (these, and models/config.RLHFConfig for RL) names its job (`job`: what components/runs.py
builds) and the prefix of its generated run name (`name_prefix`).
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from models.algorithms import ALGORITHMS
from models.config import (RUN_NAME_PATTERN, SOURCES_DESCRIPTION, CheckpointConfig, LoraConfig,
                           RunConfig, TrackingConfig)
from models.deploy import DeployConfig
from models.sections import OptimConfig, Section
from models.resolve import Reads, Resolved, Sources, Want


class StageOptim(OptimConfig):
    """A stage's optimiser: the actor's settings at the tiny models' learning rate."""

    lr: float = Field(
        1e-3, gt=0, description="Peak learning rate (AdamW; 1e-3 suits the tiny models, docs/pipeline.md).")


class StageCheckpoint(CheckpointConfig):
    """A stage's checkpoints, counted in optimizer steps."""

    every: PositiveInt = Field(50, description="Checkpoint every N optimizer steps (and at the end).")


class StageTraining(Section):
    """What the SFT and reward-model stages share: their data, the update loop's batch geometry, optimizer, LoRA."""

    data: str = Field(description="Training rows from a data source (docs/data.md).")
    subset: Optional[str] = Field(
        None, description="Configuration (subset) of `data` and `eval_data`, for a data set that has several.")
    revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of `data` and `eval_data` when they are hub ids.")
    split: str = Field("train", description="Split of `data` to train on (a single file is this split).")
    eval_data: Optional[str] = Field(
        None, description="Held-out rows, a source like `data`; None = split `eval_split` of `data`.")
    eval_split: Optional[str] = Field("test", description="Split of the held-out rows; None = no held-out eval.")
    max_eval_rows: Optional[PositiveInt] = Field(
        None, description="Evaluate on the first N held-out rows only (None = all).")
    eval_every: int = Field(
        0, ge=0,
        description="Held-out eval every N optimizer steps, before the first and after the last (0 = only then).")
    max_length: Optional[PositiveInt] = Field(
        None, description="Longest prompt + completion in tokens (None = the model's limit; docs/pipeline.md).")
    epochs: PositiveInt = Field(1, description="Passes over the training rows (seeded order per epoch).")
    max_steps: Optional[PositiveInt] = Field(
        None, description="Stop after this many optimizer steps (None = the epochs' steps).")
    batch_size: PositiveInt = Field(
        32, description="Rows (SFT) or pairs (reward model, DPO) per optimizer step, over all ranks.")
    micro_batch_size: PositiveInt = Field(
        32, description="Rows or pairs per forward pass on a rank (gradient accumulation inside a step).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype (autocast); trainable weights and optimizer states stay float32.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="Train LoRA adapters instead of all weights; the stage's output model has them merged.")
    optim: StageOptim = Field(default_factory=StageOptim, description="AdamW and its schedule.")


class SFTConfig(StageTraining):
    """Supervised fine-tuning on completions: the loss is the mean -log p of the completion tokens (the prompt's carry
    none), as TRL's SFTTrainer with completion_only_loss."""

    data: str = Field(
        "builtin:sentiment_sft",
        description="SFT rows (prompt/completion, or messages) from a data source (docs/data.md).")
    epochs: PositiveInt = Field(
        2, description="Passes over the training rows (2 suit the builtin rows: docs/pipeline.md).")


class RewardModelConfig(StageTraining):
    """A Bradley-Terry reward model on preference pairs, as TRL's RewardTrainer: an
    AutoModelForSequenceClassification with one label, scored at each sequence's last token."""

    data: str = Field(
        "builtin:sentiment_preference",
        description="Preference pairs (prompt, chosen, rejected, margin) from a data source (docs/data.md).")
    epochs: PositiveInt = Field(2, description="Passes over the training pairs (seeded order per epoch).")
    center_rewards_coefficient: Optional[float] = Field(
        None, ge=0, description="Adds coefficient x mean((r_chosen + r_rejected)^2) to the loss (TRL's); None = off.")


class DPOConfig(StageTraining):
    """Direct preference optimisation on preference pairs (Rafailov et al. 2023), as TRL's DPOTrainer: the policy
    trains on each pair's chosen and rejected completions against a frozen reference, the model it starts from (the
    SFT model in a pipeline; with LoRA, the model with its adapters disabled). Its implicit reward of a completion is
    beta x (log pi(completion) - log pi_ref(completion)), summed over the completion's tokens."""

    data: str = Field(
        "builtin:sentiment_preference",
        description="Preference pairs (prompt, chosen, rejected) from a data source (docs/data.md).")
    beta: float = Field(
        0.1, gt=0,
        description="The KL strength beta (TRL's default 0.1; for ipo, its tau): the implicit reward's scale.")
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid",
        description="sigmoid: DPO's loss; ipo: IPO's squared loss (Azar et al. 2023), as TRL 1.16 computes it.")
    epochs: PositiveInt = Field(1, description="Passes over the training pairs (seeded order per epoch).")


class StageRunConfig(Section):
    """What one run of a stage trains: the model it trains from, the stage's section, its seed, name, MLflow and
    checkpoints (a flow's `config` parameter; where its ranks run is the `deploy` beside it)."""

    stage: ClassVar[str]
    run_name: Optional[str] = Field(
        None, pattern=RUN_NAME_PATTERN,
        description="Name of the run (letters, digits, '.', '_', '-'): the same name resumes it; None = generated.")
    seed: int = Field(
        0, description="Seed of the rows' order and the initialisation (a reward model's new score head).")
    model: str = Field(
        "tiny/policy",
        description="The model the stage trains from: a directory, hub id, s3://bucket/prefix or tiny/<name>.")
    model_revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of `model` when it is a hub id.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    checkpoint: StageCheckpoint = Field(default_factory=StageCheckpoint, description="Checkpoints and resume.")

    @property
    def train(self) -> StageTraining:
        """The stage's own section."""
        return getattr(self, self.stage)

    @property
    def job(self) -> str:
        """The job that runs this config (components/runs.py): the stage."""
        return self.stage

    @property
    def name_prefix(self) -> str:
        """Of a generated run name: '<stage>-<timestamp>-<random>'."""
        return self.stage.replace("_", "-")


class SFTRunConfig(StageRunConfig):
    """What a supervised fine-tuning run trains (`rlhf sft`, sft/default)."""

    stage: ClassVar[str] = "sft"
    sft: SFTConfig = Field(default_factory=SFTConfig, description="The SFT stage.")


class RewardModelRunConfig(StageRunConfig):
    """What a reward-model run trains (`rlhf reward-model`, reward-model/default)."""

    stage: ClassVar[str] = "reward_model"
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="The reward-model stage.")


class DPORunConfig(StageRunConfig):
    """What a DPO run trains (`rlhf dpo`, dpo/default): `model` is the policy it starts from and its frozen
    reference."""

    stage: ClassVar[str] = "dpo"
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="The DPO stage.")


class EvalSection(Section):
    """A policy against a reference policy on held-out prompts, judged by a reward model (and a gold reward)."""

    prompts: str = Field("builtin:sentiment", description="Held-out prompts from a data source (docs/data.md).")
    subset: Optional[str] = Field(None, description="Configuration (subset) of `prompts`, as data.subset.")
    revision: Optional[str] = Field(None, description="Hub revision of `prompts`, as data.revision.")
    split: str = Field("test", description="Split of `prompts` to read (a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the prompt (a string or chat messages).")
    max_prompts: Optional[PositiveInt] = Field(None, description="Evaluate on the first N prompts only (None = all).")
    samples_per_prompt: PositiveInt = Field(
        4, description="Responses each policy samples per prompt (k of pass@k), paired for the win rate.")
    success_threshold: Optional[float] = Field(
        None, description="A sample succeeds at a score of at least this; None = when all scores are 0 or 1, at 1.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of both policies (0 = greedy).")
    gold: Optional[str] = Field(
        "models.tasks.sentiment:gold_reward", pattern=r"^[\w.]+:\w+$",
        description="Gold reward 'package.module:function' read beside the reward model's score; None = no gold.")
    table_rows: PositiveInt = Field(
        32, description="Paired samples shown in the sample table (Prefect artifact and MLflow table).")


class EvalJudging(EvalSection):
    """The eval job's section: the comparison, and how both policies sample."""

    max_new_tokens: PositiveInt = Field(16, description="Longest response of either policy.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 disables).")
    normalize: bool = Field(
        False, description="Standardise the reward model's scores with its stored statistics, as reward.normalize.")


class EvalRunConfig(Section):
    """What an eval run compares (`rlhf eval`; a pipeline's eval stage): `model`, the policy under test, against
    `reference`, judged by `reward`."""

    job: ClassVar[str] = "eval"
    name_prefix: ClassVar[str] = "eval"
    run_name: Optional[str] = Field(
        None, pattern=RUN_NAME_PATTERN,
        description="Name of the run (letters, digits, '.', '_', '-'); None = generated.")
    seed: int = Field(
        0, description="Seed of the sampling (one seed for both policies: their j-th responses are paired).")
    model: str = Field("tiny/policy", description="The policy under test: a directory, hub id or tiny/<name>.")
    reference: str = Field("tiny/policy", description="The policy it is compared against (a pipeline's SFT model).")
    reward: Optional[str] = Field(
        "tiny/reward", description="The reward model that judges both (one label); None with `run`.")
    run: Optional[RunConfig] = Field(
        None,
        description="Judge as this RL run's eval does, by its reward functions or environments (docs/pipeline.md).")
    eval: EvalJudging = Field(default_factory=EvalJudging, description="The comparison.")

    @model_validator(mode="after")
    def _one_judge(self):
        if self.run is not None and self.run.reward.source != "function":
            raise ValueError("run.reward.source: an eval judged as an RL run's eval scores with its reward functions "
                             "or environments (reward.source=function); a reward model judges through `reward`")
        if self.run is None and not self.reward:
            raise ValueError("reward: not set; name the reward model that judges both policies, or give `run`")
        return self
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Unused by an eval (it keeps no checkpoint); present as in every job's config.")


class Deployed:
    """What a stage or eval run with its deployment answers (a run as its processes receive it: what it trains, and
    where its parts run, `deploy`; what it reads, pinned where it starts, `sources`)."""

    def resolved_state_dir(self):
        return self.deploy.resolved_state_dir()

    def reads(self) -> Reads:
        """What a stage reads (pinned once where it starts: models/resolve.pin): the model it trains from (at
        model_revision), its rows and, when its held-out split is read from elsewhere, its eval_data."""
        t, stage = self.train, self.stage
        data = {f"{stage}.data": Want(t.data, t.revision, t.subset)}
        if t.eval_split is not None and t.eval_data:
            data[f"{stage}.eval_data"] = Want(t.eval_data, t.revision, t.subset)
        return Reads({"model": Want(self.model, self.model_revision)}, data)

    def source(self, field: str) -> Resolved:
        """The pin of a source the job reads (`reads`), as this machine has it (models/resolve.py); nothing resolves."""
        return self.sources.local(field, self.reads(), self.deploy)

    def local_path(self, field: str) -> str:
        """The local directory (or file) of a model or data field the job reads, as pinned (`source`)."""
        return self.source(field).path


DEPLOY_DESCRIPTION = "Where the run's ranks run, its state, tracking and checkpoints (set by the deployment)."


class SFTRun(SFTRunConfig, Deployed):
    """An SFT run with its deployment."""

    deploy: DeployConfig = Field(default_factory=DeployConfig, description=DEPLOY_DESCRIPTION)
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)


class RewardModelRun(RewardModelRunConfig, Deployed):
    """A reward-model run with its deployment."""

    deploy: DeployConfig = Field(default_factory=DeployConfig, description=DEPLOY_DESCRIPTION)
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)


class DPORun(DPORunConfig, Deployed):
    """A DPO run with its deployment."""

    deploy: DeployConfig = Field(default_factory=DeployConfig, description=DEPLOY_DESCRIPTION)
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)


class EvalRun(EvalRunConfig, Deployed):
    """An eval run with its deployment."""

    deploy: DeployConfig = Field(default_factory=DeployConfig, description=DEPLOY_DESCRIPTION)
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)

    def reads(self) -> Reads:
        """What an eval reads: the policy, its reference and its judge, and the held-out prompts; judged as an RL run's
        eval (`run`), also what that run's config names and its prepared config reads (components/jobs/evaluation
        .as_run): its prompts (their task names its gold reward) and its teacher (a distilling recipe)."""
        e, run = self.eval, self.run
        models = {name: Want(value) for name in ("model", "reference", "reward") if (value := getattr(self, name))}
        data = {"eval.prompts": Want(e.prompts, e.revision, e.subset)}
        if run is not None:
            if ALGORITHMS[run.algorithm].needs_teacher and run.model.teacher:
                models["run.model.teacher"] = Want(run.model.teacher)
            if run.data.prompts and not run.environment.verifiers:
                data["run.data.prompts"] = Want(run.data.prompts, run.data.revision, run.data.subset,
                                                run.data.options)
        return Reads(models, data)


StageRun = SFTRun | RewardModelRun | DPORun  # and any other stage's (models/kinds.py: a JobKind's `run`)


def stage_run_configs(stage: str, section: type, doc: str) -> tuple[type, type]:
    """(the run config of a stage whose section is `section`: what its flow's `config` parameter takes, the same with
    its deployment: what its processes receive), for a stage declared outside this module (models/stages/kto.py)."""
    name = section.__name__.removesuffix("Config")
    config = type(f"{name}RunConfig", (StageRunConfig,), {
        "__doc__": doc, "__module__": section.__module__, "__annotations__": {"stage": ClassVar[str], stage: section},
        "stage": stage, stage: Field(default_factory=section, description=f"The {name} stage.")})
    run = type(f"{name}Run", (config, Deployed), {
        "__doc__": f"{doc.rstrip('.')}, with its deployment.", "__module__": section.__module__,
        "__annotations__": {"deploy": DeployConfig, "sources": Sources},
        "deploy": Field(default_factory=DeployConfig, description=DEPLOY_DESCRIPTION),
        "sources": Field(default_factory=Sources, description=SOURCES_DESCRIPTION)})
    return config, run
