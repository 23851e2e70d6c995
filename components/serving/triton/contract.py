"""The wire contract of the critic and reward servers (PyTriton): model names, tensor specs, the checks of a request
that Triton itself does not make, and ServerSpec, the one JSON document a server process is started with.

Wire contract (NeMo-Aligner compatible; tokens right-padded, B = batch, L = sequence length):
    critic_infer  (dynamic batching)  tokens int64 [B,L], sequence_lengths int64 [B,1]; NeMo-Aligner's optional
                                      sentences BYTES / add_EOS BOOL are declared and refused by name (REFUSED_INFER)
                                      -> values float32 [B,L] (+ rewards float32 [B,1] when the reward model is
                                      combined)
    critic_train  (no batching)       tokens int64 [B,L], returns/prev_values/mask float32 [B,L], or [B,L-1] per
                                      action as NeMo-Aligner's client sends them (models.critic.train_arrays)
                                      -> loss_mean, grad_norm, explained_variance, clipfrac, lr, skipped_steps
                                      float32 [1]; step int64 [1]. At most deploy.critic.max_train_rows rows;
                                      |returns|, |prev_values| <= models.critic.VALUE_BOUND (refused naming the tensor)
    critic_save   (no batching)       dummy_var int64 [1] -> status int64 [1] (0 = saved), step int64 [1],
                                      path bytes [1]
    reward_model  (dynamic batching)  tokens, sequence_lengths (+ optional prompt_lengths int64 [B,1])
                                      -> rewards float32 [B,1]
    reward_text   (dynamic batching)  prompts BYTES [B,1], responses BYTES [B,1] (UTF-8)
                                      -> rewards float32 [B,1]: the reward model tokenizes with its own tokenizer
                                      (reward servers, and the critic server when it carries the reward model)
    teacher_logprobs (dynamic batching) tokens int64 [B,L], sequence_lengths int64 [B,1] -> logprobs float32 [B,L-1]:
                                      on-policy distillation's teacher (algorithm=opd, served by the reward server):
                                      its log-probability of each next token (0 past the row's length)
    both reward models take an optional columns BYTES [B,1]: each sample's data set row besides the prompt, a JSON
    object, for a reward function that reads columns (models/reward.py); a reward model ignores it. A client that
    sends no columns (every client before it) is served as before.

Who may call (components/serving/auth.py, the front: components/serving/triton/front.py): with deploy.<kind>.auth
'secret' (the default) every request but liveness, readiness and the server's proof must be signed with the run's key
(derived from the run's secret, which the server reads from $RLHF_RUN_SECRET or $RLHF_RUN_SECRET_FILE; a server given
none refuses to start); a stranger is refused (401/403) before any callable runs. Open mode ('none') serves inference,
model config and metadata to clients without credentials (NeMo-Aligner's) and says so. Triton's admin APIs (model
loading, shared memory, trace, logging) are closed to every caller.
Bounded requests: the front refuses a body over 64 MB (Triton's own limit) from its Content-Length, Triton a dynamic
batch over max_batch_size;
critic_train (not batched) takes at most max_train_rows rows; reward_text keeps only the characters of each text the
reward model can score (models/reward.text_char_budget) and tokenizes them before the lock is taken.

A request that breaks the contract gets an error naming the tensor (PyTriton 0.7.0): Triton itself refuses wrong
dtypes, ranks, disagreeing batch sizes and unknown models; the checks below refuse the rest (lengths, NaN/Inf, mask
values, token ids) before the callables (components/serving/triton/critic.py, reward.py) touch the weights. A raised
exception reaches the client with its message; the server keeps serving. With dynamic batching, Triton merges only
requests of identical shapes, and an error fails every request of the merged batch (PyTriton has no per-request
error); our clients (components/serving/triton/clients.py) validate before sending.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from components.serving.auth import MissingSecret, read_secret
from models.algorithms import ALGORITHMS
from models.config import RLHFConfig
from models.critic import CriticInputError

LOG = logging.getLogger("rlhf.server")

CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE, REWARD_MODEL = "critic_infer", "critic_train", "critic_save", "reward_model"
REWARD_TEXT = "reward_text"
TEACHER_LOGPROBS = "teacher_logprobs"
CRITIC_MODELS = (CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE)
REWARD_MODELS = (REWARD_MODEL, REWARD_TEXT)
TRAIN_STATS = ("loss_mean", "grad_norm", "explained_variance", "clipfrac", "lr", "skipped_steps")

# ---------------------------------------------------------------- request checks

def request_array(request, name: str) -> np.ndarray:
    return np.asarray(request[name])


# NeMo-Aligner's critic server declares these optional critic_infer inputs (add_EOS until its 0.4.0). Its PPO client
# (RemoteGPTRMCriticClient) never sends them: it sends tokens + sequence_lengths only. Scoring raw text here would
# give values for a tokenization the actor never trains on, so they are declared (a request carrying them reaches
# us instead of Triton's generic "unexpected input") and refused by name. Triton does not merge requests with
# different input sets into one dynamic batch, so a refused request fails alone.
REFUSED_INFER = {
    "sentences": "critic_infer scores token ids only: send tokens int64 [B,L] + sequence_lengths int64 [B,1] (as "
                 "NeMo-Aligner's RemoteGPTRMCriticClient does); score text with reward_text",
    "add_EOS": "it applies to `sentences`, which this server does not take (NeMo-Aligner removed add_EOS in 0.4.0; "
               "its client never sends it): send tokens with the EOS you want scored",
}


def refuse_infer_inputs(request) -> None:
    """critic_infer: refuse NeMo-Aligner's optional text inputs by name (tokens and sequence_lengths stay required:
    Triton itself refuses a request without them, naming them)."""
    for name, why in REFUSED_INFER.items():
        if name in request:
            raise CriticInputError(f"{name}: not supported by this critic server: {why}")


def check_positions(tokens: np.ndarray, model) -> None:
    """A sequence longer than the model's position table would fail deep inside torch; say so up front."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens.shape[1] > limit:
        raise CriticInputError(f"tokens: sequence length L={tokens.shape[1]} exceeds the model's "
                               f"max_position_embeddings={limit}")


