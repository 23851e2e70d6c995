"""PyTriton bindings of the critic and reward servers: thin adapters around models/critic.py and models/reward.py.

Wire contract (NeMo-Aligner compatible; tokens right-padded, B = batch, L = sequence length):
    critic_infer  (dynamic batching)  tokens int64 [B,L], sequence_lengths int64 [B,1]; NeMo-Aligner's optional
                                      sentences BYTES / add_EOS BOOL are declared and refused by name (REFUSED_INFER)
                                      -> values float32 [B,L] (+ rewards float32 [B,1] when the reward model is combined)
    critic_train  (no batching)       tokens int64 [B,L], returns/prev_values/mask float32 [B,L], or [B,L-1] per
                                      action as NeMo-Aligner's client sends them (models.critic.train_arrays)
                                      -> loss_mean, grad_norm, explained_variance, clipfrac, lr, skipped_steps
                                      float32 [1]; step int64 [1]. At most deploy.critic.max_train_rows rows;
                                      |returns|, |prev_values| <= models.critic.VALUE_BOUND (refused naming the tensor)
    critic_save   (no batching)       dummy_var int64 [1] -> status int64 [1] (0 = saved), step int64 [1], path bytes [1]
    reward_model  (dynamic batching)  tokens, sequence_lengths (+ optional prompt_lengths int64 [B,1])
                                      -> rewards float32 [B,1]
    reward_text   (dynamic batching)  prompts BYTES [B,1], responses BYTES [B,1] (UTF-8)
                                      -> rewards float32 [B,1]: the reward model tokenizes with its own tokenizer
                                      (reward servers, and the critic server when it carries the reward model)
    both reward models take an optional columns BYTES [B,1]: each sample's data set row besides the prompt, a JSON
    object, for a reward function that reads columns (models/reward.py); a reward model ignores it. A client that
    sends no columns (every client before it) is served as before.

Who may call (components/serving/auth.py): with deploy.<kind>.auth 'secret' (the default) every Triton API but health
(liveness, readiness) needs the run's token (`triton-access-token`, derived from the run's secret, which the server
reads from $RLHF_RUN_SECRET or $RLHF_RUN_SECRET_FILE; a server given none refuses to start); a stranger is refused
(403) before any callable runs. Open mode ('none') serves clients without credentials (NeMo-Aligner's) and says so.
Bounded requests: Triton refuses a body over its own 64 MB limit, and a dynamic batch over max_batch_size;
critic_train (not batched) takes at most max_train_rows rows; reward_text keeps only the characters of each text the
reward model can score (models/reward.text_char_budget) and tokenizes them before the lock is taken.

One Triton instance serves all models of a server; `CriticTrainer.lock` serialises infer/train/save. Serving order:
Triton starts first, then the weights load, then the models are bound. If the weights fail to load, each model name is
registered in Triton's repository as a model whose load fails with the error, so readiness checks report
"model critic_infer UNAVAILABLE: <why>" while the server keeps answering (like Triton with a broken model).

PyTriton notes (0.7.0):
- A request that breaks the contract gets an error naming the tensor: Triton itself refuses wrong dtypes, ranks,
  disagreeing batch sizes and unknown models; the callables below refuse the rest (lengths, NaN/Inf, mask values,
  token ids) before touching the weights. A raised exception reaches the client with its message; the server keeps
  serving. With dynamic batching, Triton merges only requests of identical shapes, and an error fails every request
  of the merged batch (PyTriton has no per-request error); our clients validate before sending.
- Tensors travel base64-encoded (PYTRITON_NO_TENSORSTORE=1): PyTriton's shared-memory tensor store crashes on
  zero-size arrays (e.g. tokens [2, 0]) before our validation could name the tensor.
- The python-backend stub must find this interpreter's libpython first (pyenv vs Debian's): `prepare_environment`
  prepends sysconfig LIBDIR to LD_LIBRARY_PATH before Triton starts (the one place that sets it: every server
  process, launched or started by hand, goes through `serve`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from components.launch.processes import can_bind, exit_with_parent, wait_for
from components.serving.auth import (OPEN_MODE_APIS, RESTRICTED_APIS, TRITON_HEADER, MissingSecret, read_secret,
                                     triton_token)
from components.launch.ranks import BACKEND_ENV, TIMEOUT_ENV, Followers
from components.storage.checkpoints import CheckpointStore
from models import distributed
from models.config import RLHFConfig
from models.critic import CriticInputError, CriticTrainer, train_arrays, validate_tokens
from models.loading import resolve_device
from models.prepare import reward_transport
from models.reward import (load_reward_functions, load_reward_model, load_reward_tokenizer, reward_limit,
                           reward_model_scores, score_batches, text_batches)

LOG = logging.getLogger("rlhf.server")

CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE, REWARD_MODEL = "critic_infer", "critic_train", "critic_save", "reward_model"
REWARD_TEXT = "reward_text"
CRITIC_MODELS = (CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE)
REWARD_MODELS = (REWARD_MODEL, REWARD_TEXT)
TRAIN_STATS = ("loss_mean", "grad_norm", "explained_variance", "clipfrac", "lr", "skipped_steps")


def prepare_environment() -> None:
    """Environment the Triton child processes inherit: this interpreter's libpython first, base64 tensor transport."""
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir
    os.environ["PYTRITON_NO_TENSORSTORE"] = "1"


