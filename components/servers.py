"""PyTriton bindings of the critic and reward servers: thin adapters around models/critic.py and models/reward.py.

Wire contract (NeMo-Aligner compatible; tokens right-padded, B = batch, L = sequence length):
    critic_infer  (dynamic batching)  tokens int64 [B,L], sequence_lengths int64 [B,1]
                                      -> values float32 [B,L] (+ rewards float32 [B,1] when the reward model is combined)
    critic_train  (no batching)       tokens int64 [B,L], returns/prev_values/mask float32 [B,L]
                                      -> loss_mean, grad_norm, explained_variance, clipfrac, lr float32 [1]; step int64 [1]
    critic_save   (no batching)       dummy_var int64 [1] -> status int64 [1] (0 = saved), step int64 [1], path bytes [1]
    reward_model  (dynamic batching)  tokens, sequence_lengths (+ optional prompt_lengths int64 [B,1])
                                      -> rewards float32 [B,1]

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
  prepends sysconfig LIBDIR to LD_LIBRARY_PATH before Triton starts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # torch and transformers load lazily: `rlhf --help` imports this module for its parser
    from models.critic import CriticTrainer

LOG = logging.getLogger("rlhf.server")

CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE, REWARD_MODEL = "critic_infer", "critic_train", "critic_save", "reward_model"
CRITIC_MODELS = (CRITIC_INFER, CRITIC_TRAIN, CRITIC_SAVE)
REWARD_MODELS = (REWARD_MODEL,)
TOKEN_ENV = "RLHF_TRITON_ACCESS_TOKEN"  # access token for Triton's restricted endpoints (repository index, ...)
ACCESS_HEADER = "triton-access-token"
TRAIN_STATS = ("loss_mean", "grad_norm", "explained_variance", "clipfrac", "lr")


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


def check_positions(tokens: np.ndarray, model) -> None:
    """A sequence longer than the model's position table would fail deep inside torch; say so up front."""
    from models.critic import CriticInputError

    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and tokens.shape[1] > limit:
        raise CriticInputError(f"tokens: sequence length L={tokens.shape[1]} exceeds the model's "
                               f"max_position_embeddings={limit}")


def check_vocab(tokens: np.ndarray, vocab_size: int) -> None:
    from models.critic import CriticInputError

    if tokens.size and ((tokens < 0).any() or (tokens >= vocab_size).any()):
        raise CriticInputError(f"tokens: ids must be in [0, {vocab_size}), got min {tokens.min()} max {tokens.max()}")


def check_prompt_lengths(prompt_lengths: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    from models.critic import CriticInputError

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
    import torch

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
        from pytriton.model_config import DynamicBatcher, ModelConfig

        if not self.batching:
            return ModelConfig(batching=False)
        return ModelConfig(batching=True, max_batch_size=self.max_batch_size,
                           batcher=DynamicBatcher(max_queue_delay_microseconds=self.max_queue_delay_us))


def _tensor(name: str, dtype, shape, optional: bool = False):
    from pytriton.model_config import Tensor

    return Tensor(name=name, dtype=dtype, shape=shape, optional=optional)


def critic_specs(combine_reward: bool, max_batch_size: int, max_queue_delay_us: int) -> list[ModelSpec]:
    infer_out = [_tensor("values", np.float32, (-1,))] + ([_tensor("rewards", np.float32, (1,))] if combine_reward else [])
    return [
        ModelSpec(CRITIC_INFER, [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,))],
                  infer_out, True, max_batch_size, max_queue_delay_us),
        ModelSpec(CRITIC_TRAIN, [_tensor("tokens", np.int64, (-1, -1))] +
                  [_tensor(n, np.float32, (-1, -1)) for n in ("returns", "prev_values", "mask")],
                  [_tensor(n, np.float32, (1,)) for n in TRAIN_STATS] + [_tensor("step", np.int64, (1,))], False),
        ModelSpec(CRITIC_SAVE, [_tensor("dummy_var", np.int64, (1,))],
                  [_tensor("status", np.int64, (1,)), _tensor("step", np.int64, (1,)), _tensor("path", bytes, (1,))],
                  False),
    ]


def reward_specs(max_batch_size: int, max_queue_delay_us: int) -> list[ModelSpec]:
    return [ModelSpec(REWARD_MODEL, [_tensor("tokens", np.int64, (-1,)), _tensor("sequence_lengths", np.int64, (1,)),
                                     _tensor("prompt_lengths", np.int64, (1,), optional=True)],
                      [_tensor("rewards", np.float32, (1,))], True, max_batch_size, max_queue_delay_us)]


