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
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import Field, PositiveInt, create_model, model_validator

from models.algorithms import ALGORITHMS
from models.sections import STATE_DIR_ENV, OptimConfig, Section, default_state_dir  # noqa: F401 (re-exported)

TINY_PREFIX = "tiny"  # model paths "tiny/<name>" name the embedded default, built under <state_dir>/models/tiny


class LoraConfig(Section):
    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights; the reference is the actor with adapters disabled (no copy).")
    r: PositiveInt = Field(8, description="LoRA rank.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: Optional[list[str]] = Field(None, description="Module names to adapt; None lets peft pick the architecture's default.")


class ModelConfig(Section):
    policy: str = Field("tiny/policy", description="Actor checkpoint: a local directory or hub id loaded with from_pretrained. Relative paths resolve against <state_dir>/models.")
    reward: str = Field("tiny/reward", description="Sequence-classification reward model (num_labels=1) for reward.source='model'.")
    critic: Optional[str] = Field(None, description="Critic checkpoint (token-classification, num_labels=1); None initialises the critic from the reward model, as NeMo-Aligner does.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings for the actor.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype of actor and critic.")
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'. With several actor ranks, 'auto'/'cuda' mean each rank's own GPU (LOCAL_RANK).")
    reference_device: Literal["auto", "actor", "cpu"] = Field("auto", description="Where the frozen reference of a full fine-tune lives: 'actor' = the actor's device, sharded like the actor; 'cpu' = a CPU copy on every rank; 'auto' = the actor's device when its free memory holds the reference shard with a 20% margin, else CPU. (LoRA has no copy: adapters disabled.)")


class ActorConfig(Section):
    """How many processes train the actor, and how they talk. Rank 0 runs the flow (or `rlhf train`); the others
    follow its commands. One node: rank 0 starts ranks 1..N-1 itself. Several nodes: every pod runs torchrun."""

    nproc_per_node: PositiveInt = Field(1, description="Actor ranks per node (one per GPU; on CPU, each gets cores / ranks threads).")
    nnodes: PositiveInt = Field(1, description="Nodes; more than one needs torchrun on every pod (the actor-gpu job template does it).")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="torch.distributed backend: 'auto' = nccl with CUDA, gloo on CPU.")
    fsdp: Literal["auto", "off"] = Field("auto", description="'auto' shards a full fine-tune with FSDP2 (fully_shard per transformer block) when world size > 1; 'off' replicates it and sums gradients. LoRA always replicates the frozen base and syncs only the adapters.")
    mixed_precision: bool = Field(False, description="FSDP2 mixed precision on GPU: bf16 compute with fp32 gradient reduction (master weights stay fp32).")
    master_addr: str = Field("127.0.0.1", description="Address of rank 0 for ranks started by rank 0 itself (torchrun sets its own).")
    master_port: int = Field(29511, ge=1024, le=65535, description="Port of rank 0's rendezvous; a busy port makes rank 0 pick a free one (single node).")
    collective_timeout_s: float = Field(300.0, gt=0, description="A collective (and the rendezvous at start) that waits longer than this, because a rank died or hangs, fails the run.")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


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
    launch: Literal["in_process", "local", "deployment"] = Field("local", description="Where the critic runs: in this process, as a local PyTriton child process, or as the critic-server/default Prefect deployment.")
    combine_reward: bool = Field(True, description="Serve the reward model in the critic server: critic_infer returns values and rewards in one call.")
    nproc_per_node: PositiveInt = Field(1, description="Ranks of the critic server (one node): rank 0 serves HTTP, every rank holds an FSDP2 shard of the critic and computes its block of each batch (collectives: actor.backend, actor.collective_timeout_s).")
    host: str = Field("127.0.0.1", description="Interface the critic server binds (and the client connects to for launch=local).")
    http_port: int = Field(8400, ge=1, le=65535, description="HTTP port of the critic server (gRPC = +1, metrics = +2).")
    max_queue_delay_us: int = Field(2000, ge=0, description="Dynamic-batching queue delay of critic_infer.")
    loss_clip_val: float = Field(0.2, gt=0, description="Clip range of the value loss.")
    train_batch_size: PositiveInt = Field(32, description="Sequences per critic optimizer step (global batch).")
    micro_batch_size: PositiveInt = Field(32, description="Sequences per critic forward pass (inference chunks and gradient accumulation).")
    epochs: PositiveInt = Field(2, description="Critic epochs per critic_train call.")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3), description="Critic optimiser (1e-3 suits the tiny critic; ~1e-5 for a 1B critic).")
    torch_threads: Optional[PositiveInt] = Field(None, description="torch intra-op threads of the server process; None = 1 on a CPU-only host (it usually shares the cores with the actor; 2+2 threads on 2 cores ran ~4x slower), torch's default with CUDA.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long to wait for the critic server to become ready.")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one critic request.")


