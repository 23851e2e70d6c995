"""A pipeline's config (the first parameter of `pipeline/default`, and `rlhf pipeline --config FILE`): one section per
stage. Light (pydantic and the config tree only): the CLI's parser and a sweep's checks load no model code.

    name          names the pipeline: its MLflow parent run, its flow run, its summary
    base_model    what the SFT stage starts from (a model path or hub id; tiny/policy = the embedded one)
    sft           the SFT stage (models/stages/config.SFTConfig), or a ready model (sft.model) that is not trained
    reward_model  the reward-model stage (RewardModelConfig) from the SFT model (or base_model), or a ready model;
                  none when rl.reward.source=function (sft -> rl -> eval)
    rl            an RL run's config (models/config.RunConfig) whose model fields are filled from upstream: the policy
                  and its reference = the SFT model, the reward model = the RM stage's, PPO's critic initialised from
                  the reward model (NeMo-Aligner); its run name and MLflow parent are the pipeline's. Scored by reward
                  functions or environments (reward.source=function, environment.*), it needs no reward model
    dpo, kto      instead of reward_model + rl, one stage that trains the SFT model on preference data against itself,
                  frozen (sft -> dpo -> eval, sft -> kto -> eval): a section named after any kind of job declared
                  `policy_from_sft` (models/kinds.py), generated from its own stage section
    eval          the trained policy (RL's or that stage's) against the SFT policy on held-out prompts, judged by the
                  reward model (without an RL stage: eval.judge) and the gold reward when one is given; after an RL
                  stage scored by functions, as its own held-out eval judges (its functions or its environments'
                  episodes: success and pass@k of both policies)

The defaults are the embedded default: every stage on the tiny models and the shipped task's builtin data.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, PositiveInt, create_model, model_validator

from models.config import RUN_NAME_PATTERN, EvalConfig, RunConfig
from models.deploy import DeployConfig
from models.kinds import BY_JOB, POLICY_FROM_SFT
from models.sections import Section
from models.stages.config import EvalSection, RewardModelConfig, SFTConfig, StageCheckpoint
from models.tiny_files import is_tiny_policy

STAGE_ORDER = ("sft", "reward_model", "rl", *POLICY_FROM_SFT, "eval")  # every stage a pipeline may have, in order
RL_STAGES = ("sft", "reward_model", "rl", "eval")
FUNCTION_STAGES = ("sft", "rl", "eval")  # an RL stage scored by reward functions or environments: no reward model
# the RL stage's held-out eval by default: the reward model's score and the gold reward along the run, sampled (the
# greedy answers of the tiny policies are all alike)
EXAMPLE_RL_EVAL = EvalConfig(prompts="builtin:sentiment", every=4, temperature=1.0, samples_per_prompt=4)


class PipelineSFT(SFTConfig):
    model: Optional[str] = Field(
        None, description="A ready SFT model (a directory, hub id or s3://bucket/prefix) used instead of training one.")


class PipelineRewardModel(RewardModelConfig):
    model: Optional[str] = Field(
        None, description="A ready reward model (one-label classifier) used instead of training one.")
    init: Literal["sft", "base"] = Field(
        "sft",
        description="What the reward model is trained from: the SFT stage's model or base_model (a new score head).")


class PipelineEval(EvalSection):
    """The eval stage: the trained policy (RL's, DPO's or KTO's) against the SFT policy on held-out prompts."""

    max_new_tokens: Optional[PositiveInt] = Field(
        None, description="Longest response; None = rl.generation.max_new_tokens.")
    judge: Optional[str] = Field(
        None,
        description="The reward model judging an eval without an RL stage; None = reward_model.model or tiny/reward.")


class PipelineTracking(Section):
    experiment: str = Field(
        "rlhf-pipelines", description="MLflow experiment of the pipeline's parent run and its stages' nested runs.")
    register_as: Optional[str] = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$",
        description="Register each trained model as '<register_as>-sft', '-reward-model', '-policy' (None = not).")
    parent_run_id: Optional[str] = Field(
        None, description="MLflow run to nest the pipeline's run under (a sweep sets it); None = a top-level run.")


