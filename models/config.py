"""One pydantic config tree for every flow, server and script.

Every field carries its default and a one-sentence description (shown in the Prefect UI form, by `rlhf config` and
`rlhf config --describe`); what there is to know beyond that sentence is in the docs page the description names, and
docs/reference/config.md (generated from this tree) says how a run's config is put together (`LAYERS`).

Defaults: the field defaults fit a real model (a ~0.5B-7B instruct model on GPUs, the settings TRL, OpenRLHF and veRL
use: actor learning rate 1e-6, critic 1e-5, bf16 compute, 256 new tokens, micro-batches of 8). The embedded tiny
models need other values (learning rates 3e-4 / 1e-3, 16 new tokens, float32, the shipped task's prompts): those are
the `tiny` preset's (`PRESETS`), which a config names (`preset: tiny`, `rlhf train --preset tiny`, ppo/default's
parameters); nothing picks a preset for a config that does not name one. Where the run's parts run is the deployment's
(`deploy`, models/deploy.py), with its own named placements.

Fields left None that a run derives when it starts (models/prepare.py): model.reward = the policy family's own
(tiny/reward for the tiny policy); model.critic = the reward model when it shares the policy's tokenizer, else the
policy; the schedules' total_steps from the run's length; reward.transport; the gold reward is the shipped task's only
on the shipped task. The actor's loss is the recipe's (`algorithm`, models/algorithms/recipes.py: each `loss.*` /
`kl.*` field left unset takes its recipe's value, as the recipe's paper and TRL/veRL define it); the rest follows
NeMo-Aligner where it has a setting (gae_lambda 0.95, discount 1.0, critic loss_clip_val 0.2, grad clip 1.0).
examples/ holds complete configs for a ~0.5B instruct model.
"""

from __future__ import annotations

import math
import re
import secrets
import time
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import yaml
from pydantic import BaseModel, Field, PositiveInt, create_model, model_validator

from models.advantages import KL_ESTIMATORS
from models.algorithms import ALGORITHMS, LossConfig, resolve
from models.algorithms.recipes import refuse_old_spellings
from models.deploy import DeployConfig
from models.resolve import Reads, Resolved, Sources, Want
from models.sections import OptimConfig, Section, deep_merge, given, nested


class LoraConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("dropout",)  # --describe --all
    enabled: bool = Field(
        False, description="Train LoRA adapters instead of all weights (the reference: the base with adapters off).")
    r: PositiveInt = Field(8, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: Optional[list[str]] = Field(
        None, description="Module names to adapt; None = peft's default for the architecture.")


class ModelConfig(Section):
    policy: str = Field(
        "tiny/policy",
        description="The actor: a local directory, a hub id, s3://bucket/prefix or tiny/<name> (docs/sources.md).")
    revision: Optional[str] = Field(
        None,
        description="Hub revision (branch, tag or commit) of model.policy, and of reward or critic naming its id.")
    reward: Optional[str] = Field(
        None,
        description="Reward model (one-label classifier) for reward.source=model; None = tiny/reward for tiny/policy.")
    teacher: Optional[str] = Field(
        None, description="algorithm=opd: the teacher model, which must share the policy's tokenizer.")
    critic: Optional[str] = Field(
        None, description="Critic checkpoint (one-label token classifier); None = from model.reward or model.policy.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings for the actor.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Compute dtype of the actor, critic and reward model (autocast; master weights stay float32).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory for ~1 more forward pass.")


class GenerationConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("recompute_logprobs", "micro_batch_size")  # --describe --all
    max_new_tokens: PositiveInt = Field(
        256, description="Longest response in tokens; one without EOS by then is truncated.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; training logprobs use the same temperature.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 disables).")
    recompute_logprobs: Optional[bool] = Field(
        None, description="Recompute behaviour logprobs after sampling; None = only when model.dtype is not float32.")
    micro_batch_size: PositiveInt = Field(
        8, description="Sequences per forward pass (logprobs, critic requests, training micro-batches).")


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
    """The KL to the frozen reference policy: its coefficient, estimator and place (part of the loss menu: a field
    left unset takes the recipe's value, docs/algorithms.md)."""
    advanced: ClassVar[tuple[str, ...]] = ("horizon",)  # --describe --all

    beta: Optional[float] = Field(
        None, ge=0,
        description="KL coefficient (initial, with adaptive); 0 skips the reference model; None = the recipe's.")
    placement: Optional[Literal["reward", "loss"]] = Field(
        None, description="Where the KL goes: subtracted from the reward or added to the loss; None = the recipe's.")
    estimator: Optional[Literal[tuple(KL_ESTIMATORS)]] = Field(
        None, description="Per-token KL estimator: k1, abs, k2, k3 or k3+; None = the recipe's.")
    adaptive: bool = Field(False, description="Adapt beta towards `target` (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0, description="Target KL (nats per sequence) for the adaptive controller.")
    horizon: PositiveInt = Field(10000, description="Horizon (in samples) of the adaptive controller.")


class CriticOptim(OptimConfig):
    """The critic's optimiser: the actor's settings at a critic's learning rate."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate (AdamW; 1e-5 as veRL's and OpenRLHF's critics).")


class CriticConfig(Section):
    """How the critic (value model) trains; where its server runs is the deployment's (deploy.critic)."""

    combine_reward: bool = Field(
        True, description="Serve the reward model in the critic server: values and rewards in one call.")
    loss_clip_val: float = Field(0.2, gt=0, description="Clip range of the value loss.")
    train_batch_size: PositiveInt = Field(32, description="Sequences per critic optimizer step (global batch).")
    micro_batch_size: PositiveInt = Field(
        8, description="Sequences per critic forward pass (inference chunks and gradient accumulation).")
    epochs: PositiveInt = Field(2, description="Critic epochs per critic_train call.")
    optim: CriticOptim = Field(default_factory=CriticOptim, description="Critic optimiser.")


FUNCTION_SPEC = re.compile(r"^(?:[\w.]+|.+\.py):\w+$")  # 'package.module:fn' or 'path/to/rewards.py:fn'


class StoredFile(Section):
    """A file a run stored in its store where it started (a reward file): its digest and where the copy is."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes.")
    uri: str = Field(description="The stored copy: <run store>/rewards/<sha256>.py (file:// or s3://).")


class RewardConfig(Section):
    """What scores the responses: a reward model, or Python reward functions (TRL's reward_funcs / reward_weights).
    A function is 'package.module:fn' (importable where it scores) or 'path/to/rewards.py:fn' (a file; a relative
    path is resolved against the working directory of the process that starts the run). A run reads each such file
    once where it starts and stores its bytes in its store (reward.files); every process that scores (the reward
    server in another directory or pod, the actor's rank 0) loads those bytes by their digest, never the path, so a
    file that exists only where the run starts needs no image rebuild."""
    advanced: ClassVar[tuple[str, ...]] = ("transport", "files")  # --describe --all

    source: Literal["model", "function"] = Field(
        "model", description="Score responses with the reward model or with reward functions.")
    function: Optional[str] = Field(
        None, description="One reward function: 'package.module:fn' or 'path/to/rewards.py:fn' (docs/sources.md).")
    functions: Optional[list[str]] = Field(
        None,
        description="Reward functions (TRL's reward_funcs), each as reward.function; their weighted sum is the score.")
    weights: Optional[list[float]] = Field(
        None, description="Weight of each of reward.functions (TRL's reward_weights); None = 1 each.")
    gold: Optional[str] = Field(
        None,
        description="Gold reward function logged as objective/gold_reward; None = the builtin task's own, if any.")
    transport: Literal["auto", "tokens", "text"] = Field(
        "auto", description="How rollouts reach the reward model: tokens, text, or auto (text when tokenizers differ).")
    chat_template: bool = Field(
        False, description="With text transport, format prompt and response with the reward model's chat template.")
    files: Optional[dict[str, StoredFile]] = Field(
        None, description="Set by the run (leave unset): each reward file's sha256 and its copy in the run's store.")
    normalize: bool = Field(
        False, description="Standardise reward-model scores with the reward_mean and reward_std its config.json holds.")

    @model_validator(mode="after")
    def _function_given(self) -> "RewardConfig":
        if self.function and self.functions:
            raise ValueError("reward.function and reward.functions are both set: give one function as "
                             "reward.function, or several as reward.functions (with reward.weights)")
        for name, value in (("function", self.function), ("gold", self.gold),
                            *((f"functions[{i}]", v) for i, v in enumerate(self.functions or []))):
            if value is not None and not FUNCTION_SPEC.match(value):
                raise ValueError(f"reward.{name} must look like 'package.module:function' or "
                                 f"'path/to/rewards.py:function', got {value!r}")
        if self.weights is not None:
            if not self.functions:
                raise ValueError("reward.weights weighs reward.functions; it is set without reward.functions")
            if len(self.weights) != len(self.functions):
                raise ValueError(f"reward.weights has {len(self.weights)} weight(s) for {len(self.functions)} "
                                 f"reward.functions: give one per function")
            if not all(math.isfinite(w) for w in self.weights):
                raise ValueError(f"reward.weights must be finite numbers, got {self.weights}")
        return self

    def specs(self) -> list[str]:
        """The reward functions of source='function', in order (reward.function or reward.functions)."""
        return [self.function] if self.function else list(self.functions or [])

    def function_weights(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.specs())

    def function_names(self) -> list[str]:
        """Each reward function's name in metrics (rewards/<name>/mean): its function name, '_2', '_3'... added to
        a name already taken."""
        names: list[str] = []
        for spec in self.specs():
            base = spec.rpartition(":")[2]
            name, n = base, 1
            while name in names:
                n += 1
                name = f"{base}_{n}"
            names.append(name)
        return names


PROMPT_SOURCES = "a file, folder, hub id, s3:// URI or builtin:<task> (docs/data.md)"  # a data source, in short


class DataConfig(Section):
    """The training prompts (models/data.py): read with HF `datasets`; every column besides the prompt reaches the
    reward functions."""
    advanced: ClassVar[tuple[str, ...]] = ("long_prompts",)  # --describe --all

    prompts: Optional[str] = Field(None, description=f"Training prompts: {PROMPT_SOURCES}.")
    subset: Optional[str] = Field(
        None, description="Configuration (subset) of a data set that has several, e.g. 'main' of openai/gsm8k.")
    revision: Optional[str] = Field(
        None, description="Hub revision (branch, tag or commit) of data.prompts when it is a hub data set id.")
    split: str = Field("train", description="Split to read (a single file is this split).")
    prompt_key: str = Field(
        "prompt",
        description="Column holding the prompt: a string, or chat messages rendered with the policy's template.")
    options: Optional[dict[str, Any]] = Field(
        None,
        description="Options of a generated source (reasoning_gym:<task>): size, seed, the task's own (docs/data.md).")
    chat_template: bool = Field(
        False, description="Wrap a plain-string prompt as a user turn of the policy's chat template.")
    max_prompt_length: Optional[PositiveInt] = Field(
        None, description="Longest prompt in policy tokens (None = no limit); a longer one: long_prompts.")
    long_prompts: Literal["error", "filter", "truncate_left"] = Field(
        "error",
        description="A prompt over max_prompt_length: refuse the data (error), drop it (filter) or keep its end.")


class EvalConfig(Section):
    """Held-out evaluation: the policy samples on prompts it does not train on, scored by the run's reward and the
    gold reward. It adds no trainer step and leaves the training stream as it is (its own sampling seed)."""
    advanced: ClassVar[tuple[str, ...]] = ("table_rows",)  # --describe --all

    prompts: Optional[str] = Field(None, description="Held-out prompts, a data source as data.prompts; None = no eval.")
    subset: Optional[str] = Field(None, description="Configuration (subset) of eval.prompts, as data.subset.")
    revision: Optional[str] = Field(None, description="Hub revision of eval.prompts, as data.revision.")
    split: str = Field("test", description="Split of eval.prompts to read (a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the eval prompt (as data.prompt_key).")
    options: Optional[dict[str, Any]] = Field(
        None,
        description="Options of a generated eval source, as data.options (the same task parameters: held-out rows).")
    max_prompts: Optional[PositiveInt] = Field(None, description="Evaluate on the first N rows only (None = all).")
    every: int = Field(
        0, ge=0, description="Evaluate every N iterations, before the first update and at the end (0 = never).")
    samples_per_prompt: PositiveInt = Field(1, description="Responses sampled per eval prompt (k of pass@k).")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    success_threshold: Optional[float] = Field(
        None, description="A sample succeeds at a score of at least this; None = when all scores are 0 or 1, at 1.")
    table_rows: PositiveInt = Field(32, description="Eval samples shown in the Prefect artifact and the MLflow table.")


class TrackingConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("table_every", "parent_run_id")  # --describe --all
    experiment: str = Field("rlhf-flows", description="MLflow experiment name.")
    table_every: PositiveInt = Field(
        5, description="Log a table of sample prompts/responses/rewards every N iterations.")
    register_as: Optional[str] = Field(
        None, description="Register the run's exported model in the MLflow registry under this name (None = not).")
    parent_run_id: Optional[str] = Field(
        None, description="MLflow run id to nest this run under (a sweep sets it); None = a top-level run.")


class CheckpointConfig(Section):
    """How often a run checkpoints; where the checkpoints go is the deployment's (deploy.checkpoint)."""

    every: PositiveInt = Field(5, description="Checkpoint every N iterations (and at the end).")
    keep_last: PositiveInt = Field(2, description="Keep this many newest checkpoints.")


class VLLMConfig(Section):
    """What the vLLM rollout engine computes with; where its server runs is the deployment's (deploy.rollout)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16", description="Dtype of the engine's weights and compute (each refit is cast to it).")


class RolloutConfig(Section):
    engine: Literal["native", "vllm"] = Field(
        "native",
        description="What samples the rollouts: native (the actor's own module) or vllm (the rollout server).")
    max_off_policy_steps: int = Field(
        0, ge=0, description="Batches the rollout server may sample ahead of the actor (0 = synchronous rollouts).")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="The vLLM rollout server (rollout.engine=vllm).")

    @model_validator(mode="after")
    def _async_needs_an_engine_of_its_own(self) -> "RolloutConfig":
        if self.max_off_policy_steps and self.engine == "native":
            raise ValueError(f"rollout.max_off_policy_steps={self.max_off_policy_steps} needs an engine with its own "
                             f"weights (rollout.engine=vllm): the native engine samples with the actor's module, which "
                             f"cannot generate while it trains")
        return self


class VerifiersConfig(Section):
    """A verifiers environment (the classic API, verifiers 0.2.1 in its own environment, `make verifiers-venv`): run
    unchanged by verifiers' own code against the run's rollout server (its OpenAI-compatible endpoints, token ids on
    every turn), its rubric the reward (components/verifiers/, docs/environments.md)."""

    id: str = Field(
        ..., min_length=1, description="The environment's module, as vf.load_environment(id, **args) imports it.")
    args: dict = Field(default_factory=dict, description="Keyword arguments of load_environment.")
    paths: list[str] = Field(
        default_factory=list, description="Folders searched first for the environment's module (its PYTHONPATH).")
    client_type: Literal["openai_chat_completions_token", "openai_chat_completions"] = Field(
        "openai_chat_completions_token",
        description="verifiers' client: token ids in (one token sequence per rollout) or chat messages in.")
    timeout_s: float = Field(
        600.0, gt=0,
        description="Deadline of one batch of rollouts; past it the worker is killed and the iteration fails.")
    max_concurrent: PositiveInt = Field(32, description="Groups (the k rollouts of a prompt) verifiers runs at once.")


class EnvironmentConfig(Section):
    """Multi-turn rollouts against environments (models/environments/, docs/environments.md): each rollout is an
    episode of model turns and environment replies, built in token ids; the environments and the reward functions
    run in worker processes with deadlines."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "call_deadline_s", "episode_deadline_s", "single_session",
    )

    factory: Optional[Union[str, dict[str, str]]] = Field(
        None,
        description="TRL's environment_factory: 'path/env.py:Class', 'module:Class' or name -> spec; None = one turn.")
    max_turns: Optional[PositiveInt] = Field(
        None, description="Tool-calling rounds after the first reply (TRL's max_tool_calling_iterations); None = any.")
    chat_template: Optional[str] = Field(
        None, description="A chat template file (.jinja) for the episodes instead of the policy's own.")
    workers: PositiveInt = Field(
        4, description="Worker processes per actor rank that run the environments and the reward functions.")
    call_deadline_s: float = Field(
        60.0, gt=0,
        description="Deadline of one call into an environment or a reward function (the worker is then killed).")
    episode_deadline_s: float = Field(
        300.0, gt=0, description="Deadline of an episode's calls into its environment, summed over its turns.")
    single_session: Literal["serialise", "refuse"] = Field(
        "serialise",
        description="An environment that serves one session at a time: run its episodes in turn, or refuse it.")
    verifiers: Optional[VerifiersConfig] = Field(
        None,
        description="A verifiers environment instead of factory: its data, rubric, episodes (docs/environments.md).")

    @model_validator(mode="after")
    def _specs(self) -> "EnvironmentConfig":
        if self.factory is not None and self.verifiers is not None:
            raise ValueError("environment.factory and environment.verifiers are both set: a run's episodes come from "
                             "one kind of environment")
        specs = {"": self.factory} if isinstance(self.factory, str) else dict(self.factory or {})
        if isinstance(self.factory, dict) and not self.factory:
            raise ValueError("environment.factory: an empty mapping; give 'path/to/env.py:Class' or a mapping "
                             "name -> spec")
        for name, spec in specs.items():
            if not FUNCTION_SPEC.match(spec):
                where = f"environment.factory.{name}" if name else "environment.factory"
                raise ValueError(f"{where} must look like 'package.module:Class' or 'path/to/env.py:Class', "
                                 f"got {spec!r}")
        return self

    @property
    def enabled(self) -> bool:
        """An environment run: episodes scored where they are played (no reward server)."""
        return self.factory is not None or self.verifiers is not None

    def factories(self) -> dict[str | None, str]:
        """{environment name: spec}; the single factory's name is None (every row uses it)."""
        return {None: self.factory} if isinstance(self.factory, str) else dict(self.factory or {})


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # a directory name and an S3 key part: no '/', no '..'

# The named presets (a run config's `preset`): values for what a run's config leaves unset, over the field defaults
# (which fit a real model on GPUs); docs/reference/config.md lists them, generated from here
PRESETS: dict[str, dict] = {
    "none": {},
    # the embedded tiny models (a 2-core CPU trains them in minutes): `make demo`, ppo/default, `rlhf train` alone
    "tiny": {"model.policy": "tiny/policy", "model.reward": "tiny/reward", "model.dtype": "float32",
             "data.prompts": "builtin:sentiment", "generation.max_new_tokens": 16, "generation.micro_batch_size": 64,
             "critic.micro_batch_size": 32, "critic.optim.lr": 1e-3, "rollout.vllm.dtype": "float32",
             **{f"{a.section}.optim.lr": 3e-4 for a in ALGORITHMS.values()}},
}


class _Tree(Section):
    """What a run trains (one per run); every registered algorithm adds its own section (models/algorithms/). Where its
    parts run is the deployment's (models/deploy.py)."""
    named: ClassVar[str] = "preset"
    named_values: ClassVar[dict[str, dict]] = PRESETS

    preset: Literal[tuple(PRESETS)] = Field(
        "none", description="Named values for the fields this config does not give: none or tiny (the tiny models').")

    algorithm: Literal[tuple(ALGORITHMS)] = Field(
        "ppo",
        description="The recipe: ppo, rloo, grpo, dr_grpo, dapo, gspo, cispo, reinforce_pp, opd (docs/algorithms.md).")
    run_name: Optional[str] = Field(
        None, pattern=RUN_NAME_PATTERN,
        description="Name of the run (letters, digits, '.', '_', '-'): the same name resumes it; None = generated.")
    iterations: PositiveInt = Field(12, description="Training iterations (rollout + update).")
    seed: int = Field(0, description="Seed of prompts order, sampling and initialisation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Models.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine.")
    environment: EnvironmentConfig = Field(
        default_factory=EnvironmentConfig, description="Environments and tools: multi-turn rollouts (none by default).")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollout sampling.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the frozen reference policy.")
    loss: LossConfig = Field(
        default_factory=LossConfig,
        description="The actor's loss: the menu every recipe shares (unset fields: the recipe's).")
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="Critic (value model) training (algorithms with a critic).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward source.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resume.")

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data):
        refuse_old_spellings(data)
        return data

    @model_validator(mode="after")
    def _recipe(self):
        """What the resolved loss settings need (models/algorithms/recipes.resolve), refused naming the field."""
        settings = resolve(self)
        family = ALGORITHMS[self.algorithm]
        if (settings.advantage_estimator == "gae") != family.needs_critic:
            need = ("a critic: only algorithm=ppo has one" if settings.advantage_estimator == "gae"
                    else "gae (ppo has a critic)")
            raise ValueError(f"loss.advantage_estimator={settings.advantage_estimator!r} needs {need}")
        if self.kl.adaptive and settings.kl_beta == 0:
            raise ValueError("kl.adaptive: the controller multiplies kl.beta, which is 0 for this recipe; "
                             "set kl.beta > 0")
        if settings.dynamic_sampling:
            if family.needs_critic:
                raise ValueError("loss.dynamic_sampling drops prompts whose k samples all scored alike: it needs k > 1 "
                                 "samples per prompt (a critic-free recipe, e.g. algorithm=dapo)")
            if self.environment.enabled:
                raise ValueError("loss.dynamic_sampling: not available for environment runs yet (their episodes are "
                                 "played once per iteration); set loss.dynamic_sampling=false")
            if self.rollout.max_off_policy_steps:
                raise ValueError("loss.dynamic_sampling: the next batches are already in flight with asynchronous "
                                 "rollouts (rollout.max_off_policy_steps > 0); set one of them off")
        if family.needs_teacher and not self.model.teacher:
            raise ValueError("model.teacher: algorithm=opd distils from a teacher; name it (a directory, hub id, "
                             "s3://bucket/prefix or tiny/<name>)")
        if settings.menu.policy_loss == "vespo" and settings.correction_mode.startswith("sequence"):
            raise ValueError("loss.vllm_importance_sampling_mode: vespo folds per-token mismatch weights into its own; "
                             "use token_truncate or token_mask (as TRL)")
        return self

    @model_validator(mode="after")
    def _reward_source(self):
        r, env = self.reward, self.environment
        if env.enabled:
            if r.source != "function":
                raise ValueError("reward.source: an environment run is scored by its environments' get_reward and "
                                 "reward functions (reward.functions, which may take environments=); set "
                                 "reward.source=function")
            if self.rollout.max_off_policy_steps:
                raise ValueError(f"rollout.max_off_policy_steps={self.rollout.max_off_policy_steps}: an environment "
                                 f"run's episodes are sampled turn by turn with the current weights; set it to 0")
            if env.verifiers is not None:
                if r.specs():
                    raise ValueError("reward.functions: a verifiers environment's rubric scores its rollouts; leave "
                                     "reward.function and reward.functions unset")
                if self.rollout.engine != "vllm":
                    raise ValueError("rollout.engine: environment.verifiers runs verifiers' clients against the "
                                     "rollout server's OpenAI-compatible endpoints; set rollout.engine=vllm")
        elif r.source == "function" and not r.specs():
            raise ValueError("reward.function (or reward.functions) is required when reward.source='function' "
                             "(format 'package.module:function' or 'path/to/rewards.py:function')")
        return self


SOURCES_DESCRIPTION = "What the job reads, pinned once where it starts (set by the job; models/resolve.py)."

RunConfig = create_model(
    "RunConfig", __base__=_Tree, __module__=__name__, __doc__=_Tree.__doc__,
    **{a.section: (a.Config, Field(default_factory=a.Config, description=a.description)) for a in ALGORITHMS.values()})


class RLHFConfig(RunConfig):
    """A run as its processes receive it: what it trains (the run's config) and where its parts run (`deploy`)."""

    job: ClassVar[str] = "rl"  # what components/runs.py builds for it (the other jobs: models/stages/config.py)
    deploy: DeployConfig = Field(
        default_factory=DeployConfig, description="Where the run's parts run (set by the deployment).")
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)

    @model_validator(mode="after")
    def _every_rank_gets_prompts(self):
        world, section = self.deploy.actor.world_size, ALGORITHMS[self.algorithm].section
        batch = getattr(self, section).rollout_batch_size
        if batch < world:
            raise ValueError(f"{section}.rollout_batch_size={batch} is smaller than the actor's world size {world} "
                             f"(deploy.actor.nnodes x deploy.actor.nproc_per_node): every rank needs at least one "
                             f"prompt")
        return self

    @classmethod
    def of(cls, run: "RunConfig", deploy: DeployConfig | None = None) -> "RLHFConfig":
        """A run's config with the deployment's settings."""
        return cls.model_validate({**run.model_dump(), "deploy": (deploy or DeployConfig()).model_dump()})

    @property
    def run(self) -> "RunConfig":
        """What the run trains, without the deployment's settings."""
        return RunConfig.model_validate(self.model_dump(exclude={"deploy", "sources"}))

    @property
    def name_prefix(self) -> str:
        """Of a generated run name: '<algorithm>-<timestamp>-<random>'."""
        return self.algorithm

    @property
    def critic_carries_reward(self) -> bool:
        """Whether the critic serves the reward model's scores too (critic.combine_reward with a reward model; a
        reward function is scored where deploy.reward says)."""
        return self.critic.combine_reward and self.reward.source == "model"

    def resolved_state_dir(self) -> Path:
        return self.deploy.resolved_state_dir()

    def reads(self) -> Reads:
        """What the run reads (pinned once where it starts: models/resolve.pin): every model it names (a hub id at
        model.revision when it is the policy's; the teacher when its algorithm distils), its prompts and held-out
        prompts (a verifiers environment's are its own)."""
        m, d, e = self.model, self.data, self.eval
        names = ("policy", "reward", "critic") + (("teacher",) if ALGORITHMS[self.algorithm].needs_teacher else ())
        models = {f"model.{name}": Want(value, m.revision if value == m.policy else None)
                  for name in names if (value := getattr(m, name))}
        data = {}
        if not self.environment.verifiers:
            if d.prompts:
                data["data.prompts"] = Want(d.prompts, d.revision, d.subset, d.options)
            if e.prompts and e.every:
                data["eval.prompts"] = Want(e.prompts, e.revision, e.subset, e.options)
        return Reads(models, data)

    def source(self, field: str) -> Resolved:
        """The pin of a source the run reads (`reads`), as this machine has it (models/resolve.py); nothing resolves."""
        return self.sources.local(field, self.reads(), self.deploy)

    def local_path(self, field: str) -> str:
        """The local directory (or file) of a model or data field the run reads, as pinned (`source`)."""
        return self.source(field).path