# ---------------------------------------------------------------- request checks (the wire contract)

def _array(request, name: str) -> np.ndarray:
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
    texts = decode_texts(_array(request, "columns"), "columns")
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
        raise CriticInputError(f"prompt_lengths: expected shape [{lengths.shape[0]}, 1], got {list(prompt_lengths.shape)}")
    if (flat < 0).any() or (flat > lengths).any():
        raise CriticInputError("prompt_lengths: every prompt length must be in [0, sequence_length]")
    return flat


def _stack(parts: list[tuple[np.ndarray, np.ndarray]]):
    """Concatenate the requests of one dynamic batch, right-padding to the longest L (values there are masked)."""
    width = max(t.shape[1] for t, _ in parts)
    tokens = np.concatenate([np.pad(t, ((0, 0), (0, width - t.shape[1]))) for t, _ in parts])
    lengths = np.concatenate([ln for _, ln in parts])
    return torch.as_tensor(tokens), torch.as_tensor(lengths), [t.shape[0] for t, _ in parts]


# ---------------------------------------------------------------- model specs and callables

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
    infer_out = [_tensor("values", np.float32, (-1,))] + ([_tensor("rewards", np.float32, (1,))] if combine_reward else [])
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
    return [_tensor("rewards", np.float32, (1,))] + ([_tensor("function_rewards", np.float32, (-1,))] if functions else [])


def reward_specs(max_batch_size: int, max_queue_delay_us: int, functions: bool = False) -> list[ModelSpec]:
    return [ModelSpec(REWARD_MODEL, [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,)),
                                     _tensor("prompt_lengths", np.int64, (1,), optional=True),
                                     _tensor("columns", bytes, (1,), optional=True)],
                      reward_outputs(functions), True, max_batch_size, max_queue_delay_us),
            reward_text_spec(max_batch_size, max_queue_delay_us, functions)]


def reward_text_spec(max_batch_size: int, max_queue_delay_us: int, functions: bool = False) -> ModelSpec:
    return ModelSpec(REWARD_TEXT, [_tensor("prompts", bytes, (1,)), _tensor("responses", bytes, (1,)),
                                   _tensor("columns", bytes, (1,), optional=True)],
                     reward_outputs(functions), True, max_batch_size, max_queue_delay_us)


