"""One pydantic config tree for every flow, server and script.

Every field carries its default and a one-line description (shown in the Prefect UI form, by `rlhf config` and
`rlhf config --describe`).

Defaults: the field defaults fit a real model (a ~0.5B-7B instruct model on GPUs, the settings TRL, OpenRLHF and veRL
use: actor learning rate 1e-6, critic 1e-5, bf16 compute, 256 new tokens, micro-batches of 8). The embedded tiny
models need other settings (learning rates 3e-4 / 1e-3, 16 new tokens, float32, the shipped task's prompts): those
are the `tiny` preset's alone (`_tiny` below). The preset is chosen by the policy: a config whose `model.policy` is the
embedded tiny policy (or unset) gets the `tiny` preset's values for every field it leaves unset, any other policy the
field defaults (`preset_for`; `rlhf ... --preset tiny|none` chooses explicitly). So a partial config runs the demo end
to end on a 2-core CPU, and a user's model never inherits the tiny model's settings.

Models that are not given follow the policy's family or must be given: model.reward = the family's own (tiny/reward
for the tiny policy; any other policy needs one for reward.source='model'); model.critic = the reward model when it
shares the policy's tokenizer, else the policy (models/prepare.py). The gold reward is the shipped task's only when
the data is the shipped task (reward.gold None + data.prompts builtin:*). The actor's loss is the recipe's
(`algorithm`, models/algorithms/recipes.py: each `loss.*` / `kl.*` field left unset takes its recipe's value, as the
recipe's paper and TRL/veRL define it); the rest follows NeMo-Aligner where it has a setting (gae_lambda 0.95,
discount 1.0, critic loss_clip_val 0.2, grad clip 1.0). examples/ holds complete configs for a ~0.5B instruct model.
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
from models.sections import STATE_DIR_ENV, OptimConfig, Section, default_state_dir  # noqa: F401 (re-exported)
from models.tiny_files import TINY_PREFIX, embedded_model_path, is_embedded, is_tiny_policy  # noqa: F401 (re-exported)


class LoraConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("dropout",)  # --describe --all
    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights; the reference is the actor with adapters disabled (no copy).")
    r: PositiveInt = Field(8, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: Optional[list[str]] = Field(None, description="Module names to adapt; None lets peft pick the architecture's default.")


class ModelConfig(Section):
    policy: str = Field("tiny/policy", description="The actor: a local directory saved with save_pretrained, a hub id 'org/name' (read from the Hugging Face cache offline; downloaded into it only where deploy.cache.hub_downloads allows), s3://bucket/prefix (fetched once per machine into deploy.cache.dir, checked by digest), or 'tiny/<name>', the embedded default shipped with the package (tiny/policy, tiny/reward, tiny/critic, tiny/reward-chars; tiny/chat: a small chat model with Qwen2.5's chat template, for environments and tools); tiny/policy brings the `tiny` preset's settings.")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit) of model.policy when it is a hub id, and of model.reward / model.critic when they name the same id; None = the repository's main branch.")
    reward: Optional[str] = Field(None, description="Sequence-classification reward model (num_labels=1) for reward.source='model' (a directory, hub id, s3://bucket/prefix or tiny/<name>); None = the policy family's own: tiny/reward for the embedded tiny policy, required for any other policy.")
    teacher: Optional[str] = Field(None, description="algorithm=opd: the teacher whose per-token logprobs of the student's samples are the signal (a causal LM, as model.policy: a directory, hub id, s3://bucket/prefix or tiny/<name>); it reads the policy's tokens, so it must share the policy's tokenizer.")
    critic: Optional[str] = Field(None, description="Critic checkpoint, read as token classification with one label (a critic saved by a run, or a checkpoint of the policy's family, given a new value head); it reads the policy's tokens, so it must share the policy's tokenizer. None = initialised from model.reward when that shares the policy's tokenizer (NeMo-Aligner), else from model.policy (veRL, OpenRLHF).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings for the actor.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="Compute dtype of the actor, critic and reward model (mixed precision; the tiny preset uses float32, and the exported model is saved in it): 'bfloat16' computes under autocast while the trained weights, their gradients and AdamW states stay float32 (master weights); with FSDP2 the weights are also all-gathered in it and gradients reduced in float32; the frozen reference is stored in it. 'float16' has no loss scaling: prefer bfloat16 (docs/memory.md).")
    gradient_checkpointing: bool = Field(False, description="Activation (gradient) checkpointing of the actor and the critic: each transformer block keeps only its input for the backward pass and recomputes the rest there, so activation memory drops to about one block's for roughly one more forward pass of compute (docs/memory.md).")


class GenerationConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("recompute_logprobs", "micro_batch_size")  # --describe --all
    max_new_tokens: PositiveInt = Field(256, description="Longest response in tokens; a response without EOS by then is truncated (is_end=False). 256 as veRL's GSM8K quickstart; the tiny preset uses 16.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; logprobs for training use the same temperature.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 disables).")
    recompute_logprobs: Optional[bool] = Field(None, description="Recompute behaviour logprobs with a full forward pass after sampling; None = only when dtype is not float32 (in float32 without dropout they equal the sampling-time logprobs).")
    micro_batch_size: PositiveInt = Field(8, description="Sequences per forward pass for logprobs, critic requests and training micro-batches (memory, not the math: raise it while it fits); the tiny preset uses 64.")


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

    beta: Optional[float] = Field(None, ge=0, description="KL coefficient (initial, with `adaptive`); 0 skips the reference model entirely; None = the recipe's (ppo, rloo, reinforce_pp: 0.01; grpo: 0.04; the others 0).")
    placement: Optional[Literal["reward", "loss"]] = Field(None, description="Where the KL goes: subtracted from the reward (per token for gae and reinforce_pp, per sequence otherwise) or added to the loss (GRPO); None = the recipe's.")
    estimator: Optional[Literal[tuple(KL_ESTIMATORS)]] = Field(None, description="Per-token KL estimator: k1, abs, k2, k3, k3+ (k3's value, k2's gradient: veRL); None = the recipe's (k1 in the reward, k3 in the loss).")
    adaptive: bool = Field(False, description="Adapt beta towards `target` (Ziegler et al. 2019).")
    target: float = Field(6.0, gt=0, description="Target KL (nats per sequence) for the adaptive controller.")
    horizon: PositiveInt = Field(10000, description="Horizon (in samples) of the adaptive controller.")


class CriticConfig(Section):
    """How the critic (value model) trains; where its server runs is the deployment's (deploy.critic)."""

    combine_reward: bool = Field(True, description="Serve the reward model in the critic server: critic_infer returns values and rewards in one call (reward.source='model' only: reward functions are scored where deploy.reward says).")
    loss_clip_val: float = Field(0.2, gt=0, description="Clip range of the value loss.")
    train_batch_size: PositiveInt = Field(32, description="Sequences per critic optimizer step (global batch).")
    micro_batch_size: PositiveInt = Field(8, description="Sequences per critic forward pass (inference chunks and gradient accumulation); the tiny preset uses 32.")
    epochs: PositiveInt = Field(2, description="Critic epochs per critic_train call.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5), description="Critic optimiser (lr 1e-5 as veRL's and OpenRLHF's critics; the tiny preset uses 1e-3).")


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
    advanced: ClassVar[tuple[str, ...]] = ("transport",)  # --describe --all

    source: Literal["model", "function"] = Field("model", description="Score responses with the reward model or with reward functions (reward.function / reward.functions).")
    function: Optional[str] = Field(None, description="One reward function for source='function': 'package.module:fn' or 'path/to/rewards.py:fn', called as fn(prompts, responses, **columns) -> list[float] (columns: the data set's other columns it names).")
    functions: Optional[list[str]] = Field(None, description="Several reward functions (TRL's reward_funcs), each as reward.function; each is logged as rewards/<name>/mean and /std, their weighted sum is the score. Use reward.function or this, not both.")
    weights: Optional[list[float]] = Field(None, description="Weight of each of reward.functions in the score (TRL's reward_weights); None = 1 each.")
    gold: Optional[str] = Field(None, description="Gold reward function logged as objective/gold_reward (format as reward.function); None = the shipped task's own when the data is a builtin task, else none.")
    transport: Literal["auto", "tokens", "text"] = Field("auto", description="How rollouts reach the reward model: 'tokens' (the policy's ids: the RM must share the policy's tokenizer, checked before anything loads), 'text' (reward_text: prompt and response strings the RM tokenizes itself), 'auto' = text when the RM's tokenizer differs from the policy's, else tokens.")
    chat_template: bool = Field(False, description="With text transport, format (prompt, response) with the reward model's chat template (user, assistant) when it has one; otherwise 'prompt response' + EOS.")
    files: Optional[dict[str, StoredFile]] = Field(None, description="Set by the run where it starts (leave unset): each reward file of reward.function / functions / gold, by the absolute path it was read from, with its sha256 and its copy in the run's store; every process that scores loads that copy, checked by its digest. None = none stored yet (a process loads the file by its path).")
    normalize: bool = Field(False, description="Score with the reward model's (score - reward_mean) / reward_std, the statistics the reward_model stage stores in its config.json (as OpenRLHF's normalize_reward; Bradley-Terry rewards are defined only up to a shift); a reward model without them is refused.")

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


PROMPT_SOURCES = ("'builtin:<task>' (sentiment, sentiment_target; the stages' sentiment_sft and sentiment_preference; the tool-use task arithmetic and its SFT conversations arithmetic_sft), 'reasoning_gym:<task>' (a reasoning-gym task, e.g. chain_sum, generated from its options), a local .parquet/.jsonl/.json/.csv/.arrow file, a .txt "
                  "file (one prompt a line), a folder of such files (file names decide the splits), a folder written by "
                  "Dataset.save_to_disk, s3://bucket/key or s3://bucket/prefix (fetched once per machine into deploy.cache.dir, "
                  "checked by digest), or a hub data set id (its snapshot in the Hugging Face cache, at `revision`)")


class DataConfig(Section):
    """The training prompts (models/data.py): read with HF `datasets`; every column besides the prompt reaches the
    reward functions."""
    advanced: ClassVar[tuple[str, ...]] = ("long_prompts",)  # --describe --all

    prompts: Optional[str] = Field(None, description=f"Where the prompts come from: {PROMPT_SOURCES}; the tiny preset uses builtin:sentiment, any other policy must name its data.")
    subset: Optional[str] = Field(None, description="Configuration (subset) of a data set that has several, e.g. 'main' of openai/gsm8k: hub data sets, and local folders whose README declares configs; None = its only (or default) one.")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit) of data.prompts when it is a hub data set id; None = its main branch.")
    split: str = Field("train", description="Split to read (folders, save_to_disk DatasetDicts, hub datasets; a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the prompt: a string, or chat messages (a list of {role, content}) rendered with the policy's chat template.")
    options: Optional[dict[str, Any]] = Field(None, description="Options of a generated source, reasoning_gym:<task>: size (rows; default 1000 for train, 200 for another split), seed (default 0; another split than train is drawn from another seed, without the train split's questions) and the task's own parameters (e.g. chain_sum's min_terms, max_digits).")
    chat_template: bool = Field(False, description="Wrap a plain-string prompt as a user turn of the policy's chat template (chat messages are always rendered with it).")
    max_prompt_length: Optional[PositiveInt] = Field(None, description="Longest prompt in policy tokens (None = no limit); what happens to a longer one: long_prompts.")
    long_prompts: Literal["error", "filter", "truncate_left"] = Field("error", description="A prompt longer than max_prompt_length: 'error' refuses the data set before any model loads, 'filter' drops the row (counted and logged), 'truncate_left' keeps its last max_prompt_length tokens.")