def run_name_for(cfg) -> str:
    """A job's run name, whatever the job (an RL run, a stage, an eval): its run_name, or
    '<name_prefix>-<timestamp>-<random>' (an RL run's algorithm, a stage's name: two unnamed runs started in the same
    second get names of their own)."""
    prefix = getattr(cfg, "name_prefix", None) or cfg.algorithm  # a RunConfig (no deployment yet): its algorithm
    return cfg.run_name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def with_schedule_lengths(cfg: RLHFConfig) -> RLHFConfig:
    """Fill `total_steps` of the actor's and the critic's LR schedules, where left at None, with the optimizer steps
    the run will take."""
    algorithm = ALGORITHMS[cfg.algorithm]
    actor = algorithm.settings(cfg)
    rollouts = algorithm.rollouts_per_iteration(actor)
    steps = {
        f"{algorithm.section}.optim.total_steps":
            cfg.iterations * actor.epochs * math.ceil(rollouts / actor.minibatch_size),
        "critic.optim.total_steps":
            cfg.iterations * cfg.critic.epochs * math.ceil(rollouts / cfg.critic.train_batch_size),
    }
    current = {f"{algorithm.section}.optim.total_steps": actor.optim.total_steps,
               "critic.optim.total_steps": cfg.critic.optim.total_steps}
    updates = {k: v for k, v in steps.items() if current[k] is None}
    return merge(cfg, updates) if updates else cfg