class CriticCallables:
    """The three critic models as PyTriton callables (lists of requests in, list of responses out)."""

    def __init__(self, trainer: CriticTrainer, store=None, max_train_rows: int = 4096):
        self.trainer, self.store, self.max_train_rows = trainer, store, max_train_rows
        self._save_lock = threading.Lock()

    def _all(self, op: str, *args):
        """Run a trainer method on every rank: tell the other ranks (what, with which batch), then run it here; the
        trainer's lock keeps the order of operations the same on all ranks."""
        with self.trainer.lock:
            self.trainer.me.broadcast_object((op, args))
            return getattr(self.trainer, op)(*args)

    def infer(self, requests):
        parts = []
        for request in requests:
            refuse_infer_inputs(request)
            tokens, lengths = _array(request, "tokens"), _array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            parts.append((tokens, lengths.reshape(-1)))
        tokens, lengths, sizes = _stack(parts)
        values, rewards = self._all("infer", tokens, lengths)
        responses, start = [], 0
        for (t, _), size in zip(parts, sizes):
            response = {"values": values[start:start + size, :t.shape[1]].numpy().astype(np.float32)}
            if rewards is not None:
                response["rewards"] = rewards[start:start + size].numpy().astype(np.float32).reshape(-1, 1)
            responses.append(response)
            start += size
        return responses

    def train(self, requests):
        responses = []
        for request in requests:  # batching is off: one request per call
            arrays = (_array(request, n) for n in ("tokens", "returns", "prev_values", "mask"))
            tokens, returns, prev_values, mask = train_arrays(*arrays)  # [B,L-1] per action -> [B,L]
            if tokens.shape[0] > self.max_train_rows:
                raise CriticInputError(f"tokens: batch of {tokens.shape[0]} rows exceeds this server's "
                                       f"max_train_rows={self.max_train_rows} (deploy.critic.max_train_rows): send it "
                                       f"in parts")
            check_vocab(tokens, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            stats = self._all("train", *(torch.as_tensor(np.array(a)) for a in (tokens, returns, prev_values, mask)))
            if stats["skipped_steps"]:
                LOG.warning("critic_train: %d optimizer step(s) skipped: loss or gradient norm not finite (the "
                            "weights are as before those steps)", stats["skipped_steps"])
            response = {name: np.array([stats[name]], dtype=np.float32) for name in TRAIN_STATS}
            response["step"] = np.array([stats["step"]], dtype=np.int64)
            responses.append(response)
        return responses

    def save(self, requests):
        with self._save_lock:
            target = self.trainer.checkpoint_dir
            if target is None:
                raise ValueError("critic_save: no checkpoint directory configured (--checkpoint-dir)")
            target.parent.mkdir(parents=True, exist_ok=True)
            path = self._all("save", None, tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            step = self.trainer.step
            # with a store (a server that may sit on another node than the flow): upload the save where the flow's
            # next checkpoint adopts it into iter_<N>/critic; the local path otherwise
            location = (self.store.put_dir(path, f"{PENDING_PREFIX}/step-{step}") if self.store is not None
                        else str(path))
        LOG.info("critic_save: step %d -> %s", step, location)
        return [{"status": np.array([0], dtype=np.int64), "step": np.array([step], dtype=np.int64),
                 "path": np.array([location.encode()], dtype=np.bytes_)} for _ in requests]

    def bindings(self, max_batch_size: int, max_queue_delay_us: int) -> list[tuple[ModelSpec, Callable]]:
        specs = critic_specs(self.trainer.token_rewards, max_batch_size, max_queue_delay_us)
        return list(zip(specs, (self.infer, self.train, self.save)))


class RewardCallables:
    """`reward_model` over a sequence-classification model, or over Python reward functions of decoded text.

    A function reward needs prompt and response text: they are decoded with the tokenizer from tokens[:prompt_length]
    and tokens[prompt_length:sequence_length]. NeMo-Aligner clients do not send `prompt_lengths`; the whole sequence
    is then the response and the prompt is empty. Reward functions (models/reward.WeightedRewards) also answer each
    function's scores (`function_rewards`).
    """

    def __init__(self, model=None, function=None, tokenizer=None, vocab_size: int | None = None, reward_tokenizer=None,
                 chat_template: bool = False, lock: threading.Lock | None = None, micro_batch_size: int = 64):
        if (model is None) == (function is None):
            raise ValueError("reward server: give exactly one of a reward model or a reward function")
        if function is not None and tokenizer is None:
            raise ValueError("reward server: a function reward needs a tokenizer (--tokenizer) to decode tokens")
        if model is not None and reward_tokenizer is None:
            raise ValueError("reward server: reward_text needs the reward model's tokenizer")
        self.model, self.function, self.tokenizer = model, function, tokenizer
        self.reward_tokenizer, self.chat_template = reward_tokenizer, chat_template
        self.vocab_size = vocab_size or (model.config.vocab_size if model is not None else len(tokenizer))
        self.lock = lock or threading.Lock()
        self.micro_batch_size = micro_batch_size

    def text(self, requests):
        """`reward_text`: (prompt, response) strings scored by the reward model with its own tokenizer (or the
        reward function). The texts are cut to what the model can score and tokenized before the lock is taken (a
        long text never holds up the critic's other requests)."""
        parts = []
        for request in requests:
            prompts = decode_texts(_array(request, "prompts"), "prompts")
            responses = decode_texts(_array(request, "responses"), "responses")
            if len(prompts) != len(responses):
                raise CriticInputError(f"responses: batch size {len(responses)} does not match prompts batch size "
                                       f"{len(prompts)}")
            parts.append((prompts, responses, decode_columns(request, len(prompts))))
        prompts = [p for ps, _, _ in parts for p in ps]
        responses = [r for _, rs, _ in parts for r in rs]
        columns = [c for _, _, cs in parts for c in cs]
        if self.model is not None:
            batches = text_batches(self.reward_tokenizer, prompts, responses, self.chat_template,
                                   reward_limit(self.model), self.micro_batch_size)
            with self.lock:
                scores, each = score_batches(self.model, batches).numpy(), None
        else:
            with self.lock:
                scores, each = self._score_functions(prompts, responses, columns)
        return self._answers([len(ps) for ps, _, _ in parts], scores, each)

    @property
    def functions(self) -> bool:
        """Whether this server scores with reward functions that answer each one's scores."""
        return hasattr(self.function, "score_all")

    def _score_functions(self, prompts, responses, columns) -> tuple[np.ndarray, np.ndarray | None]:
        """The score of each sample, and with reward functions each function's [B, F]."""
        if self.functions:
            total, each = self.function.score_all(prompts, responses, columns)
            return np.asarray(total, dtype=np.float32), np.asarray(each, dtype=np.float32).reshape(len(each), -1).T
        return np.asarray(self.function(prompts, responses, columns), dtype=np.float32), None

    def _answers(self, sizes: list[int], scores: np.ndarray, each: np.ndarray | None) -> list[dict]:
        """One response per request of a dynamic batch: its rows of `rewards` (and `function_rewards`)."""
        out, start = [], 0
        for size in sizes:
            answer = {"rewards": scores[start:start + size].astype(np.float32).reshape(-1, 1)}
            if each is not None:
                answer["function_rewards"] = np.ascontiguousarray(each[start:start + size], dtype=np.float32)
            out.append(answer)
            start += size
        return out

    def infer(self, requests):
        parts, prompt_parts, column_parts = [], [], []
        for request in requests:
            tokens, lengths = _array(request, "tokens"), _array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.vocab_size)
            lengths = lengths.reshape(-1)
            if self.model is not None:
                check_positions(tokens, self.model)
            prompt = request["prompt_lengths"] if "prompt_lengths" in request.keys() else None
            prompt_parts.append(check_prompt_lengths(np.asarray(prompt), lengths) if prompt is not None
                                else np.zeros_like(lengths))
            column_parts.append(decode_columns(request, len(lengths)))
            parts.append((tokens, lengths))
        with self.lock:
            each = None
            if self.model is not None:
                tokens, lengths, _ = _stack(parts)
                device = next(self.model.parameters()).device
                scores = reward_model_scores(self.model, tokens.to(device), lengths.to(device)).cpu().numpy()
            else:
                texts = [self._decode(t, ln, p) for (t, ln), p in zip(parts, prompt_parts)]
                scores, each = self._score_functions([p for ps, _ in texts for p in ps], [r for _, rs in texts for r in rs],
                                                     [c for cs in column_parts for c in cs])
        return self._answers([tokens.shape[0] for tokens, _ in parts], scores, each)

    def _decode(self, tokens: np.ndarray, lengths: np.ndarray, prompt_lengths: np.ndarray) -> tuple[list[str], list[str]]:
        """The prompt and response texts of token rows (split at the prompt lengths)."""
        rows = tokens.tolist()
        prompts = [self.tokenizer.decode(r[:p], skip_special_tokens=True) for r, p in zip(rows, prompt_lengths)]
        responses = [self.tokenizer.decode(r[p:n], skip_special_tokens=True)
                     for r, p, n in zip(rows, prompt_lengths, lengths)]
        return prompts, responses

    def bindings(self, max_batch_size: int, max_queue_delay_us: int) -> list[tuple[ModelSpec, Callable]]:
        return list(zip(reward_specs(max_batch_size, max_queue_delay_us, self.functions), (self.infer, self.text)))


# ---------------------------------------------------------------- serving

PENDING_PREFIX = "critic-pending"  # store keys where a critic server puts its saves until a checkpoint adopts them


class ServerSpec(BaseModel):
    """Everything one server process needs, handed to it as one JSON document (`python -m components.serving.main`).

    The config tree supplies the models (model.critic / model.reward / model.policy for a function reward's
    tokenizer), dtype, device and the critic/reward sections; the fields here are what differs per process.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["critic", "reward"]
    config: RLHFConfig = Field(default_factory=RLHFConfig)
    host: str = Field("127.0.0.1", description="Interface to bind: HTTP port P, gRPC P+1, metrics P+2.")
    port: int = Field(8400, ge=1, le=65533, description="HTTP port P.")
    checkpoint_dir: Optional[str] = Field(None, description="critic: where critic_save writes; a save there is resumed.")
    checkpoint_uri: Optional[str] = Field(None, description="critic: the run's checkpoint store; each save is also "
                                          f"uploaded to <uri>/{PENDING_PREFIX}/step-<k> for the next checkpoint to adopt.")
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
        return REWARD_MODELS

    @property
    def section(self):
        """Where this server runs: the deployment's critic or reward section."""
        return self.config.deploy.critic if self.kind == "critic" else self.config.deploy.reward

    @property
    def loaded_models(self) -> tuple[str, ...]:
        """The `model.<field>`s this server loads: the critic (or the reward model it starts from) and the reward
        model; a reward server its reward model, or the policy's tokenizer for a reward function."""
        if self.kind == "critic":
            return ("critic", "reward")
        return ("reward",) if self.config.reward.source == "model" else ("policy",)

    def security(self) -> dict:
        """Triton's restricted APIs for this server (TritonSecurityConfig's arguments): with deploy.<kind>.auth
        'secret', every API group but health needs the token derived from the run's secret ($RLHF_RUN_SECRET or the
        file $RLHF_RUN_SECRET_FILE names; a server without one refuses to start); with 'none' (open mode), only the
        admin groups do (with the run's secret when it has one, else a token of its own), and it says so."""
        secret = read_secret()
        if self.section.auth == "secret":
            if secret is None:
                raise MissingSecret(
                    f"deploy.{self.kind}.auth=secret: every request must carry the run's secret, and this server was "
                    f"given none: set $RLHF_RUN_SECRET (or $RLHF_RUN_SECRET_FILE, a file holding it) in its "
                    f"environment and give clients the same secret; or serve clients that send no credentials "
                    f"(NeMo-Aligner's) in open mode: --set deploy.{self.kind}.auth=none")
            return {"access_token": triton_token(secret), "restricted_endpoints": list(RESTRICTED_APIS)}
        LOG.warning("%s server: OPEN MODE (deploy.%s.auth=none): inference, model config and metadata answer anyone "
                    "who reaches %s:%d; only the admin endpoints need a token", self.kind, self.kind, self.host,
                    self.port)
        return {"access_token": triton_token(secret) if secret else None, "restricted_endpoints": list(OPEN_MODE_APIS)}

    def triton_config(self):
        from pytriton.triton import TritonConfig  # heavy: only a server process starts Triton

        return TritonConfig(http_address=self.host, http_port=self.port, grpc_address=self.host,
                            grpc_port=self.port + 1, metrics_address=self.host, metrics_port=self.port + 2,
                            allow_gpu_metrics=torch.cuda.is_available(), exit_timeout_secs=self.exit_timeout_s)


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


_FAILING_MODEL_PY = '''
import os


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(args["model_repository"], "load_error.txt")) as f:
            raise RuntimeError(f.read())
'''


def triton_client(url: str, timeout_s: float = 2.0):
    """A tritonclient HTTP client of `url` (http://host:port or host:port) with bounded timeouts."""
    import tritonclient.http as http  # heavy: a flow imports this module for the spec, not for a client

    return http.InferenceServerClient(url.split("://", 1)[-1].rstrip("/"), connection_timeout=timeout_s,
                                      network_timeout=timeout_s)


def _register_failed_model(workspace, url: str, token: str | None, name: str, reason: str) -> None:
    """Put `name` into Triton's repository as a model whose load fails with `reason` (state UNAVAILABLE + reason)."""
    from tritonclient.utils import InferenceServerException  # heavy: see triton_client

    model_dir = Path(workspace.model_store_path) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "unavailable" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'output [ { name: "unavailable_out" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    (model_dir / "load_error.txt").write_text(reason)
    (model_dir / "1" / "model.py").write_text(_FAILING_MODEL_PY)
    client = triton_client(url, timeout_s=60)
    try:
        client.load_model(name, headers={TRITON_HEADER: token} if token else None)
    except InferenceServerException:
        pass  # expected: the load fails with `reason`
    finally:
        client.close()


def serve(spec: ServerSpec, load: Callable[[], tuple[list, object]] | None = None) -> int:
    """Start Triton, load the weights (`load` returns (model spec, callable) pairs and the group of the server's other
    ranks, or None), bind, serve until SIGTERM/SIGINT. Models are bound, so the server is ready, only once every rank
    is up; a rank that exits stops the server (not ready any more) with an error that names it.

    Returns the process exit code: 0 after a requested stop, 1 when the weights failed to load, a rank or Triton died.
    """
    prepare_environment()
    kind = spec.kind
    load = load or (lambda: load_callables(spec))
    busy = [port for port in (spec.port, spec.port + 1, spec.port + 2) if not can_bind(spec.host, port)]
    if busy:  # tritonserver would exit, but PyTriton would keep waiting for it for minutes
        LOG.error("%s server: port(s) %s on %s already in use (HTTP %d, gRPC +1, metrics +2); choose another --port",
                  kind, busy, spec.host, spec.port)
        return 1
    from pytriton.triton import Triton, TritonSecurityConfig  # heavy: only a server process starts Triton
    from pytriton.utils.workspace import Workspace  # heavy: as above

    def on_signal(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exit_with_parent()  # a run killed without stopping us (SIGKILL): stop as a stop request would, within seconds
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    try:
        security = spec.security()
    except MissingSecret as exc:
        LOG.error("%s server: %s", kind, exc)
        return 2
    workspace = Workspace()  # a fresh directory under $PYTRITON_HOME: servers on one machine never share one
    triton = Triton(config=spec.triton_config(), workspace=workspace,
                    security_config=TritonSecurityConfig(**security))
    url = f"http://{spec.host}:{spec.port}"
    code = 0
    group = None
    try:
        started = time.monotonic()
        triton.run()
        LOG.info("%s server: Triton up at %s (grpc %d, metrics %d) in %.1fs; loading weights", kind, url,
                 spec.port + 1, spec.port + 2, time.monotonic() - started)
        try:
            bindings, group = load()
        except Exception as exc:  # noqa: BLE001 - reported through Triton's model state, and logged
            LOG.exception("%s server: weights failed to load", kind)
            reason = f"{kind} server failed to load: {type(exc).__name__}: {exc}"
            for name in spec.models:
                _register_failed_model(workspace, url, triton.get_access_token(), name, reason)
            code = 1
            wait_for(lambda: not triton.is_alive(), None, poll_s=0.5)  # answer readiness checks with the reason
            return code
        for model, infer in bindings:
            triton.bind(model_name=model.name, infer_func=infer, inputs=model.inputs,
                        outputs=model.outputs, config=model.config(), strict=True)
        LOG.info("%s server: ready at %s with models %s (%.1fs)", kind, url, [m.name for m, _ in bindings],
                 time.monotonic() - started)

        def ended() -> Optional[str]:
            """Why serving stopped by itself: a rank exited, or Triton (or a model backend) did."""
            if group is not None and (reason := group.exited()):
                return reason
            return None if triton.is_alive() else "Triton or a model backend exited"

        LOG.error("%s server: %s", kind, wait_for(ended, None, poll_s=0.5))
        code = 1
    except _Stop:
        LOG.info("%s server: stop requested", kind)
    finally:
        triton.stop()
        if group is not None:
            _stop_ranks(group)
        LOG.info("%s server: stopped", kind)
    return code


def _stop_ranks(group) -> None:
    """Tell the server's other ranks to stop (when they can still hear it), then make sure they are gone."""
    if group.exited() is None:
        me = distributed.Dist(0, group.world, 0, group.world)
        try:
            me.broadcast_object(("stop", ()))
            distributed.shutdown(me, graceful=True)
        except Exception:  # noqa: BLE001 - a rank already gone: stopped below either way
            pass
    group.stop()
    distributed.shutdown()


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("pytriton", "tritonclient", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def load_callables(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    """Load the weights a spec names (building the embedded default if it is named and missing) and bind callables."""
    return (_load_critic if spec.kind == "critic" else _load_reward)(spec)


def _load_critic(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    """Rank 0 of the critic server: restore from the run's store if asked, start the other ranks (critic.nproc_per_node
    > 1), build the critic on every rank, and bind the callables (which tell the other ranks what to run)."""
    cfg = spec.config
    if cfg.critic_carries_reward and not cfg.model.reward:
        raise ValueError("critic server: combining rewards needs a reward model (model.reward) or critic.combine_reward=false")
    store = None
    if spec.checkpoint_uri:
        store = CheckpointStore.from_uri(spec.checkpoint_uri, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
        if spec.restore_iteration is not None:
            if not spec.checkpoint_dir:
                raise ValueError("critic server: restore_iteration needs a checkpoint_dir to restore into")
            store.load_part(spec.restore_iteration, "critic", Path(spec.checkpoint_dir))
            LOG.info("critic: restored iter_%d/critic from %s", spec.restore_iteration, store.uri)
    group = None
    me = None
    if cfg.deploy.critic.nproc_per_node > 1:
        group, me = _start_critic_ranks(spec)
    trainer, reward_tokenizer = _critic_trainer(spec, me)
    LOG.info("critic: %d rank(s), step %d, checkpoint dir %s, reward model %s", trainer.me.world_size, trainer.step,
             spec.checkpoint_dir, ("combined (tokens and text)" if trainer.token_rewards else "combined (text only)")
             if trainer.reward_model is not None else "not loaded")
    if trainer.warning:
        LOG.warning(trainer.warning)
    bindings = CriticCallables(trainer, store, cfg.deploy.critic.max_train_rows).bindings(spec.max_batch_size, cfg.deploy.critic.max_queue_delay_us)
    if trainer.reward_model is not None:
        text = RewardCallables(model=trainer.reward_model, reward_tokenizer=reward_tokenizer,
                               chat_template=cfg.reward.chat_template, lock=trainer.lock)
        bindings.append((reward_text_spec(spec.max_batch_size, cfg.deploy.critic.max_queue_delay_us), text.text))
    return bindings, group


def _critic_trainer(spec: ServerSpec, me=None):
    """The critic of a spec on this rank (every rank builds it alike), and the reward model's tokenizer."""
    me = me or distributed.SINGLE
    cfg = spec.config
    critic_path = cfg.resolve_model_path(cfg.model.critic) if cfg.model.critic else None
    reward_path = cfg.resolve_model_path(cfg.model.reward) if cfg.model.reward else None
    reward_tokenizer = load_reward_tokenizer(reward_path) if cfg.critic_carries_reward else None
    # critic_infer scores the critic's (= the policy's) tokens with the reward model only when the run's reward
    # transport is tokens (a flow's config carries it decided; a server started on its own decides it for its critic)
    token_rewards = reward_transport(cfg, reader=cfg.model.critic or cfg.model.reward) == "tokens"
    trainer = CriticTrainer(cfg.critic, critic_path, reward_path, cfg.critic_carries_reward, cfg.model.dtype,
                            distributed.local_device(cfg.deploy.device, me), spec.checkpoint_dir,
                            token_rewards=token_rewards, me=me, gradient_checkpointing=cfg.model.gradient_checkpointing,
                            normalize_reward=cfg.reward.normalize)
    return trainer, reward_tokenizer


def _start_critic_ranks(spec: ServerSpec):
    """Start ranks 1..N-1 of the critic server (in this server's process group), join them, hand them the spec."""
    cfg = spec.config
    world = cfg.deploy.critic.nproc_per_node
    log_dir = Path(spec.checkpoint_dir).parent if spec.checkpoint_dir else cfg.resolved_state_dir() / "servers"
    group = Followers("critic", world, "127.0.0.1", spec.port + 3, [sys.executable, "-m", "components.serving.main", "--follow"],
                      {BACKEND_ENV: cfg.deploy.actor.backend, TIMEOUT_ENV: str(cfg.deploy.actor.collective_timeout_s)},
                      log_dir / "logs", own_group=False)
    me = distributed.Dist(0, world, 0, world)
    device = distributed.local_device(cfg.deploy.device, me)
    distributed.init(me, distributed.resolve_backend(cfg.deploy.actor.backend, device), cfg.deploy.actor.collective_timeout_s, device,
                     group.init_method)
    me.broadcast_object(spec.model_dump_json())
    return group, me


def follow_critic() -> int:
    """Rank r > 0 of a critic server: join, receive the spec, build the critic shard, run what rank 0 says."""
    exit_with_parent()
    me = distributed.from_env()
    device = distributed.local_device("auto", me)
    distributed.init(me, distributed.resolve_backend(os.environ.get(BACKEND_ENV, "auto"), device),
                     float(os.environ.get(TIMEOUT_ENV, "300")), device)
    try:
        spec = ServerSpec.model_validate_json(me.broadcast_object(None))
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        trainer, _ = _critic_trainer(spec, me)
        while (command := me.broadcast_object(None))[0] != "stop":
            op, args = command
            getattr(trainer, op)(*args)
        distributed.shutdown(me, graceful=True)
    finally:
        distributed.shutdown()
    return 0


def _load_reward(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    cfg = spec.config
    if cfg.reward.source == "model":
        path = cfg.resolve_model_path(cfg.model.reward)
        callables = RewardCallables(model=load_reward_model(path, cfg.model.dtype, resolve_device(cfg.deploy.device),
                                                            normalize=cfg.reward.normalize),
                                    reward_tokenizer=load_reward_tokenizer(path), chat_template=cfg.reward.chat_template)
    else:
        tokenizer = load_reward_tokenizer(cfg.resolve_model_path(cfg.model.policy), "model.policy")
        callables = RewardCallables(function=load_reward_functions(cfg.reward, deploy=cfg.deploy), tokenizer=tokenizer)
    return callables.bindings(spec.max_batch_size, cfg.deploy.reward.max_queue_delay_us), None


def model_state_summary(index: list[dict], name: str) -> str | None:
    """'STATE: reason' of `name` in a repository index (POST /v2/repository/index), None if absent."""
    for entry in index:
        if entry.get("name") == name:
            state, reason = entry.get("state") or "UNKNOWN", (entry.get("reason") or "").strip()
            return f"{state}: {reason}" if reason else state
    return None
