"""HTTP clients of the critic and reward servers; they satisfy models/backends.py's CriticBackend / RewardBackend.

Each call runs on a small thread pool (real concurrency: several micro-batches in flight, merged by Triton's dynamic
batcher) over one pooled httpx client (thread-safe, connections kept alive), in Triton's binary tensor encoding
(tritonclient's). Timeouts are bounded. A connection that was never made is retried for every call (the request
never reached the server); a connection that broke is retried for idempotent calls (infer, score, save), never for
critic_train, which could have trained already. A server-side error is never retried: it raises ServerError carrying
the server's message.
Inputs are checked against the wire contract before sending, so our own malformed request cannot fail the other
requests Triton batched with it.

With the run's `secret`, the server proves it holds it on each new connection before anything is sent, and every
request is signed with the run's key (components/handshake.py: the secret never crosses the wire); no call can
forget it. `secret=None` reads $RLHF_RUN_SECRET (a client beside a server started by hand with it); without any, the
client sends no credentials (a server in open mode serves it).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Optional
from urllib.parse import quote

import httpx
import numpy as np
import torch
from torch import Tensor

from components.serving.auth import read_secret
from components.handshake import run_client
from components.serving.triton.contract import (CRITIC_INFER, CRITIC_SAVE, CRITIC_TRAIN, REWARD_MODEL, REWARD_TEXT,
                                                TEACHER_LOGPROBS, TRAIN_STATS)
from models.critic import CriticInputError, validate_tokens, validate_train

_DTYPES = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.object_): "BYTES"}
_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


class ServerError(RuntimeError):
    """The server answered a request with an error. `detail` holds its whole message (with the server traceback)."""

    def __init__(self, model: str, status: Optional[str], detail: str):
        self.model, self.status, self.detail = model, status, detail
        super().__init__(f"{model}: {summarize_server_error(detail)}")


class ServerUnavailable(ConnectionError):
    """The server could not be reached (after the retries a call is allowed)."""


def summarize_server_error(message: str) -> str:
    """The last 'SomeError: text' line of a PyTriton traceback (the error our callable raised), else the message."""
    lines = [m for m in (_ERROR_LINE.match(line.strip()) for line in message.splitlines()) if m]
    lines = [m for m in lines if not m.group(2).startswith("Traceback")]
    if lines:
        kind, text = lines[-1].groups()
        return f"{kind.rsplit('.', 1)[-1]}: {text}"
    return message.strip().splitlines()[0] if message.strip() else message


def _numpy(t, dtype) -> np.ndarray:
    array = t.detach().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t)
    return np.ascontiguousarray(array, dtype=dtype)


class TritonHTTP:
    """Synchronous calls with bounded timeouts and connection retries, and a thread pool for asynchronous ones, over
    one pooled HTTP client (thread-safe; its connections are kept alive between calls). With the run's secret
    (`secret`; None: $RLHF_RUN_SECRET) every connection is proven first and every request signed
    (components/handshake.py); tensors travel in Triton's own binary encoding (tritonclient's)."""

    def __init__(self, url: str, timeout_s: float = 300.0, connect_timeout_s: float = 10.0, retries: int = 3,
                 retry_wait_s: float = 1.0, max_workers: int = 4, name: str = "triton", secret: Optional[str] = None):
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.retries, self.retry_wait_s = retries, retry_wait_s
        self._http = run_client(secret if secret is not None else read_secret(), "triton",
                                limits=httpx.Limits(max_connections=max_workers + 2),
                                base_url=f"http://{self.url}",
                                timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix=name)
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._closed = False
        self._sleep = time.sleep  # the wait between attempts (tests record it instead of timing it)

    def request(self, what: str, method: str, path: str, idempotent: bool = True, **kwargs) -> httpx.Response:
        """One request, retried on connection failures only: always when it never reached the server (refused, no
        connection in time), for an idempotent call also when the connection broke; an error answer raises
        ServerError with the server's message."""
        attempt = 0
        while True:
            try:
                response = self._http.request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failure: Exception = exc
            except httpx.TimeoutException as exc:
                raise TimeoutError(f"{what}: no answer from {self.url} within {self.timeout_s:.0f}s") from exc
            except httpx.TransportError as exc:
                if not idempotent:
                    raise ServerUnavailable(f"{what}: the connection to {self.url} broke ({type(exc).__name__}: "
                                            f"{exc}); not retried (the server may have done it)") from exc
                failure = exc
            else:
                if response.status_code != 200:
                    try:
                        detail = response.json().get("error", response.text)
                    except ValueError:
                        detail = response.text or "an empty answer"
                    raise ServerError(what, str(response.status_code), detail)
                return response
            if attempt >= self.retries:
                raise ServerUnavailable(f"{what}: cannot reach {self.url} ({failure}) after {attempt + 1} attempt(s)") \
                    from failure
            attempt += 1
            self._sleep(self.retry_wait_s * attempt)

    def infer(self, model: str, inputs: dict[str, np.ndarray], idempotent: bool = True) -> dict[str, np.ndarray]:
        import tritonclient.http as http  # heavy: tritonclient (its tensor encoding), only once a call is made

        wire = []
        for name, array in inputs.items():
            item = http.InferInput(name, list(array.shape), _DTYPES[array.dtype])
            item.set_data_from_numpy(array)
            wire.append(item)
        body, json_size = http.InferenceServerClient.generate_request_body(wire)
        headers = {"Inference-Header-Content-Length": str(json_size)} if json_size is not None else {}
        response = self.request(model, "POST", f"/v2/models/{quote(model)}/infer", idempotent, content=body,
                                headers=headers)
        length = response.headers.get("Inference-Header-Content-Length")
        result = http.InferenceServerClient.parse_response_body(response.content,
                                                                 header_length=int(length) if length else None)
        return {out["name"]: result.as_numpy(out["name"]) for out in result.get_response()["outputs"]}

    def model_config(self, model: str) -> dict:
        return self.request(model, "GET", f"/v2/models/{quote(model)}/config").json()

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError(f"client of {self.url} is closed")
        future = self._pool.submit(fn, *args)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def drain(self) -> None:
        """Wait until every call submitted so far has finished (successfully or not)."""
        with self._pending_lock:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        self._http.close()