# How a run's config is put together: each layer over the ones before it (docs/reference/config.md renders this;
# tests/models/test_config.py sets one field at every layer and checks that each wins over the ones before it)
LAYERS = (
    ("Field defaults", "Each field's default (below): values for a real model on GPUs."),
    ("Preset and placement", "The values the config's `preset` (tiny) and `deploy.placement` (in_process, cluster) "
     "name, for every field the layers above them leave unset. A file, `--preset` / `--placement` or a flow run's "
     "parameters name them; a command's own placement (`rlhf train`, `rlhf pipeline`: in_process; "
     "`rlhf cluster manifests`: cluster) when nothing does. Nothing picks a preset from the model."),
    ("The file or the deployment's parameters", "`--config FILE` on the command line; a deployment's `config` and "
     "`deploy` parameters (prefect.yaml, `rlhf up`) for a flow run. Any subset of the tree."),
    ("The overrides or the flow run's parameters", "`--set KEY=VALUE` (then `--preset`, `--placement`); a flow run's "
     "`config` and `deploy`, each deep-merged over its deployment's (Prefect replaces a parameter whole). A flow "
     "run's parameter that names another preset or placement than its deployment's stands alone, over the one it "
     "names."),
    ("Derivations", "Fields left None that the run derives when it starts: `loss.*` and `kl.*` from the recipe, "
     "`model.reward` and `model.critic`, the schedules' `total_steps`, `reward.transport`; a pipeline sets its RL "
     "stage's models and run name."),
)