class CriticCallables:
    """The three critic models as PyTriton callables (lists of requests in, list of responses out)."""

    def __init__(self, trainer: CriticTrainer, store=None, store_key: str = "critic-server"):
        self.trainer, self.store, self.store_key = trainer, store, store_key
        self._save_lock = threading.Lock()

    def infer(self, requests):
        from models.critic import validate_tokens

        parts = []
        for request in requests:
            tokens, lengths = _array(request, "tokens"), _array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            parts.append((tokens, lengths.reshape(-1)))
        tokens, lengths, sizes = _stack(parts)
        values, rewards = self.trainer.infer(tokens, lengths)
        responses, start = [], 0
        for (t, _), size in zip(parts, sizes):
            response = {"values": values[start:start + size, :t.shape[1]].numpy().astype(np.float32)}
            if rewards is not None:
                response["rewards"] = rewards[start:start + size].numpy().astype(np.float32).reshape(-1, 1)
            responses.append(response)
            start += size
        return responses

    def train(self, requests):
        import torch

        from models.critic import validate_train

        responses = []
        for request in requests:  # batching is off: one request per call
            tokens, returns, prev_values, mask = (_array(request, n) for n in ("tokens", "returns", "prev_values", "mask"))
            validate_train(tokens, returns, prev_values, mask)
            check_vocab(tokens, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            stats = self.trainer.train(*(torch.as_tensor(np.array(a)) for a in (tokens, returns, prev_values, mask)))
            response = {name: np.array([stats[name]], dtype=np.float32) for name in TRAIN_STATS}
            response["step"] = np.array([stats["step"]], dtype=np.int64)
            responses.append(response)
        return responses

    def save(self, requests):
        with self._save_lock:
            path = self.trainer.save()
            location = self.store.put_dir(path, self.store_key) if self.store is not None else str(path)
            step = self.trainer.step
        LOG.info("critic_save: step %d -> %s", step, location)
        return [{"status": np.array([0], dtype=np.int64), "step": np.array([step], dtype=np.int64),
                 "path": np.array([location.encode()], dtype=np.bytes_)} for _ in requests]

    def bindings(self) -> dict[str, Callable]:
        return {CRITIC_INFER: self.infer, CRITIC_TRAIN: self.train, CRITIC_SAVE: self.save}


class RewardCallables:
    """`reward_model` over a sequence-classification model, or over a Python function of decoded text.

    A function reward needs prompt and response text: they are decoded with the tokenizer from tokens[:prompt_length]
    and tokens[prompt_length:sequence_length]. NeMo-Aligner clients do not send `prompt_lengths`; the whole sequence
    is then the response and the prompt is empty.
    """

    def __init__(self, model=None, function=None, tokenizer=None, vocab_size: int | None = None):
        if (model is None) == (function is None):
            raise ValueError("reward server: give exactly one of a reward model or a reward function")
        if function is not None and tokenizer is None:
            raise ValueError("reward server: a function reward needs a tokenizer (--tokenizer) to decode tokens")
        self.model, self.function, self.tokenizer = model, function, tokenizer
        self.vocab_size = vocab_size or (model.config.vocab_size if model is not None else len(tokenizer))
        self.lock = threading.Lock()

    def infer(self, requests):
        from models.critic import validate_tokens

        parts, prompt_parts = [], []
        for request in requests:
            tokens, lengths = _array(request, "tokens"), _array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.vocab_size)
            lengths = lengths.reshape(-1)
            if self.model is not None:
                check_positions(tokens, self.model)
            prompt = request["prompt_lengths"] if "prompt_lengths" in request.keys() else None
            prompt_parts.append(check_prompt_lengths(np.asarray(prompt), lengths) if prompt is not None
                                else np.zeros_like(lengths))
            parts.append((tokens, lengths))
        with self.lock:
            if self.model is not None:
                from models.reward import reward_model_scores

                tokens, lengths, _ = _stack(parts)
                device = next(self.model.parameters()).device
                scores = reward_model_scores(self.model, tokens.to(device), lengths.to(device)).cpu().numpy()
            else:
                scores = np.concatenate([self._score_text(t, ln, p) for (t, ln), p in zip(parts, prompt_parts)])
        responses, start = [], 0
        for tokens, _ in parts:
            responses.append({"rewards": scores[start:start + tokens.shape[0]].astype(np.float32).reshape(-1, 1)})
            start += tokens.shape[0]
        return responses

    def _score_text(self, tokens: np.ndarray, lengths: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray:
        rows = tokens.tolist()
        prompts = [self.tokenizer.decode(r[:p], skip_special_tokens=True) for r, p in zip(rows, prompt_lengths)]
        responses = [self.tokenizer.decode(r[p:n], skip_special_tokens=True)
                     for r, p, n in zip(rows, prompt_lengths, lengths)]
        return np.asarray(self.function(prompts, responses), dtype=np.float32)

    def bindings(self) -> dict[str, Callable]:
        return {REWARD_MODEL: self.infer}


# ---------------------------------------------------------------- serving

@dataclass
class ServeOptions:
    """Network and Triton settings of one server process: HTTP port P, gRPC P+1, metrics P+2, all on `host`."""

    host: str = "127.0.0.1"
    port: int = 8400
    max_batch_size: int = 256
    max_queue_delay_us: int = 2000
    access_token: str | None = None  # None: $RLHF_TRITON_ACCESS_TOKEN, else PyTriton generates one
    exit_timeout_s: int = 10
    torch_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    extra: dict = field(default_factory=dict)  # further TritonConfig fields

    def triton_config(self):
        import torch
        from pytriton.triton import TritonConfig

        return TritonConfig(http_address=self.host, http_port=self.port, grpc_address=self.host,
                            grpc_port=self.port + 1, metrics_address=self.host, metrics_port=self.port + 2,
                            allow_gpu_metrics=torch.cuda.is_available(), exit_timeout_secs=self.exit_timeout_s,
                            **self.extra)


def can_bind(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR, as servers do: TIME_WAIT leftovers do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


_FAILING_MODEL_PY = '''
import os


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(args["model_repository"], "load_error.txt")) as f:
            raise RuntimeError(f.read())
'''


def _register_failed_model(workspace, url: str, token: str | None, name: str, reason: str) -> None:
    """Put `name` into Triton's repository as a model whose load fails with `reason` (state UNAVAILABLE + reason)."""
    model_dir = Path(workspace.model_store_path) / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "unavailable" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        'output [ { name: "unavailable_out" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')
    (model_dir / "load_error.txt").write_text(reason)
    (model_dir / "1" / "model.py").write_text(_FAILING_MODEL_PY)
    request = urllib.request.Request(f"{url}/v2/repository/models/{name}/load", data=b"{}", method="POST",
                                     headers={ACCESS_HEADER: token} if token else {})
    try:
        urllib.request.urlopen(request, timeout=60).read()
    except urllib.error.HTTPError:
        pass  # expected: the load fails with `reason`


def serve(kind: str, specs: list[ModelSpec], load: Callable[[], dict[str, Callable]], options: ServeOptions) -> int:
    """Start Triton, load the weights (`load` returns name -> callable), bind, serve until SIGTERM/SIGINT.

    Returns the process exit code: 0 after a requested stop, 1 when the weights failed to load or Triton died.
    """
    prepare_environment()
    busy = [port for port in (options.port, options.port + 1, options.port + 2) if not can_bind(options.host, port)]
    if busy:  # tritonserver would exit, but PyTriton would keep waiting for it for minutes
        LOG.error("%s server: port(s) %s on %s already in use (HTTP %d, gRPC +1, metrics +2); choose another --port",
                  kind, busy, options.host, options.port)
        return 1
    from pytriton.triton import Triton, TritonSecurityConfig
    from pytriton.utils.workspace import Workspace

    def on_signal(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if options.torch_threads:
        import torch

        torch.set_num_threads(options.torch_threads)
    token = options.access_token or os.environ.get(TOKEN_ENV) or None
    workspace = Workspace()  # a fresh directory under $PYTRITON_HOME: servers on one machine never share one
    triton = Triton(config=options.triton_config(), workspace=workspace,
                    security_config=TritonSecurityConfig(access_token=token))
    url = f"http://{options.host}:{options.port}"
    code = 0
    try:
        started = time.monotonic()
        triton.run()
        LOG.info("%s server: Triton up at %s (grpc %d, metrics %d) in %.1fs; loading weights", kind, url,
                 options.port + 1, options.port + 2, time.monotonic() - started)
        try:
            callables = load()
        except Exception as exc:  # noqa: BLE001 - reported through Triton's model state, and logged
            LOG.exception("%s server: weights failed to load", kind)
            reason = f"{kind} server failed to load: {type(exc).__name__}: {exc}"
            for spec in specs:
                _register_failed_model(workspace, url, triton.get_access_token(), spec.name, reason)
            code = 1
            while triton.is_alive():  # keep answering readiness checks with the reason until stopped
                time.sleep(0.5)
            return code
        for spec in specs:
            triton.bind(model_name=spec.name, infer_func=callables[spec.name], inputs=spec.inputs,
                        outputs=spec.outputs, config=spec.config(), strict=True)
        LOG.info("%s server: ready at %s with models %s (%.1fs)", kind, url, [s.name for s in specs],
                 time.monotonic() - started)
        while triton.is_alive():
            time.sleep(0.5)
        LOG.error("%s server: Triton or a model backend exited", kind)
        code = 1
    except _Stop:
        LOG.info("%s server: stop requested", kind)
    finally:
        triton.stop()
        LOG.info("%s server: stopped", kind)
    return code


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("pytriton", "tritonclient", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@dataclass
class CriticServer:
    """`critic_infer` + `critic_train` + `critic_save` in one Triton instance; `run()` blocks until stopped."""

    cfg: "object"  # models.config.CriticConfig
    model: str | None
    reward: str | None
    combine_reward: bool = True
    checkpoint_dir: str | None = None
    checkpoint_uri: str | None = None
    checkpoint_key: str = "critic-server"
    s3_endpoint_url: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    options: ServeOptions = field(default_factory=ServeOptions)

    def specs(self) -> list[ModelSpec]:
        return critic_specs(self.combine_reward, self.options.max_batch_size, self.options.max_queue_delay_us)

    def load(self) -> dict[str, Callable]:
        from models.critic import CriticTrainer
        from models.loading import resolve_device

        if self.combine_reward and not self.reward:
            raise ValueError("critic server: combining rewards needs a reward model (--reward) or --no-combine")
        store = None
        if self.checkpoint_uri:
            from components.checkpoints import CheckpointStore

            store = CheckpointStore.from_uri(self.checkpoint_uri, s3_endpoint_url=self.s3_endpoint_url)
        trainer = CriticTrainer(self.cfg, self.model, self.reward, self.combine_reward, self.dtype,
                                resolve_device(self.device), self.checkpoint_dir)
        LOG.info("critic: step %d, checkpoint dir %s, reward model %s", trainer.step, self.checkpoint_dir,
                 "combined" if trainer.reward_model is not None else "not loaded")
        return CriticCallables(trainer, store, self.checkpoint_key).bindings()

    def run(self) -> int:
        return serve("critic", self.specs(), self.load, self.options)


@dataclass
class RewardServer:
    """`reward_model` over a reward model (`model`) or a Python function (`function`, decoded with `tokenizer`)."""

    model: str | None = None
    function: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    options: ServeOptions = field(default_factory=ServeOptions)

    def specs(self) -> list[ModelSpec]:
        return reward_specs(self.options.max_batch_size, self.options.max_queue_delay_us)

    def load(self) -> dict[str, Callable]:
        from models.loading import resolve_device
        from models.reward import load_reward_function, load_reward_model

        if (self.model is None) == (self.function is None):
            raise ValueError("reward server: give exactly one of --model or --function")
        if self.model is not None:
            return RewardCallables(model=load_reward_model(self.model, self.dtype, resolve_device(self.device))).bindings()
        from transformers import AutoTokenizer

        if not self.tokenizer:
            raise ValueError("reward server: --function needs --tokenizer PATH to decode tokens into text")
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        return RewardCallables(function=load_reward_function(self.function), tokenizer=tokenizer).bindings()

    def run(self) -> int:
        return serve("reward", self.specs(), self.load, self.options)


def model_state_summary(index: list[dict], name: str) -> str | None:
    """'STATE: reason' of `name` in a repository index (POST /v2/repository/index), None if absent."""
    for entry in index:
        if entry.get("name") == name:
            state, reason = entry.get("state") or "UNKNOWN", (entry.get("reason") or "").strip()
            return f"{state}: {reason}" if reason else state
    return None


def dumps_config(cfg) -> str:
    """A CriticConfig as compact JSON for the command line of a child server."""
    return json.dumps(cfg.model_dump(mode="json"), separators=(",", ":"))


def add_serve_parser(subparsers):
    """`rlhf serve critic|reward` (defined in components/serve_main.py, next to the functions it calls)."""
    from components.serve_main import add_serve_parser as add

    return add(subparsers)