class PipelineStages(Section):  # PipelineConfig adds a section per kind of job that trains the SFT policy
    """The stages of one pipeline and what each is made from."""

    name: str = Field(
        "sentiment", pattern=RUN_NAME_PATTERN,
        description="Name of the pipeline (letters, digits, '.', '_', '-'): its MLflow parent run and flow run.")
    base_model: str = Field(
        "tiny/policy",
        description="The model the SFT stage starts from: a directory, hub id, s3://bucket/prefix or tiny/<name>.")
    base_revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of base_model when it is a hub id.")
    seed: int = Field(0, description="Seed of every stage (rows' order, initialisation, sampling).")
    sft: PipelineSFT = Field(default_factory=PipelineSFT, description="Supervised fine-tuning on completions.")
    reward_model: PipelineRewardModel = Field(
        default_factory=PipelineRewardModel, description="The Bradley-Terry reward model.")
    rl: RunConfig = Field(
        default_factory=lambda: RunConfig(preset="tiny", algorithm="rloo", eval=EXAMPLE_RL_EVAL),
        description="The RL stage: an RL run's config (its models, name and seed are set by the pipeline).")
    eval: PipelineEval = Field(
        default_factory=PipelineEval, description="The trained policy against the SFT policy on held-out prompts.")
    tracking: PipelineTracking = Field(default_factory=PipelineTracking, description="MLflow lineage.")
    checkpoint: StageCheckpoint = Field(
        default_factory=StageCheckpoint,
        description="Checkpoints of the stages but RL (the RL stage's: rl.checkpoint).")


    @property
    def policy_stage(self) -> str:
        """The stage that trains the pipeline's policy from the SFT model: 'rl', or the preference stage whose
        section is given ('dpo', 'kto')."""
        return next((job for job in POLICY_FROM_SFT if getattr(self, job) is not None), "rl")

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages this pipeline runs, in order."""
        if self.policy_stage != "rl":
            return "sft", self.policy_stage, "eval"
        return FUNCTION_STAGES if self.rl.reward.source == "function" else RL_STAGES

    @model_validator(mode="after")
    def _each_stage_has_what_it_needs(self):
        given = [job for job in POLICY_FROM_SFT if getattr(self, job) is not None]
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: a pipeline trains its policy with one stage; give one of these "
                             f"sections, not {len(given)}")
        if not given and not self.rl.data.prompts:
            raise ValueError("rl.data.prompts: not set; name the RL stage's prompts (a local file or folder, a hub "
                             "data set id, or builtin:<task>), or rl.preset: tiny for the embedded tiny models' values")
        if given and self.judge is None:
            raise ValueError(f"eval.judge: not set; the eval of a pipeline without an RL stage needs a reward model to "
                             f"judge with, and base_model '{self.base_model}' has no embedded one (give eval.judge or "
                             f"reward_model.model)")
        return self

    def check_rl_stage(self, what: str) -> None:
        """Raises ValueError when the pipeline has no RL stage (`what` needs one)."""
        if self.policy_stage != "rl":
            raise ValueError(f"pipeline: {what} the pipeline's RL stage, and this pipeline has a {self.policy_stage} "
                             f"section instead (sft -> {self.policy_stage} -> eval)")

    @property
    def judge(self) -> str | None:
        """The reward model that judges the eval stage of a DPO pipeline (eval.judge, else reward_model.model, else
        the embedded base model's own)."""
        embedded = "tiny/reward" if is_tiny_policy(self.base_model) else None
        return self.eval.judge or self.reward_model.model or embedded


PipelineConfig = create_model(  # one optional section per kind of job that trains the SFT policy (models/kinds.py)
    "PipelineConfig", __base__=PipelineStages, __module__=__name__, __doc__=PipelineStages.__doc__, **{
        job: (Optional[BY_JOB[job].section_class],
              Field(None, description=f"A {BY_JOB[job].command} stage instead of reward_model and rl: sft -> {job} -> "
                                      f"eval (None = the RL stages)."))
        for job in POLICY_FROM_SFT})


class PipelineFile(PipelineConfig):
    """A pipeline as `rlhf pipeline --config FILE` reads it: its config and, optionally, where its parts run."""

    deploy: DeployConfig = Field(
        default_factory=DeployConfig,
        description="Where the stages' ranks and servers run, the state directory, tracking and checkpoints.")

    @property
    def pipeline(self) -> PipelineConfig:
        return PipelineConfig.model_validate(self.model_dump(exclude={"deploy"}))