def preset(name: str = "tiny", **overrides) -> RLHFConfig:
    """A named preset ('tiny': the embedded tiny models' values; 'none': the field defaults), then `overrides`."""
    return from_layers({"preset": name}, overrides)


def from_layers(*layers: dict) -> RLHFConfig:
    """A config from partial layers (nested and/or dotted keys), each deep-merged over the one before, then over the
    preset and the placement they name (LAYERS)."""
    data: dict = {}
    for layer in layers:
        data = deep_merge(data, nested(given(layer or {})))
    return RLHFConfig.model_validate(data)


def merge(config, overrides: dict):
    """Deep-merge a (possibly dotted-key) dict into a config (an RLHFConfig, a RunConfig, any section) and
    re-validate it as its own class. Its preset and placement stay: their values are in it already."""
    changes = nested(overrides)
    refuse_renamed(config, changes)
    return type(config).model_validate(deep_merge(config.model_dump(), changes))


def refuse_renamed(config: BaseModel, changes: dict, prefix: str = "") -> None:
    """Raise when `changes` name another preset or placement than a built config's (its values are in it already)."""
    named = getattr(type(config), "named", "")
    if named and named in changes and changes[named] != getattr(config, named):
        raise ValueError(f"{prefix}{named}: {changes[named]!r} cannot replace {getattr(config, named)!r} in a config "
                         f"already built with it; name it where the config is built (a file, --{named}, a flow "
                         f"run's parameters)")
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(getattr(config, key, None), BaseModel):
            refuse_renamed(getattr(config, key), value, f"{prefix}{key}.")