class EvalConfig(Section):
    """Held-out evaluation: the policy samples on prompts it does not train on, scored by the run's reward and the
    gold reward. It adds no trainer step and leaves the training stream as it is (its own sampling seed)."""
    advanced: ClassVar[tuple[str, ...]] = ("table_rows",)  # --describe --all

    prompts: Optional[str] = Field(None, description=f"Eval prompts (None = no eval): {PROMPT_SOURCES}.")
    subset: Optional[str] = Field(None, description="Configuration (subset) of eval.prompts, as data.subset.")
    revision: Optional[str] = Field(None, description="Hub revision of eval.prompts, as data.revision.")
    split: str = Field("test", description="Split of eval.prompts to read (a single file is this split).")
    prompt_key: str = Field("prompt", description="Column holding the eval prompt (as data.prompt_key).")
    options: Optional[dict[str, Any]] = Field(None, description="Options of a generated eval source (reasoning_gym:<task>), as data.options; give the same task parameters as data.options for held-out rows of the same task.")
    max_prompts: Optional[PositiveInt] = Field(None, description="Evaluate on the first N rows only (None = all).")
    every: int = Field(0, ge=0, description="Evaluate every N iterations, and at iteration 0 (before any update) and at the end (0 = never).")
    samples_per_prompt: PositiveInt = Field(1, description="Responses sampled per eval prompt (k of pass@k).")
    temperature: float = Field(0.0, ge=0, description="Eval sampling temperature (0 = greedy).")
    success_threshold: Optional[float] = Field(None, description="A sample succeeds when its score is at least this (eval/success, eval/pass_at_<k>); None = only when every score is 0 or 1 (a verifiable reward), success being 1.")
    table_rows: PositiveInt = Field(32, description="Eval samples shown in the Prefect artifact and the MLflow table.")