def check_vocab(tokens: np.ndarray, vocab_size: int) -> None:
    if tokens.size and ((tokens < 0).any() or (tokens >= vocab_size).any()):
        raise CriticInputError(f"tokens: ids must be in [0, {vocab_size}), got min {tokens.min()} max {tokens.max()}")


def decode_columns(request, batch: int) -> list[dict]:
    """The optional `columns` input (BYTES [B,1], a JSON object per row) as B dicts; empty dicts when absent."""
    if "columns" not in request.keys():
        return [{} for _ in range(batch)]
    texts = decode_texts(request_array(request, "columns"), "columns")
    if len(texts) != batch:
        raise CriticInputError(f"columns: batch size {len(texts)} does not match the other inputs' {batch}")
    rows = []
    for i, text in enumerate(texts):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CriticInputError(f"columns: item {i} is not JSON ({exc.msg} at {exc.pos})") from None
        if not isinstance(row, dict):
            raise CriticInputError(f"columns: item {i} must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def decode_texts(array: np.ndarray, name: str) -> list[str]:
    """A BYTES [B, 1] tensor as B strings; refuses other dtypes and shapes, an empty batch, and invalid UTF-8."""
    if array.dtype.kind not in ("O", "S"):
        raise CriticInputError(f"{name}: expected BYTES (UTF-8 strings) [B, 1], got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[1] != 1:
        raise CriticInputError(f"{name}: expected shape [B, 1], got {list(array.shape)}")
    if array.shape[0] == 0:
        raise CriticInputError(f"{name}: expected a non-empty batch [B>0, 1], got shape {list(array.shape)}")
    texts = []
    for i, item in enumerate(array.reshape(-1)):
        raw = item if isinstance(item, bytes) else str(item).encode()
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise CriticInputError(f"{name}: item {i} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return texts


def check_prompt_lengths(prompt_lengths: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    if prompt_lengths.dtype != np.int64:
        raise CriticInputError(f"prompt_lengths: expected dtype int64, got {prompt_lengths.dtype}")
    flat = prompt_lengths.reshape(-1)
    if prompt_lengths.shape != (lengths.shape[0], 1) and prompt_lengths.shape != lengths.shape:
        raise CriticInputError(f"prompt_lengths: expected shape [{lengths.shape[0]}, 1], got "
                               f"{list(prompt_lengths.shape)}")
    if (flat < 0).any() or (flat > lengths).any():
        raise CriticInputError("prompt_lengths: every prompt length must be in [0, sequence_length]")
    return flat


def stack_requests(parts: list[tuple[np.ndarray, np.ndarray]]):
    """Concatenate the requests of one dynamic batch, right-padding to the longest L (values there are masked)."""
    width = max(t.shape[1] for t, _ in parts)
    tokens = np.concatenate([np.pad(t, ((0, 0), (0, width - t.shape[1]))) for t, _ in parts])
    lengths = np.concatenate([ln for _, ln in parts])
    return torch.as_tensor(tokens), torch.as_tensor(lengths), [t.shape[0] for t, _ in parts]


# ---------------------------------------------------------------- model specs

@dataclass
class ModelSpec:
    """What Triton needs to know about one model, independent of the weights."""

    name: str
    inputs: list
    outputs: list
    batching: bool
    max_batch_size: int = 0
    max_queue_delay_us: int = 0

    def config(self):
        from pytriton.model_config import DynamicBatcher, ModelConfig  # heavy: pytriton, for a server's models

        if not self.batching:
            return ModelConfig(batching=False)
        return ModelConfig(batching=True, max_batch_size=self.max_batch_size,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=self.max_queue_delay_us))


def _tensor(name: str, dtype, shape, optional: bool = False):
    from pytriton.model_config import Tensor  # heavy: pytriton, for a server's models

    return Tensor(name=name, dtype=dtype, shape=shape, optional=optional)


def critic_specs(combine_reward: bool, max_batch_size: int, max_queue_delay_us: int) -> list[ModelSpec]:
    infer_out = [_tensor("values", np.float32, (-1,))] \
        + ([_tensor("rewards", np.float32, (1,))] if combine_reward else [])
    return [
        ModelSpec(CRITIC_INFER, [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,)),
                                 _tensor("sentences", bytes, (-1,), optional=True),
                                 _tensor("add_EOS", np.bool_, (1,), optional=True)],
                  infer_out, True, max_batch_size, max_queue_delay_us),
        ModelSpec(CRITIC_TRAIN, [_tensor("tokens", np.int64, (-1, -1))] +
                  [_tensor(n, np.float32, (-1, -1)) for n in ("returns", "prev_values", "mask")],
                  [_tensor(n, np.float32, (1,)) for n in TRAIN_STATS] + [_tensor("step", np.int64, (1,))], False),
        ModelSpec(CRITIC_SAVE, [_tensor("dummy_var", np.int64, (1,))],
                  [_tensor("status", np.int64, (1,)), _tensor("step", np.int64, (1,)), _tensor("path", bytes, (1,))],
                  False),
    ]


def reward_outputs(functions: bool) -> list:
    """`rewards` [B,1]; a server of reward functions also answers `function_rewards` [B,F]: each function's score
    (in reward.functions order), whose weighted sum `rewards` is."""
    return [_tensor("rewards", np.float32, (1,))] \
        + ([_tensor("function_rewards", np.float32, (-1,))] if functions else [])


def reward_specs(max_batch_size: int, max_queue_delay_us: int, functions: bool = False) -> list[ModelSpec]:
    return [ModelSpec(REWARD_MODEL, [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,)),
                                     _tensor("prompt_lengths", np.int64, (1,), optional=True),
                                     _tensor("columns", bytes, (1,), optional=True)],
                      reward_outputs(functions), True, max_batch_size, max_queue_delay_us),
            reward_text_spec(max_batch_size, max_queue_delay_us, functions)]