def load_config(path: str | Path | None = None, overrides: dict | None = None, preset: str | None = None,
                placement: str | None = None, default_placement: str | None = None) -> RLHFConfig:
    """A run's config as the CLI builds it (LAYERS): a YAML file (any subset of the tree: what the run trains, and its
    `deploy` section), then dotted-key overrides, over the preset and the placement they name; `preset` and
    `placement` (--preset, --placement) name them over what the file says; `default_placement` is the command's own,
    when nothing names one."""
    data = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return from_layers({"deploy": {"placement": default_placement}} if default_placement else {}, data,
                       overrides or {}, {"preset": preset} if preset else {},
                       {"deploy": {"placement": placement}} if placement else {})


def describe(section=None, prefix: str = "", advanced: bool = True) -> list[tuple[str, str, str, str]]:
    """(dotted field, type, default, description) of every field of a config tree (an RLHFConfig of field defaults
    unless `section` is given: any config, a pipeline's, a stage's, a sweep's), depth first; a section that is absent
    by default (Optional) is described with its fields too: what `rlhf config --describe` prints. `advanced`=False
    leaves out the fields each section marks advanced (request limits, threads and cores, timeouts, ports)."""
    section = section if section is not None else RLHFConfig()
    rows = []
    for name, field in type(section).model_fields.items():
        if not advanced and (name in getattr(type(section), "advanced", ()) or field.annotation is Sources):
            continue  # advanced, or the pins a job sets where it starts: not a user's
        value, annotation = getattr(section, name), field.annotation
        nested = value if isinstance(value, BaseModel) else optional_section(annotation)
        if nested is not None:
            rows.append((f"{prefix}{name}", "section", "" if value is not None else "None (absent unless given)",
                         field.description or ""))
            rows += describe(nested, f"{prefix}{name}.", advanced)
            continue
        kind = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
        rows.append((f"{prefix}{name}", kind, repr(value), field.description or ""))
    return rows


def optional_section(annotation) -> BaseModel | None:
    """The default instance of the section an Optional[Section] field holds when given; None for any other field."""
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            try:
                return arg()
            except ValueError:  # a section with required fields
                return None
    return None