class TrackingConfig(Section):
    advanced: ClassVar[tuple[str, ...]] = ("table_every", "parent_run_id")  # --describe --all
    experiment: str = Field("rlhf-flows", description="MLflow experiment name.")
    table_every: PositiveInt = Field(5, description="Log a table of sample prompts/responses/rewards every N iterations.")
    register_as: Optional[str] = Field(None, description="Register the run's exported model in the MLflow model registry under this name (a new version per run); None = logged with the run only.")
    parent_run_id: Optional[str] = Field(None, description="MLflow run id to nest this run under (tag mlflow.parentRunId); a sweep sets it to its parent run for every trial. None = a top-level run.")


class CheckpointConfig(Section):
    """How often a run checkpoints; where the checkpoints go is the deployment's (deploy.checkpoint)."""

    every: PositiveInt = Field(5, description="Checkpoint every N iterations (and at the end).")
    keep_last: PositiveInt = Field(2, description="Keep this many newest checkpoints.")


class VLLMConfig(Section):
    """What the vLLM rollout engine computes with; where its server runs is the deployment's (deploy.rollout)."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="Dtype of the engine's weights and compute; the weights sent at each refit are cast to it (the tiny preset uses float32).")


class RolloutConfig(Section):
    engine: Literal["native", "vllm"] = Field("native", description="What samples the rollouts: 'native' = the KV-cache sampling loop on the actor's own module; 'vllm' = the vLLM rollout server, refitted with the actor's weights after every update (models/engines/).")
    max_off_policy_steps: int = Field(0, ge=0, description="Asynchronous rollouts (an engine with its own weights): k >= 1 lets the rollout server generate the next k batches while the actor trains, so the actor at weights version v trains on rollouts sampled with version v-k or newer (at most k batches in flight beyond the one being trained on: staleness bounded by construction, no data dropped); the loss corrects for it (loss.vllm_importance_sampling_*). 0 = synchronous: each batch is sampled with the current weights.")
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

    id: str = Field(..., min_length=1, description="The environment's module: `vf.load_environment(id, **args)` imports it (an installed environment package, or a module in one of `paths`).")
    args: dict = Field(default_factory=dict, description="Keyword arguments of load_environment.")
    paths: list[str] = Field(default_factory=list, description="Folders searched first for the environment's module (its PYTHONPATH in verifiers' environment).")
    client_type: Literal["openai_chat_completions_token", "openai_chat_completions"] = Field("openai_chat_completions_token", description="verifiers' client: token ids in (every turn's prompt ids extend the last turn's prompt + completion ids: one token sequence per rollout), or messages in (the server re-renders the text; a rollout whose turns then do not extend each other is left out of the loss, counted in env/errors).")
    timeout_s: float = Field(600.0, gt=0, description="Deadline of one batch of rollouts (the worker process is killed past it and the iteration fails naming it).")
    max_concurrent: PositiveInt = Field(32, description="Groups (the k rollouts of a prompt) verifiers runs at once.")


class EnvironmentConfig(Section):
    """Multi-turn rollouts against environments (models/environments/, docs/environments.md): each rollout is an
    episode of model turns and environment replies, built in token ids; the environments and the reward functions
    run in worker processes with deadlines."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "call_deadline_s", "episode_deadline_s", "single_session",
    )

    factory: Optional[Union[str, dict[str, str]]] = Field(None, description="TRL's environment_factory, run unchanged: a class built with no arguments, one instance per rollout (pooled, reset(**row) before each), its public methods the tools, an optional get_reward() scored with weight 1 under the class's name; 'path/to/env.py:Class' or 'package.module:Class', or a mapping name -> such a spec (each row's `environment` column picks its environment). None = single-turn rollouts.")
    max_turns: Optional[PositiveInt] = Field(None, description="Rounds of tool calls an episode may make after its first reply (TRL's max_tool_calling_iterations); None = as many as generation.max_new_tokens holds.")
    chat_template: Optional[str] = Field(None, description="A chat template file (.jinja) used instead of the policy's own to render the episodes; the template must be prefix-preserving (checked before the run starts): for a family whose own is not (Qwen3 drops past reasoning), TRL ships training templates (trl/chat_templates/*_training.jinja). None = the policy tokenizer's.")
    workers: PositiveInt = Field(4, description="Worker processes per actor rank that run the environments and the reward functions of an episode (each in its main thread, so signal.alarm works); the instances are spread over them. A worker whose call outlives its deadline is killed (SIGKILL) and replaced, which also ends the other episodes it held.")
    call_deadline_s: float = Field(60.0, gt=0, description="Deadline of one call into an environment or a reward function (reset, a tool, get_reward, a reward function over the worker's rows): past it the worker is killed, the episode scores 0 and is counted (env/timeouts).")
    episode_deadline_s: float = Field(300.0, gt=0, description="Deadline of an episode's calls into its environment, summed over its turns (generation time does not count).")
    single_session: Literal["serialise", "refuse"] = Field("serialise", description="An environment class that declares it serves one session at a time (OpenEnv's SUPPORTS_CONCURRENT_SESSIONS = False): 'serialise' runs its episodes one after another on each actor rank, saying so; 'refuse' fails the run before it starts.")
    verifiers: Optional[VerifiersConfig] = Field(None, description="A verifiers environment instead of environment.factory: its dataset gives the training prompts (get_dataset) and the held-out eval's (get_eval_dataset, when eval.every > 0), in place of data.prompts and eval.prompts; its rubric scores the rollouts. Needs rollout.engine=vllm (verifiers' clients talk to the rollout server).")

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
                raise ValueError(f"{where} must look like 'package.module:Class' or 'path/to/env.py:Class', got {spec!r}")
        return self

    @property
    def enabled(self) -> bool:
        """An environment run: episodes scored where they are played (no reward server)."""
        return self.factory is not None or self.verifiers is not None

    def factories(self) -> dict[str | None, str]:
        """{environment name: spec}; the single factory's name is None (every row uses it)."""
        return {None: self.factory} if isinstance(self.factory, str) else dict(self.factory or {})


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"  # a directory name and an S3 key part: no '/', no '..'


