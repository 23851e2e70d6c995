"""One pydantic config tree for every flow, server and script.

Every field carries its default and a one-line description (shown in the Prefect UI form and by `rlhf config`).
The defaults ARE the embedded default: tiny local models and batch sizes that run end to end on a 2-core CPU in
minutes (so a partial `--param config=...` fills the rest with something that runs). Algorithm hyperparameters follow
NeMo-Aligner where it has one (ratio_eps 0.2, gae_lambda 0.95, discount 1.0, initial KL 0.01, critic loss_clip_val
0.2, 4 rollouts per prompt for RLOO, grad clip 1.0). For a real (1B+) model set the model paths and lower the
learning rates (e.g. actor 1e-6, critic 1e-5) and raise batch sizes.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import Field, PositiveInt, create_model, model_validator

from models.algorithms import ALGORITHMS
from models.deploy import DeployConfig
from models.sections import STATE_DIR_ENV, OptimConfig, Section, default_state_dir  # noqa: F401 (re-exported)
from models.tiny_files import TINY_PREFIX, embedded_model_path, is_embedded  # noqa: F401 (re-exported)


class LoraConfig(Section):
    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights; the reference is the actor with adapters disabled (no copy).")
    r: PositiveInt = Field(8, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: Optional[list[str]] = Field(None, description="Module names to adapt; None lets peft pick the architecture's default.")


class ModelConfig(Section):
    policy: str = Field("tiny/policy", description="Actor checkpoint: a local directory or hub id loaded with from_pretrained; 'tiny/<name>' = the embedded default shipped with the package (tiny/policy, tiny/reward, tiny/critic, tiny/reward-chars).")
    reward: str = Field("tiny/reward", description="Sequence-classification reward model (num_labels=1) for reward.source='model'.")
    critic: Optional[str] = Field(None, description="Critic checkpoint (token-classification, num_labels=1); None initialises the critic from the reward model, as NeMo-Aligner does.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings for the actor.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of actor and critic.")


class GenerationConfig(Section):
    max_new_tokens: PositiveInt = Field(16, description="Longest response in tokens; a response without EOS by then is truncated (is_end=False).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; logprobs for training use the same temperature.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 disables).")
    recompute_logprobs: Optional[bool] = Field(None, description="Recompute behaviour logprobs with a full forward pass after sampling; None = only when dtype is not float32 (in float32 without dropout they equal the sampling-time logprobs).")
    micro_batch_size: PositiveInt = Field(64, description="Sequences per forward pass for logprobs, critic requests and training micro-batches.")


class Sampling(Section):
    """What an engine samples with: generation's sampling fields, for training (temperature > 0) or for the held-out
    eval (temperature 0 = greedy). Built through `of`, so every use is validated."""

    max_new_tokens: PositiveInt = Field(16, description="Longest response in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 = greedy.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 disables).")

    @classmethod
    def of(cls, generation: "GenerationConfig", **changes) -> "Sampling":
        """The sampling settings of `generation`, with `changes` (e.g. temperature=eval.temperature), validated."""
        return cls.model_validate({**{name: getattr(generation, name) for name in cls.model_fields}, **changes})


class KLConfig(Section):
    init: float = Field(0.01, ge=0, description="Initial KL penalty coefficient beta (NeMo-Aligner initial_policy_kl_penalty).")
    estimator: Literal["k1", "abs", "k2", "k3"] = Field("k1", description="Per-token KL estimator used in the reward shaping.")
    adaptive: bool = Field(False, description="Adapt beta towards `target` (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0, description="Target KL (nats per sequence) for the adaptive controller.")
    horizon: PositiveInt = Field(10000, description="Horizon (in samples) of the adaptive controller.")


class CriticConfig(Section):
    """How the critic (value model) trains; where its server runs is the deployment's (deploy.critic)."""

    combine_reward: bool = Field(True, description="Serve the reward model in the critic server: critic_infer returns values and rewards in one call.")
    loss_clip_val: float = Field(0.2, gt=0, description="Clip range of the value loss.")
    train_batch_size: PositiveInt = Field(32, description="Sequences per critic optimizer step (global batch).")
    micro_batch_size: PositiveInt = Field(32, description="Sequences per critic forward pass (inference chunks and gradient accumulation).")
    epochs: PositiveInt = Field(2, description="Critic epochs per critic_train call.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3), description="Critic optimiser (1e-3 suits the tiny critic; ~1e-5 for a 1B critic).")


class RewardConfig(Section):
    source: Literal["model", "function"] = Field("model", description="Score responses with the reward model or a Python function.")
    function: Optional[str] = Field(None, description="'package.module:function(prompts, responses) -> list[float]' for source='function'.")
    gold: Optional[str] = Field("models.tasks.sentiment:gold_reward", description="Gold reward function logged as objective/gold_reward (None to skip).")
    transport: Literal["auto", "tokens", "text"] = Field("auto", description="How rollouts reach the reward model: 'tokens' (the policy's ids: the RM must share the policy's tokenizer), 'text' (reward_text: prompt and response strings the RM tokenizes itself), 'auto' = text when the RM's tokenizer differs from the policy's, else tokens.")
    chat_template: bool = Field(False, description="With text transport, format (prompt, response) with the reward model's chat template (user, assistant) when it has one; otherwise 'prompt response' + EOS.")
    normalize: bool = Field(False, description="Score with the reward model's (score - reward_mean) / reward_std, the statistics the reward_model stage stores in its config.json (as OpenRLHF's normalize_reward; Bradley-Terry rewards are defined only up to a shift); a reward model without them is refused.")

    @model_validator(mode="after")
    def _function_given(self) -> "RewardConfig":
        if self.source == "function" and not self.function:
            raise ValueError("reward.function is required when reward.source='function' (format 'package.module:function')")
        for name in ("function", "gold"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[\w.]+:\w+", value):
                raise ValueError(f"reward.{name} must look like 'package.module:function', got {value!r}")
        return self


PROMPT_SOURCES = ("'builtin:<task>' (sentiment, sentiment_target; the stages' sentiment_sft and sentiment_preference), a local .parquet/.jsonl/.json/.csv/.arrow file, a .txt "
                  "file (one prompt a line), a folder of such files (file names decide the splits), a folder written by "
                  "Dataset.save_to_disk, or a hub dataset id (only where the hub is reachable)")


class DataConfig(Section):
    """The training prompts (models/data.py): read with HF `datasets`; every column besides the prompt reaches the
    reward functions."""

    prompts: str = Field("builtin:sentiment", description=f"Where the prompts come from: {PROMPT_SOURCES}.")
    split: str = Field("train", description="Split to read (folders, save_to_disk DatasetDicts, hub datasets; a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the prompt: a string, or chat messages (a list of {role, content}) rendered with the policy's chat template.")
    chat_template: bool = Field(False, description="Wrap a plain-string prompt as a user turn of the policy's chat template (chat messages are always rendered with it).")
    max_prompt_length: Optional[PositiveInt] = Field(None, description="Longest prompt in policy tokens (None = no limit); what happens to a longer one: long_prompts.")
    long_prompts: Literal["error", "filter", "truncate_left"] = Field("error", description="A prompt longer than max_prompt_length: 'error' refuses the data set before any model loads, 'filter' drops the row (counted and logged), 'truncate_left' keeps its last max_prompt_length tokens.")


class EvalConfig(Section):
    """Held-out evaluation: the policy samples on prompts it does not train on, scored by the run's reward and the
    gold reward. It adds no trainer step and leaves the training stream as it is (its own sampling seed)."""

    prompts: Optional[str] = Field(None, description=f"Eval prompts (None = no eval): {PROMPT_SOURCES}.")
    split: str = Field("test", description="Split of eval.prompts to read (a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the eval prompt (as data.prompt_key).")
    max_prompts: Optional[PositiveInt] = Field(None, description="Evaluate on the first N rows only (None = all).")
    every: int = Field(0, ge=0, description="Evaluate every N iterations, and at iteration 0 (before any update) and at the end (0 = never).")
    samples_per_prompt: PositiveInt = Field(1, description="Responses sampled per eval prompt (k of pass@k).")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    table_rows: PositiveInt = Field(32, description="Eval samples shown in the Prefect artifact and the MLflow table.")


class TrackingConfig(Section):
    experiment: str = Field("rlhf-flows", description="MLflow experiment name.")
    table_every: PositiveInt = Field(5, description="Log a table of sample prompts/responses/rewards every N iterations.")
    parent_run_id: Optional[str] = Field(None, description="MLflow run id to nest this run under (tag mlflow.parentRunId); a sweep sets it to its parent run for every trial. None = a top-level run.")


class CheckpointConfig(Section):
    """How often a run checkpoints; where the checkpoints go is the deployment's (deploy.checkpoint)."""

    every: PositiveInt = Field(5, description="Checkpoint every N iterations (and at the end).")
    keep_last: PositiveInt = Field(2, description="Keep this many newest checkpoints.")


class VLLMConfig(Section):
    """What the vLLM rollout engine computes with; where its server runs is the deployment's (deploy.rollout)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the engine's weights and compute; the weights sent at each refit are cast to it.")


class RolloutConfig(Section):
    engine: Literal["native", "vllm"] = Field("native", description="What samples the rollouts: 'native' = the KV-cache sampling loop on the actor's own module; 'vllm' = the vLLM rollout server, refitted with the actor's weights after every update (models/engines/).")
    max_off_policy_steps: int = Field(0, ge=0, description="Asynchronous rollouts (an engine with its own weights): k >= 1 lets the rollout server generate the next k batches while the actor trains, so the actor at weights version v trains on rollouts sampled with version v-k or newer (at most k batches in flight beyond the one being trained on: staleness bounded by construction, no data dropped); the loss corrects for it per token (rollout.tis_cap). 0 = synchronous: each batch is sampled with the current weights.")
    tis_cap: float = Field(2.0, gt=0, description="Truncated importance sampling for an engine with its own weights (vllm): each token's policy loss is weighted by min(pi_proximal / pi_behaviour, tis_cap), where pi_behaviour is the engine's logprob of the token (the weights version that sampled it) and pi_proximal the trainer's, recomputed when the batch is trained on (the policy PPO's ratio is clipped around: decoupled PPO); as veRL, TRL and AReaL do. The native engine samples with the trainer's own weights (weight exactly 1).")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="The vLLM rollout server (rollout.engine=vllm).")

    @model_validator(mode="after")
    def _async_needs_an_engine_of_its_own(self) -> "RolloutConfig":
        if self.max_off_policy_steps and self.engine == "native":
            raise ValueError(f"rollout.max_off_policy_steps={self.max_off_policy_steps} needs an engine with its own "
                             f"weights (rollout.engine=vllm): the native engine samples with the actor's module, which "
                             f"cannot generate while it trains")
        return self


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # a directory name and an S3 key part: no '/', no '..'


class _Tree(Section):
    """What a run trains (one per run); every registered algorithm adds its own section (models/algorithms/). Where its
    parts run is the deployment's (models/deploy.py)."""

    algorithm: Literal[tuple(ALGORITHMS)] = Field("ppo", description="ppo (actor + critic server) or rloo (REINFORCE with leave-one-out baseline); see models/algorithms/.")
    run_name: Optional[str] = Field(None, pattern=RUN_NAME_PATTERN, description="Name of the run (letters, digits, '.', '_', '-'; at most 100): re-running with the same name resumes it. None = '<algorithm>-<timestamp>-<random>'.")
    iterations: PositiveInt = Field(12, description="Training iterations (rollout + update).")
    seed: int = Field(0, description="Seed of prompts order, sampling and initialisation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Models.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollout sampling.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the frozen reference policy.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Critic (value model) training (algorithms with a critic).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward source.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resume.")


RunConfig = create_model(
    "RunConfig", __base__=_Tree, __module__=__name__, __doc__=_Tree.__doc__,
    **{a.section: (a.Config, Field(default_factory=a.Config, description=a.description)) for a in ALGORITHMS.values()})


class RLHFConfig(RunConfig):
    """A run as its processes receive it: what it trains (the run's config) and where its parts run (`deploy`)."""

    deploy: DeployConfig = Field(default_factory=DeployConfig, description="Where the run's parts run (set by the deployment).")

    @model_validator(mode="after")
    def _every_rank_gets_prompts(self):
        world, section = self.deploy.actor.world_size, ALGORITHMS[self.algorithm].section
        batch = getattr(self, section).rollout_batch_size
        if batch < world:
            raise ValueError(f"{section}.rollout_batch_size={batch} is smaller than the actor's world size {world} "
                             f"(deploy.actor.nnodes x deploy.actor.nproc_per_node): every rank needs at least one prompt")
        return self

    @classmethod
    def of(cls, run: "RunConfig", deploy: DeployConfig | None = None) -> "RLHFConfig":
        """A run's config with the deployment's settings."""
        return cls.model_validate({**run.model_dump(), "deploy": (deploy or DeployConfig()).model_dump()})

    @property
    def run(self) -> "RunConfig":
        """What the run trains, without the deployment's settings."""
        return RunConfig.model_validate(self.model_dump(exclude={"deploy"}))

    def resolved_state_dir(self) -> Path:
        return self.deploy.resolved_state_dir()

    def resolve_model_path(self, value: str) -> str:
        """`tiny/<name>`: the embedded default shipped with the package (models/tiny.py); otherwise the value as
        given (a local directory, or a hub id)."""
        return str(embedded_model_path(value)) if is_embedded(value) else value


def run_name_for(cfg: RunConfig) -> str:
    """The run's name: its run_name, or '<algorithm>-<timestamp>-<random>' (two unnamed runs started in the same
    second get names of their own)."""
    return cfg.run_name or f"{cfg.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def with_schedule_lengths(cfg: RLHFConfig) -> RLHFConfig:
    """Fill `total_steps` of the actor's and the critic's LR schedules, where left at None, with the optimizer steps
    the run will take."""
    algorithm = ALGORITHMS[cfg.algorithm]
    actor = algorithm.settings(cfg)
    rollouts = algorithm.rollouts_per_iteration(actor)
    steps = {
        f"{algorithm.section}.optim.total_steps": cfg.iterations * actor.epochs * math.ceil(rollouts / actor.minibatch_size),
        "critic.optim.total_steps": cfg.iterations * cfg.critic.epochs * math.ceil(rollouts / cfg.critic.train_batch_size),
    }
    current = {f"{algorithm.section}.optim.total_steps": actor.optim.total_steps,
               "critic.optim.total_steps": cfg.critic.optim.total_steps}
    updates = {k: v for k, v in steps.items() if current[k] is None}
    return merge(cfg, updates) if updates else cfg


def preset(name: str = "tiny", **overrides) -> RLHFConfig:
    """Named presets; 'tiny' is the embedded default (the field defaults themselves)."""
    if name != "tiny":
        raise ValueError(f"unknown preset {name!r}; known: tiny")
    base = RLHFConfig()
    return merge(base, overrides) if overrides else base


def merge(config, overrides: dict):
    """Deep-merge a (possibly dotted-key) dict into a config (an RLHFConfig, a RunConfig, any section) and
    re-validate it as its own class."""
    data = config.model_dump()
    for key, value in overrides.items():
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        if isinstance(value, dict) and isinstance(target.get(parts[-1]), dict):
            target[parts[-1]] = _deep_update(target[parts[-1]], value)
        else:
            target[parts[-1]] = value
    return type(config).model_validate(data)


def deep_merge(base: dict, new: dict) -> dict:
    """`new` over `base`, mappings merged key by key at every depth (a value that is not a mapping replaces)."""
    return _deep_update(base, new)


def _deep_update(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, preset_name: str = "tiny", overrides: dict | None = None,
                defaults: dict | None = None) -> RLHFConfig:
    """Preset, then an entry point's own `defaults` (e.g. where `rlhf train` runs its parts), then a YAML file (any
    subset of the tree: what the run trains, and its `deploy` section), then dotted-key overrides."""
    config = preset(preset_name, **(defaults or {}))
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
        config = merge(config, data)
    return merge(config, overrides) if overrides else config