class RewardConfig(Section):
    source: Literal["model", "function"] = Field("model", description="Score responses with the reward model or a Python function.")
    function: Optional[str] = Field(None, description="'package.module:function(prompts, responses) -> list[float]' for source='function'.")
    gold: Optional[str] = Field("models.tasks.sentiment:gold_reward", description="Gold reward function logged as objective/gold_reward (None to skip).")
    transport: Literal["auto", "tokens", "text"] = Field("auto", description="How rollouts reach the reward model: 'tokens' (the policy's ids: the RM must share the policy's tokenizer), 'text' (reward_text: prompt and response strings the RM tokenizes itself), 'auto' = text when the RM's tokenizer differs from the policy's, else tokens.")
    chat_template: bool = Field(False, description="With text transport, format (prompt, response) with the reward model's chat template (user, assistant) when it has one; otherwise 'prompt response' + EOS.")
    launch: Literal["in_process", "local", "deployment"] = Field("local", description="Where the REINFORCE reward server runs.")
    host: str = Field("127.0.0.1", description="Interface of the reward server.")
    http_port: int = Field(8500, ge=1, le=65535, description="HTTP port of the reward server (gRPC = +1, metrics = +2).")
    max_queue_delay_us: int = Field(2000, ge=0, description="Dynamic-batching queue delay of reward_model.")
    torch_threads: Optional[PositiveInt] = Field(None, description="torch intra-op threads of the reward server process (None: as for the critic).")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long to wait for the reward server to become ready.")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one reward request.")

    @model_validator(mode="after")
    def _function_given(self) -> "RewardConfig":
        if self.source == "function" and not self.function:
            raise ValueError("reward.function is required when reward.source='function' (format 'package.module:function')")
        for name in ("function", "gold"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[\w.]+:\w+", value):
                raise ValueError(f"reward.{name} must look like 'package.module:function', got {value!r}")
        return self


PROMPT_SOURCES = ("'builtin:<task>' (sentiment, sentiment_target), a local .parquet/.jsonl/.json/.csv/.arrow file, a .txt "
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
    uri: Optional[str] = Field(None, description="MLflow tracking URI; None uses $MLFLOW_TRACKING_URI, else the local stack's server, else sqlite in state_dir.")
    experiment: str = Field("rlhf-flows", description="MLflow experiment name.")
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory system metrics with the run.")
    table_every: PositiveInt = Field(5, description="Log a table of sample prompts/responses/rewards every N iterations.")
    parent_run_id: Optional[str] = Field(None, description="MLflow run id to nest this run under (tag mlflow.parentRunId); a sweep sets it to its parent run for every trial. None = a top-level run.")


class CheckpointConfig(Section):
    uri: Optional[str] = Field(None, description="file:///dir, a path, or s3://bucket/prefix; None uses <state_dir>/checkpoints. The run name is appended.")
    every: PositiveInt = Field(5, description="Checkpoint every N iterations (and at the end).")
    keep_last: PositiveInt = Field(2, description="Keep this many newest checkpoints.")
    s3_endpoint_url: Optional[str] = Field(None, description="Endpoint of an S3-compatible store (None = AWS or $AWS_ENDPOINT_URL_S3).")


class VLLMConfig(Section):
    """The vLLM rollout server (components/serving/rollout_server.py): its own process and environment (.venv-vllm;
    on a cluster its own pod), with its own copy of the actor's weights, refitted after every update."""

    launch: Literal["local", "deployment"] = Field("local", description="Where the server runs: 'local' = a child process of the flow (own process group, stopped with it); 'deployment' = the rollout-server/default Prefect deployment (its own GPU node on a cluster).")
    python: str = Field(".venv-vllm/bin/python", description="Interpreter of the server's environment (`make vllm-venv`; an image with `vllm` on a cluster). Relative paths resolve against the project root.")
    host: str = Field("127.0.0.1", description="Interface the server binds (and the client connects to for launch=local).")
    port: int = Field(8600, ge=0, le=65535, description="HTTP port of the server; a busy port (or 0) makes a local server pick a free one.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the engine's weights and compute; the weights sent at each refit are cast to it.")
    max_model_len: Optional[PositiveInt] = Field(None, description="Longest prompt + response the engine accepts (its KV cache is sized for it); None = the model's own limit (max_position_embeddings).")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache space in GiB on a CPU host (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights + KV cache) on a GPU host; the rest is left to a trainer on the same GPU and to NCCL.")
    enforce_eager: bool = Field(True, description="Run without CUDA graphs / torch.compile: starts in seconds instead of ~1 min; turn off for long runs on a GPU.")
    threads: Optional[PositiveInt] = Field(None, description="CPU threads of the engine (OMP_NUM_THREADS); None = every core on a CPU-only host (the actor waits while the server generates, the server idles while the actor trains), vLLM's default otherwise. Set it lower when other work shares the cores.")
    cpu_cores: Optional[str] = Field(None, coerce_numbers_to_str=True, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$", description="CPU cores the server runs on on a CPU host, every thread of its process (and vLLM's OpenMP threads bound to them: VLLM_CPU_OMP_THREADS_BIND), a Linux core list, e.g. '1', '2-3' or '0,4-5'; None = every core, vLLM's default binding. With asynchronous rollouts, keep the server and the actor on cores of their own (as separate pods would be).")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long to wait for the server to load the model and answer /health; with launch=deployment, also how long its flow run may take to start and publish its address (pod scheduling and the image pull count here: raise it for a cold GPU pool).")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generate or weight-update request.")
    weight_transfer: Literal["http", "dist"] = Field("dist", description="How the actor's weights reach the server after every update: 'dist' = a torch.distributed group of two (actor rank 0 and the server; gloo on CPU, NCCL on GPUs), tensors broadcast one at a time and loaded as they arrive; 'http' = a safetensors body streamed to POST /update_weights (a server the actor cannot reach with a process group: only its HTTP port is open).")


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


class _Tree(Section):
    """Root of the config tree (one per run); every registered algorithm adds its own section (models/algorithms/)."""

    algorithm: Literal[tuple(ALGORITHMS)] = Field("ppo", description="ppo (actor + critic server) or rloo (REINFORCE with leave-one-out baseline); see models/algorithms/.")
    run_name: Optional[str] = Field(None, description="Name of the run; re-running with the same name resumes it. None = '<algorithm>-<timestamp>'.")
    iterations: PositiveInt = Field(12, description="Training iterations (rollout + update).")
    seed: int = Field(0, description="Seed of prompts order, sampling and initialisation.")
    state_dir: Optional[str] = Field(None, description="Local state directory; None = $RLHF_STATE_DIR or ./.rlhf.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Models.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Actor processes (data parallel, FSDP2).")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Rollout sampling.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty against the frozen reference policy.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Critic (value model) settings and server (algorithms with a critic).")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward source and server.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints and resume.")

    @model_validator(mode="after")
    def _every_rank_gets_prompts(self):
        world, section = self.actor.world_size, ALGORITHMS[self.algorithm].section
        batch = getattr(self, section).rollout_batch_size
        if batch < world:
            raise ValueError(f"{section}.rollout_batch_size={batch} is smaller than the actor's world size {world} "
                             f"(actor.nnodes x actor.nproc_per_node): every rank needs at least one prompt")
        return self

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir).absolute() if self.state_dir else default_state_dir()

    def resolve_model_path(self, value: str) -> str:
        """A relative path that exists under <state_dir>/models wins; otherwise the value is returned as given.
        (The embedded default `tiny/...` is built before, by models/setup.prepare_run.)"""
        candidate = self.resolved_state_dir() / "models" / value
        return str(candidate) if not Path(value).is_absolute() and candidate.exists() else value


RLHFConfig = create_model(
    "RLHFConfig", __base__=_Tree, __module__=__name__, __doc__=_Tree.__doc__,
    **{a.section: (a.Config, Field(default_factory=a.Config, description=a.description)) for a in ALGORITHMS.values()})


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


def merge(config: RLHFConfig, overrides: dict) -> RLHFConfig:
    """Deep-merge a (possibly dotted-key) dict into a config and re-validate."""
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
    return RLHFConfig.model_validate(data)


def _deep_update(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_update(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, preset_name: str = "tiny", overrides: dict | None = None) -> RLHFConfig:
    """Preset, then a YAML file (any subset of the tree), then dotted-key overrides."""
    config = preset(preset_name)
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
        config = merge(config, data)
    return merge(config, overrides) if overrides else config