class _Tree(Section):
    """What a run trains (one per run); every registered algorithm adds its own section (models/algorithms/). Where its
    parts run is the deployment's (models/deploy.py)."""

    algorithm: Literal[tuple(ALGORITHMS)] = Field("ppo", description="The recipe: ppo (a critic server), rloo, grpo, dr_grpo, dapo, gspo, cispo, reinforce_pp or opd (a teacher); each a set of the `loss` menu's settings (docs/algorithms.md).")
    run_name: Optional[str] = Field(None, pattern=RUN_NAME_PATTERN, description="Name of the run (letters, digits, '.', '_', '-'; at most 100): re-running with the same name resumes it. None = '<algorithm>-<timestamp>-<random>'.")
    iterations: PositiveInt = Field(12, description="Training iterations (rollout + update).")
    seed: int = Field(0, description="Seed of prompts order, sampling and initialisation.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Models.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine.")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description="Environments and tools: multi-turn rollouts (none by default).")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollout sampling.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the frozen reference policy.")
    loss: LossConfig = Field(default_factory=LossConfig, description="The actor's loss: the menu every recipe shares (unset fields: the recipe's).")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Critic (value model) training (algorithms with a critic).")
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
            need = "a critic: only algorithm=ppo has one" if settings.advantage_estimator == "gae" else "gae (ppo has a critic)"
            raise ValueError(f"loss.advantage_estimator={settings.advantage_estimator!r} needs {need}")
        if self.kl.adaptive and settings.kl_beta == 0:
            raise ValueError("kl.adaptive: the controller multiplies kl.beta, which is 0 for this recipe; set kl.beta > 0")
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