class CriticClient:
    """The critic server over HTTP (critic_infer / critic_train / critic_save); a CriticBackend.

    `combined_reward` is read from critic_infer's model config (whether it has a `rewards` output). Requests larger
    than the server's max_batch_size are split and the answers concatenated.
    """

    def __init__(self, url: str, timeout_s: float = 300.0, connect_timeout_s: float = 10.0, retries: int = 3,
                 max_workers: int = 4, combined_reward: Optional[bool] = None, secret: Optional[str] = None):
        self.url = url
        self._http = TritonHTTP(url, timeout_s, connect_timeout_s, retries, max_workers=max_workers, name="critic",
                                secret=secret)
        self._combined, self._max_batch = combined_reward, None
        self._config_lock = threading.Lock()

    def _load_config(self) -> None:
        with self._config_lock:
            if self._max_batch is None:
                config = self._http.model_config(CRITIC_INFER)
                outputs = {o["name"] for o in config.get("output", [])}
                if self._combined is None:
                    self._combined = "rewards" in outputs
                self._max_batch = int(config.get("max_batch_size", 0)) or 1 << 30

    @property
    def combined_reward(self) -> bool:
        if self._combined is None:
            self._load_config()
        return bool(self._combined)

    def infer(self, tokens, lengths) -> tuple[Tensor, Optional[Tensor]]:
        tokens = _numpy(tokens, np.int64)
        lengths = _numpy(lengths, np.int64).reshape(-1, 1)
        validate_tokens(tokens, lengths)
        self._load_config()
        values, rewards = [], []
        for start in range(0, tokens.shape[0], self._max_batch):
            out = self._http.infer(CRITIC_INFER, {"tokens": tokens[start:start + self._max_batch],
                                                  "sequence_lengths": lengths[start:start + self._max_batch]})
            values.append(out["values"])
            if "rewards" in out:
                rewards.append(out["rewards"].reshape(-1))
        return torch.from_numpy(np.concatenate(values)), torch.from_numpy(np.concatenate(rewards)) if rewards else None

    def infer_async(self, tokens, lengths) -> "Future[tuple[Tensor, Tensor | None]]":
        return self._http.submit(self.infer, tokens, lengths)

    def train(self, tokens, returns, prev_values, mask) -> dict:
        arrays = {"tokens": _numpy(tokens, np.int64), "returns": _numpy(returns, np.float32),
                  "prev_values": _numpy(prev_values, np.float32), "mask": _numpy(mask, np.float32)}
        validate_train(*arrays.values())
        out = self._http.infer(CRITIC_TRAIN, arrays, idempotent=False)
        stats = {name: float(out[name].reshape(-1)[0]) for name in TRAIN_STATS if name in out}
        stats["step"] = int(out["step"].reshape(-1)[0])
        return stats

    def train_async(self, tokens, returns, prev_values, mask) -> "Future[dict]":
        return self._http.submit(self.train, tokens, returns, prev_values, mask)

    def save(self) -> dict:
        """critic_save after every call submitted before it (like the in-process backend's single queue)."""
        self._http.drain()
        out = self._http.infer(CRITIC_SAVE, {"dummy_var": np.zeros(1, dtype=np.int64)})
        path = out["path"].reshape(-1)[0]
        return {"status": int(out["status"].reshape(-1)[0]), "step": int(out["step"].reshape(-1)[0]),
                "path": path.decode() if isinstance(path, bytes) else str(path)}

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "CriticClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RewardClient:
    """A reward server (or a critic server carrying the reward model) over HTTP; a RewardBackend.

    Tokens (`reward_model`): sends `prompt_lengths` (a function reward splits prompt from response with them) unless
    send_prompt_lengths=False; the server decodes tokens itself. Text (`text=True`, `reward_text`): sends the prompt
    and response strings (UTF-8), which the reward model tokenizes with its own tokenizer.
    """

    def __init__(self, url: str, timeout_s: float = 300.0, connect_timeout_s: float = 10.0, retries: int = 3,
                 max_workers: int = 4, send_prompt_lengths: bool = True, text: bool = False,
                 secret: Optional[str] = None):
        self.url, self.send_prompt_lengths, self.text = url, send_prompt_lengths, text
        self._http = TritonHTTP(url, timeout_s, connect_timeout_s, retries, max_workers=max_workers, name="reward",
                                secret=secret)
        self._max_batch: Optional[int] = None
        self._teacher_batch: Optional[int] = None

    def score(self, tokens, lengths, prompt_lengths=None, columns: list[dict] | None = None) -> Tensor | dict:
        tokens = _numpy(tokens, np.int64)
        lengths = _numpy(lengths, np.int64).reshape(-1, 1)
        validate_tokens(tokens, lengths)
        inputs = {"tokens": tokens, "sequence_lengths": lengths, **columns_input(columns, tokens.shape[0])}
        if self.send_prompt_lengths and prompt_lengths is not None:
            inputs["prompt_lengths"] = _numpy(prompt_lengths, np.int64).reshape(-1, 1)
            if inputs["prompt_lengths"].shape != lengths.shape:
                raise CriticInputError(f"prompt_lengths: expected shape {list(lengths.shape)}, "
                                       f"got {list(inputs['prompt_lengths'].shape)}")
        if self._max_batch is None:
            self._max_batch = int(self._http.model_config(REWARD_MODEL).get("max_batch_size", 0)) or 1 << 30
        return self._scores(REWARD_MODEL, inputs, tokens.shape[0])

    def score_text(self, prompts: list[str], responses: list[str], columns: list[dict] | None = None) -> Tensor | dict:
        if len(prompts) != len(responses) or not prompts:
            raise CriticInputError(f"responses: expected as many as prompts (> 0), got {len(responses)} and "
                                   f"{len(prompts)}")
        if self._max_batch is None:
            self._max_batch = int(self._http.model_config(REWARD_TEXT).get("max_batch_size", 0)) or 1 << 30
        inputs = {name: np.array([[s.encode("utf-8")] for s in texts], dtype=np.object_)
                  for name, texts in (("prompts", prompts), ("responses", responses))}
        inputs.update(columns_input(columns, len(prompts)))
        return self._scores(REWARD_TEXT, inputs, len(prompts))

    def _scores(self, model: str, inputs: dict, batch: int) -> Tensor | dict:
        """`model`'s scores of `inputs` in requests of at most max_batch_size rows: the scores [B], or from a server
        of reward functions {"scores": [B], "function_rewards": [B, F]} (each function's scores)."""
        scores, each = [], []
        for start in range(0, batch, self._max_batch):
            out = self._http.infer(model,
                                   {name: array[start:start + self._max_batch] for name, array in inputs.items()})
            scores.append(out["rewards"].reshape(-1))
            if "function_rewards" in out:
                each.append(out["function_rewards"].reshape(len(scores[-1]), -1))
        total = torch.from_numpy(np.concatenate(scores))
        return {"scores": total, "function_rewards": torch.from_numpy(np.concatenate(each))} if each else total

    def score_async(self, tokens, lengths, prompt_lengths=None, prompts=None, responses=None,
                    columns: list[dict] | None = None) -> "Future[Tensor]":
        if self.text:
            return self._http.submit(self.score_text, list(prompts), list(responses), columns)
        return self._http.submit(self.score, tokens, lengths, prompt_lengths, columns)

    def teacher_logprobs(self, tokens, lengths) -> Tensor:
        """On-policy distillation: the teacher's logprobs [B, L-1] of `tokens` (`teacher_logprobs`), in requests of
        at most its max_batch_size rows."""
        tokens = _numpy(tokens, np.int64)
        lengths = _numpy(lengths, np.int64).reshape(-1, 1)
        validate_tokens(tokens, lengths)
        if self._teacher_batch is None:
            self._teacher_batch = int(self._http.model_config(TEACHER_LOGPROBS).get("max_batch_size", 0)) or 1 << 30
        parts = [self._http.infer(TEACHER_LOGPROBS, {"tokens": tokens[start:start + self._teacher_batch],
                                                     "sequence_lengths": lengths[start:start + self._teacher_batch]})
                 ["logprobs"] for start in range(0, tokens.shape[0], self._teacher_batch)]
        return torch.from_numpy(np.concatenate(parts).reshape(tokens.shape[0], -1))

    def teacher_logprobs_async(self, tokens, lengths) -> "Future[Tensor]":
        return self._http.submit(self.teacher_logprobs, tokens, lengths)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def columns_input(columns: list[dict] | None, batch: int) -> dict:
    """The optional `columns` input of reward_model / reward_text: each row's data set columns as a JSON object,
    BYTES [B,1]; nothing when no row has a column (an old server, or a client that sends none, still works)."""
    if not columns or not any(columns):
        return {}
    if len(columns) != batch:
        raise CriticInputError(f"columns: expected {batch} rows, got {len(columns)}")
    return {"columns": np.array([[json.dumps(c, default=str).encode("utf-8")] for c in columns], dtype=np.object_)}


def critic_backend(cfg, url: Optional[str] = None, **kwargs) -> CriticClient:
    """A CriticClient for an RLHFConfig: the local server's address unless `url` is given."""
    url = url or f"http://{cfg.deploy.critic.host}:{cfg.deploy.critic.port or 8400}"
    return CriticClient(url, timeout_s=cfg.deploy.critic.request_timeout_s, **kwargs)


def reward_backend(cfg, url: Optional[str] = None, **kwargs) -> RewardClient:
    """A RewardClient for an RLHFConfig: the local reward server's address unless `url` is given."""
    url = url or f"http://{cfg.deploy.reward.host}:{cfg.deploy.reward.port or 8500}"
    kwargs.setdefault("text", cfg.reward.transport == "text")
    return RewardClient(url, timeout_s=cfg.deploy.reward.request_timeout_s, **kwargs)