def teacher_spec(max_batch_size: int, max_queue_delay_us: int) -> ModelSpec:
    return ModelSpec(TEACHER_LOGPROBS,
                     [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,))],
                     [_tensor("logprobs", np.float32, (-1,))], True, max_batch_size, max_queue_delay_us)


def reward_text_spec(max_batch_size: int, max_queue_delay_us: int, functions: bool = False) -> ModelSpec:
    return ModelSpec(REWARD_TEXT, [_tensor("prompts", bytes, (1,)), _tensor("responses", bytes, (1,)),
                                   _tensor("columns", bytes, (1,), optional=True)],
                     reward_outputs(functions), True, max_batch_size, max_queue_delay_us)


# ---------------------------------------------------------------- a server process

PENDING_PREFIX = "critic-pending"  # store keys where a critic server puts its saves until a checkpoint adopts them


class ServerSpec(BaseModel):
    """Everything one server process needs, handed to it as one JSON document
    (`python -m components.serving.triton.main`).

    The config tree supplies the models (model.critic / model.reward / model.policy for a function reward's
    tokenizer), dtype, device and the critic/reward sections; the fields here are what differs per process.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["critic", "reward"]
    config: RLHFConfig = Field(default_factory=RLHFConfig)
    host: str = Field("127.0.0.1", description="Interface the server's HTTP front binds.")
    port: int = Field(8400, ge=1, le=65535, description="The server's HTTP port.")
    checkpoint_dir: Optional[str] = Field(None,
                                          description="critic: where critic_save writes; a save there is resumed.")
    checkpoint_uri: Optional[str] = Field(None, description="critic: the run's checkpoint store; each save is also "
                                          f"uploaded to <uri>/{PENDING_PREFIX}/step-<k> for the next checkpoint to "
                                          "adopt.")
    restore_iteration: Optional[int] = Field(None, ge=0, description="critic: start from iter_<N>/critic of the "
                                             "store at checkpoint_uri (a fresh node resuming a run).")
    max_batch_size: int = Field(256, ge=1, description="Largest batch Triton accepts and forms by dynamic batching.")
    torch_threads: Optional[int] = Field(None, ge=1, description="torch intra-op threads; None keeps torch's default.")
    exit_timeout_s: int = Field(10, ge=1, description="How long Triton waits for in-flight requests on stop.")

    @property
    def models(self) -> tuple[str, ...]:
        """The models this server binds (what readiness waits for)."""
        if self.kind == "critic":
            return CRITIC_MODELS + ((REWARD_TEXT,) if self.config.critic_carries_reward else ())
        return REWARD_MODELS + ((TEACHER_LOGPROBS,) if self.carries_teacher else ())

    @property
    def carries_teacher(self) -> bool:
        """A reward server of on-policy distillation serves its teacher too."""
        return self.kind == "reward" and ALGORITHMS[self.config.algorithm].needs_teacher

    @property
    def section(self):
        """Where this server runs: the deployment's critic or reward section."""
        return self.config.deploy.critic if self.kind == "critic" else self.config.deploy.reward

    @property
    def loaded_models(self) -> tuple[str, ...]:
        """The model fields this server loads: the critic (or the reward model it starts from) and the reward model; a
        reward server its reward model, or the policy's tokenizer for a reward function (and a teacher)."""
        m = self.config.model
        if self.kind == "critic":
            return tuple(f"model.{name}" for name in ("critic", "reward") if getattr(m, name))
        return ("model.reward" if self.config.reward.source == "model" else "model.policy",) + \
            (("model.teacher",) if self.carries_teacher else ())

    def run_secret(self) -> Optional[str]:
        """The run's secret this server's front checks requests with ($RLHF_RUN_SECRET or the file
        $RLHF_RUN_SECRET_FILE names). With deploy.<kind>.auth 'secret' a server without one refuses to start; with
        'none' (open mode) inference, model config and metadata answer anyone (None when it has no secret), and it
        says so."""
        secret = read_secret()
        if self.section.auth == "secret":
            if secret is None:
                raise MissingSecret(
                    f"deploy.{self.kind}.auth=secret: every request must be signed with the run's key, and this server "
                    f"was given no secret: set $RLHF_RUN_SECRET (or $RLHF_RUN_SECRET_FILE, a file holding it) in its "
                    f"environment and give clients the same secret; or serve clients that send no credentials "
                    f"(NeMo-Aligner's) in open mode: --set deploy.{self.kind}.auth=none")
            return secret
        LOG.warning("%s server: OPEN MODE (deploy.%s.auth=none): inference, model config and metadata answer anyone "
                    "who reaches %s:%d; statistics need the run's key, Triton's admin APIs are closed", self.kind,
                    self.kind, self.host, self.port)
        return secret

    def triton_config(self):
        from pytriton.triton import TritonConfig  # heavy: only a server process starts Triton

        # HTTP only (the front's address; tritonserver itself binds a Unix socket: serve.behind_front)
        return TritonConfig(http_address=self.host, http_port=self.port, allow_grpc=False, allow_metrics=False,
                            exit_timeout_secs=self.exit_timeout_s)