SOURCES_DESCRIPTION = ("Set where the job starts (leave unset): every model and data source it reads, pinned once "
                       "(models/resolve.py), as its ranks and servers read them.")

RunConfig = create_model(
    "RunConfig", __base__=_Tree, __module__=__name__, __doc__=_Tree.__doc__,
    **{a.section: (a.Config, Field(default_factory=a.Config, description=a.description)) for a in ALGORITHMS.values()})


class RLHFConfig(RunConfig):
    """A run as its processes receive it: what it trains (the run's config) and where its parts run (`deploy`)."""

    job: ClassVar[str] = "rl"  # what components/runs.py builds for it (the other jobs: models/stages/config.py)
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="Where the run's parts run (set by the deployment).")
    sources: Sources = Field(default_factory=Sources, description=SOURCES_DESCRIPTION)

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
        """A run's config with the deployment's settings; what the run config leaves unset gets its preset's
        values (`preset_for` its policy)."""
        return from_layers(run.model_dump(mode="json", exclude_unset=True),
                           {"deploy": (deploy or DeployConfig()).model_dump(mode="json")})

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
        f"{algorithm.section}.optim.total_steps": cfg.iterations * actor.epochs * math.ceil(rollouts / actor.minibatch_size),
        "critic.optim.total_steps": cfg.iterations * cfg.critic.epochs * math.ceil(rollouts / cfg.critic.train_batch_size),
    }
    current = {f"{algorithm.section}.optim.total_steps": actor.optim.total_steps,
               "critic.optim.total_steps": cfg.critic.optim.total_steps}
    updates = {k: v for k, v in steps.items() if current[k] is None}
    return merge(cfg, updates) if updates else cfg


def _tiny() -> dict:
    """The `tiny` preset: the settings of the embedded tiny models (a 2-core CPU trains them in minutes)."""
    return {"model.policy": "tiny/policy", "model.reward": "tiny/reward", "model.dtype": "float32",
            "data.prompts": "builtin:sentiment", "generation.max_new_tokens": 16, "generation.micro_batch_size": 64,
            "critic.micro_batch_size": 32, "critic.optim.lr": 1e-3, "rollout.vllm.dtype": "float32",
            **{f"{a.section}.optim.lr": 3e-4 for a in ALGORITHMS.values()}}


PRESETS = {"tiny": _tiny, "none": dict}  # name -> the dotted overrides it applies over the field defaults


def preset(name: str = "tiny", **overrides) -> RLHFConfig:
    """A named preset ('tiny': the embedded tiny models' settings; 'none': the field defaults), then `overrides`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (or 'auto': chosen by model.policy)")
    values = {**PRESETS[name](), **overrides}
    return merge(RLHFConfig(), values) if values else RLHFConfig()


def preset_for(policy: str | None) -> str:
    """The preset a config gets by its policy: 'tiny' for the embedded tiny policy (or none given), else 'none'."""
    return "tiny" if policy is None or is_tiny_policy(policy) else "none"


def policy_of(layers: list[dict]) -> str | None:
    """The model.policy the last layer naming it gives (a layer: nested and/or dotted keys), None if none does."""
    policy = None
    for layer in layers:
        if "model.policy" in layer:
            policy = layer["model.policy"]
        elif isinstance(layer.get("model"), dict) and "policy" in layer["model"]:
            policy = layer["model"]["policy"]
    return policy


def from_layers(*layers: dict, preset_name: str = "auto") -> RLHFConfig:
    """A config from partial layers (nested and/or dotted keys), each over the one before, over a preset ('auto':
    `preset_for` the policy they name)."""
    name = preset_for(policy_of(list(layers))) if preset_name == "auto" else preset_name
    config = preset(name)
    for layer in layers:
        if layer:
            config = merge(config, layer)
    return config


def merge(config, overrides: dict):
    """Deep-merge a (possibly dotted-key) dict into a config (an RLHFConfig, a RunConfig, any section) and
    re-validate it as its own class."""
    return type(config).model_validate(_deep_update(config.model_dump(), nested(overrides)))


def nested(overrides: dict) -> dict:
    """{"a.b": 1, "a": {"c": 2}} -> {"a": {"b": 1, "c": 2}}: dotted keys as the mappings they name, merged."""
    out: dict = {}
    for key, value in overrides.items():
        *parents, last = key.split(".")
        part = {last: value}
        for parent in reversed(parents):
            part = {parent: part}
        out = _deep_update(out, part)
    return out


def deep_merge(base: dict, new: dict) -> dict:
    """`new` over `base`, mappings merged key by key at every depth (a value that is not a mapping replaces)."""
    return _deep_update(base, new)


def _deep_update(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, preset_name: str = "auto", overrides: dict | None = None,
                defaults: dict | None = None) -> RLHFConfig:
    """A preset ('auto': chosen by the policy the layers name, see `preset_for`), then an entry point's own
    `defaults` (e.g. where `rlhf train` runs its parts), then a YAML file (any subset of the tree: what the run
    trains, and its `deploy` section), then dotted-key overrides."""
    data = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return from_layers(defaults or {}, data, overrides or {}, preset_name=preset_name)


def describe(section=None, prefix: str = "", advanced: bool = True) -> list[tuple[str, str, str, str]]:
    """(dotted field, type, default, description) of every field of a config tree (an RLHFConfig of field defaults
    unless `section` is given: any config, a pipeline's, a stage's, a sweep's), depth first; a section that is absent
    by default (Optional) is described with its fields too: what `rlhf config --describe` prints. `advanced`=False
    leaves out the fields each section marks advanced (request limits, threads and cores, timeouts, ports)."""
    section = section if section is not None else RLHFConfig()
    rows = []
    for name, field in type(section).model_fields.items():
        if not advanced and name in getattr(type(section), "advanced", ()):
            continue
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
