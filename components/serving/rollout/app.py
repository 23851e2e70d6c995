"""The rollout server's app: vLLM's own engine (`vllm.LLM`, in this process) behind a small FastAPI app.

Why our own FastAPI app around `vllm.LLM`, and not vLLM's OpenAI server with a worker extension: a trainer needs
generate-from-token-ids with the sampled distribution's logprobs, an in-place weight update that clears the prefix
cache, and a weights version on every answer. With `LLM` in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) all three
are direct calls, one lock orders updates and generations, and no request is answered by a half-updated engine.

The server owns the weights version and knows which run it serves. The version starts at 0 (the checkpoint it
loaded) and moves by one with each weight update, never on a failed one; the first weight update (or transfer set-up)
binds the server to that request's run token, and from then on a request of another run is refused (409, naming
both), as is an update whose version is not the next one. Two trainers on one server (a retried flow whose old actor
still runs, a shared deployment) cannot both pass.

Weights arrive two ways (the trainer's `rollout.vllm.weight_transfer`), both in the actor's Hugging Face names with a
tied lm_head included (without it vLLM silently keeps the old head):
- `http`: POST /update_weights with a safetensors file as the body, read as it arrives: its header is checked, then
  each tensor is read into a buffer of its own and loaded at once (the body is never held whole);
- `dist`: vLLM's own weight-transfer API (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
  `finish_weight_update`) with a backend of ours registered in its factory: a torch.distributed group of two (gloo on
  CPU, NCCL where the engine is on a GPU) with actor rank 0, which broadcasts the tensors one at a time; each is loaded
  as it arrives (vLLM's own backends need CUDA on both ends and vLLM on the trainer's side, which has none). The group
  admits the run's processes only (the run's secret signs its store and every member proves it: group.py), and
  every tensor received is checked against the sha256 the trainer sends after them (POST /weights/digests) before
  the update counts: a tensor that differs refuses the update (400 naming it; the version does not move and the
  weights are broken until a full update, as after any failed update).

Generations and weight updates take one lock: an update waits for the generation in
flight (the offline `LLM` cannot pause one; AsyncLLM's pause/resume would interrupt it, but the actor needs those
samples anyway) and the ones after it sample with the new weights. Every answer stamps the version a generation
started with, and the engine's idle seconds so far (neither generating nor loading weights).

Who may call, and how much (components/serving/auth.py says the same for the whole run):
- the secret reaches this process through $RLHF_RUN_SECRET or the file $RLHF_RUN_SECRET_FILE names, never its
  command line (a server given none refuses to start), and never crosses the wire (components/handshake.py): GET
  /rlhf/proof proves this server to a client before the client sends anything; every endpoint but GET /health and
  the proof needs a request signed with the run's key (401 unsigned, 403 signed otherwise or sent before). /health
  shows no run token.
- a body is refused (413) from its Content-Length before it is read: a JSON body over --max-body-mib, a weight upload
  over the model's own size; a POST without Content-Length is refused (411); at most --max-in-flight of the run's
  requests at once (503 beyond). Connections are not counted against the run (components/serving/connections.py):
  idle ones close after --idle-s, and past --max-connections the longest idle one goes, so no number of idle or slow
  connections keeps the run's requests or /health from an answer. /generate takes at most --max-request-sequences
  prompts x n and --max-request-tokens prompts x n x max_new_tokens.
- an upload that stops sending (a dropped connection, a stalled client) ends its reader: on disconnect at once, on
  silence after --body-timeout-s; the engine's lock and worker threads are never held by a gone client.
- POST /weights/init connects only to the trainer address this server was started with (--trainer-host), with a
  bounded connect timeout, and without holding the generation lock while it connects.

Endpoints:
  GET  /health             200 with model, weights version, whether a run is bound, vocabulary size, max model
                           length, idle seconds; 503 while the weights are broken (a failed update), with why
  POST /generate           token ids in; per prompt n samples: token ids, per-token logprobs, whether each ended; the
                           weights version it sampled with
  POST /update_weights     ?version=<next>&run=<token>, body: a safetensors file of the full state dict
  POST /weights/init       {run, master_address, master_port, backend, timeout_s}: join the trainer's group
  POST /weights/update     {run, version, names, dtype_names, shapes}: receive the tensors over that group
  POST /weights/digests    {run, version, ready_key, digests}: the sha256 of each tensor of the update in progress
  GET /v1/models, POST /v1/chat/completions(/tokens), /tokenize, /inference/v1/generate: what environments use
                           (components/serving/rollout/openai.py, vLLM's own shapes)
Bad input is a 4xx whose body names the field (`detail`), and the server keeps serving.

Runs in .venv-vllm: imports nothing from the project but this package and models/rendezvous.py (components/serving/
rollout/__init__.py); started by main.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.exceptions import VLLMClientError

from components.serving.connections import InFlight
from components.serving.rollout.body import BodyReader, safetensors_header
from components.serving.rollout.openai import add_openai_endpoints, client_error, error_body, is_openai_path
from components.serving.rollout.weights import TRANSFER_BACKEND, received_digests
from components.handshake import CHALLENGE_HEADER, PROOF_PATH, SCHEME, RunKeys, Verifier, answer_proof

log = logging.getLogger("rlhf.rollout_server")

WIRE_DTYPES = {"float32", "float16", "bfloat16", "float64"}
OPEN_PATHS = {("GET", "/health")}  # liveness/readiness: no secret needed


# ---------------------------------------------------------------- requests

class GenerateRequest(BaseModel):
    """One batch of prompts; every prompt gets `n` samples drawn with the same sampling settings."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[list[int]] = Field(min_length=1,
                                              description="Prompts as token ids, one list per prompt (no padding).")
    n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0,
                               description="Sampling temperature (logprobs are of the tempered distribution); 0 = "
                                           "greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (1.0 disables).")
    max_new_tokens: int = Field(16, ge=1, description="Longest response in tokens.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end a response (kept in it).")
    seed: Optional[int] = Field(None, ge=0,
                                description="Seed of this request's sampling: sample j of prompt i uses seed + i * n + "
                                            "j (every sample its own stream).")
    expected_version: Optional[int] = Field(None,
                                            description="Refuse (409) unless the engine holds this weights version.")
    run: str = Field(min_length=1,
                     description="The caller's run token: refused (409) when the server is bound to another run.")


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(min_length=1, description="The caller's run token (binds an unbound server).")
    master_address: str = Field(description="Host of the trainer's TCPStore (the trainer is rank 0 of the group): the "
                                            "trainer address this server was started with (--trainer-host), nothing "
                                            "else.")
    master_port: int = Field(ge=1, le=65535, description="Port of the trainer's TCPStore.")
    backend: str = Field("gloo", pattern="^(gloo|nccl)$", description="torch.distributed backend of the group.")
    timeout_s: float = Field(600.0, gt=0, le=3600,
                             description="How long a collective of the group may wait (joining the store: at most "
                                         "30 s).")
    world_size: int = Field(2, ge=2,
                            description="The group's size: the trainer and this server's workers (1 + "
                                        "tensor_parallel_size).")


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(min_length=1, description="The caller's run token.")
    version: int = Field(ge=1, description="The version this update makes: the server's current one + 1.")
    names: list[str] = Field(description="Tensor names (the actor's Hugging Face names), in broadcast order.")
    dtype_names: list[str] = Field(description="torch dtype name of each tensor.")
    shapes: list[list[int]] = Field(description="Shape of each tensor.")


class DigestsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str = Field(min_length=1, description="The caller's run token.")
    version: int = Field(ge=1, description="The version of the update in progress these digests are for.")
    ready_key: str = Field(min_length=1, description="The update's ready_key (POST /weights/update).")
    digests: list[str] = Field(description="sha256 (hex) of each tensor's bytes, in broadcast order.")


# ---------------------------------------------------------------- the served model

class ServedModel:
    """vllm.LLM with the server's state: the weights version, the run it serves, whether the weights are broken. One
    lock orders generations and weight updates."""

    def __init__(self, model: str, dtype: str, max_model_len: Optional[int], seed: int, enforce_eager: bool,
                 gpu_memory_utilization: float, instance: str = "", trainer_host: str = "127.0.0.1",
                 max_sequences: int = 4096, max_tokens: int = 1 << 23, tensor_parallel_size: int = 1):
        self.instance = instance  # the launcher's nonce, echoed by /health: it knows it reached its own server
        self.trainer_host = trainer_host  # the one address a weight-transfer group is set up with
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.broken: Optional[str] = None  # why the weights are inconsistent (a failed update), until the next one
        self.run: Optional[str] = None  # the run this server serves, bound by its first weight update
        self.model_dir = model
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                       tensor_parallel_size=tensor_parallel_size,
                       enable_prefix_caching=True, weight_transfer_config={"backend": TRANSFER_BACKEND})
        config = self.llm.llm_engine.model_config
        self.vocab_size = config.get_vocab_size()
        self.max_model_len = config.max_model_len
        self.shapes = checkpoint_shapes(Path(model))
        hf = config.hf_config
        if getattr(hf, "tie_word_embeddings", False):
            # save_pretrained leaves a tied head out of the checkpoint, but an update must carry it: without it the
            # engine keeps its old head (verified on CPU, ../shared/ENVIRONMENT.md)
            self.shapes["lm_head.weight"] = [hf.vocab_size, hf.hidden_size]
        self.version = 0
        self.group_ready = False
        self.group_timeout_s = 600.0  # how long an update waits for the trainer's digests (the group's timeout)
        self.digests: dict[str, tuple[str, int, Future]] = {}  # ready_key -> (run, version, the trainer's digests)
        self.lock = threading.Lock()
        self.init_lock = threading.Lock()  # one transfer set-up at a time; never the generation lock while connecting
        self.started, self.busy_s = time.monotonic(), 0.0  # the engine's busy time (generating, loading weights)
        self.tool_stats: Counter = Counter()  # chat completions with tools: parsed calls, none, malformed markup

    def describe(self) -> dict:
        return {"status": "broken" if self.broken else "ok", "model": self.model_dir, "weights_version": self.version,
                "bound": self.run is not None, "instance": self.instance, "vocab_size": self.vocab_size,
                "tensor_parallel_size": self.tensor_parallel_size,
                "max_model_len": self.max_model_len, "broken": self.broken, "idle_s": self.idle_s(),
                "tool_calls": {k: self.tool_stats[k] for k in ("parsed", "none", "malformed")}}

    def idle_s(self) -> float:
        """Seconds since the engine loaded during which it neither generated nor loaded weights (cumulative: a
        client takes differences)."""
        return time.monotonic() - self.started - self.busy_s

    @contextmanager
    def busy(self):
        started = time.monotonic()
        try:
            yield
        finally:
            self.busy_s += time.monotonic() - started

    # -- checks
    def check_run(self, run: str, field: str = "run") -> None:
        """Refuse a request of another run than the one this server serves (409, naming both)."""
        if self.run is not None and run != self.run:
            raise HTTPException(409, f"{field}: this rollout server serves run {self.run!r}, not {run!r}: a server "
                                     f"takes the weights and requests of one run only")

    def check_update(self, run: str, version: int) -> None:
        self.check_run(run)
        if version != self.version + 1:
            raise HTTPException(409, f"version: the server holds weights version {self.version}; an update makes "
                                     f"version {self.version + 1}, not {version} (run {run!r})")

    def check_tensors(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> None:
        missing, unknown = sorted(self.shapes.keys() - set(names)), sorted(set(names) - self.shapes.keys())
        if missing or unknown or len(names) != len(set(names)):
            raise HTTPException(400, "names: the full state dict is expected under the checkpoint's names, once each"
                                     + (f"; missing {missing[:5]}" if missing else "")
                                     + (f"; unknown {unknown[:5]}" if unknown else ""))
        for name, shape, dtype in zip(names, shapes, dtypes):
            if list(shape) != list(self.shapes[name]):
                raise HTTPException(400, f"shapes: {name} has shape {list(shape)}, the model's is {self.shapes[name]}")
            if dtype not in WIRE_DTYPES:
                raise HTTPException(400,
                                    f"dtype_names: {name} has dtype {dtype}, expected one of {sorted(WIRE_DTYPES)}")

    @property
    def max_upload_bytes(self) -> int:
        """The largest body POST /update_weights may have: a safetensors file of the model's tensors at 8 bytes an
        element (F64), with a header of their names."""
        header = 4096 + sum(len(name) + 160 for name in self.shapes)
        return 8 + header + 8 * sum(torch.Size(shape).numel() for shape in self.shapes.values())

    # -- generation
    def check_size(self, req: GenerateRequest) -> None:
        """Refuse (400) a request over the server's caps, naming the fields, before anything is sampled."""
        sequences = len(req.prompt_token_ids) * req.n
        if sequences > self.max_sequences:
            raise HTTPException(400, f"prompt_token_ids, n: {len(req.prompt_token_ids)} prompts x n={req.n} = "
                                     f"{sequences} sequences exceed this server's cap of {self.max_sequences} "
                                     f"(deploy.rollout.max_request_sequences)")
        if sequences * req.max_new_tokens > self.max_tokens:
            raise HTTPException(400, f"prompt_token_ids, n, max_new_tokens: {sequences} sequences x "
                                     f"{req.max_new_tokens} new tokens = {sequences * req.max_new_tokens} exceed this "
                                     f"server's cap of {self.max_tokens} (deploy.rollout.max_request_tokens)")

    def generate(self, req: GenerateRequest) -> dict:
        self.check_size(req)
        for i, ids in enumerate(req.prompt_token_ids):
            if not ids:
                raise HTTPException(400, f"prompt_token_ids[{i}]: a prompt needs at least one token")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise HTTPException(400, f"prompt_token_ids[{i}]: token id {bad[0]} is outside the vocabulary "
                                         f"[0, {self.vocab_size})")
            if len(ids) + req.max_new_tokens > self.max_model_len:
                raise HTTPException(400, f"prompt_token_ids[{i}]: {len(ids)} prompt tokens + max_new_tokens "
                                         f"{req.max_new_tokens} exceed max_model_len {self.max_model_len}")
        bad_stop = [t for t in req.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise HTTPException(400,
                                f"stop_token_ids: token id {bad_stop[0]} is outside the vocabulary [0, "
                                f"{self.vocab_size})")
        # one SamplingParams per prompt: vLLM seeds sample j of a request with seed + j, so one seed for all prompts
        # would give sample j of every prompt the same random stream (correlated samples across the batch)
        params = [SamplingParams(n=req.n, temperature=req.temperature, top_k=req.top_k or -1, top_p=req.top_p,
                                 max_tokens=req.max_new_tokens, stop_token_ids=req.stop_token_ids, logprobs=0,
                                 seed=None if req.seed is None else req.seed + i * req.n, detokenize=False)
                  for i in range(len(req.prompt_token_ids))]
        outputs, version = self.sample(req.prompt_token_ids, params, run=req.run, expected_version=req.expected_version)
        samples = []
        for out in outputs:
            rows = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                logprobs = [step[t].logprob for step, t in zip(c.logprobs, ids)]
                rows.append({"token_ids": ids, "logprobs": logprobs, "is_end": c.finish_reason == "stop"})
            samples.append(rows)
        return {"weights_version": version, "samples": samples, "idle_s": self.idle_s()}

    def sample(self, prompts: list[list[int]], params, run: Optional[str] = None,
               expected_version: Optional[int] = None, salt: Optional[str] = None) -> tuple[list, int]:
        """Generate from token-id prompts under the lock (one `SamplingParams` each, or one for all): vLLM's outputs
        and the weights version they were sampled with. A refit waits for a generation in flight, and a request that
        arrives during a refit waits for it. Every prompt's prefix-cache blocks are salted with the weights version
        (vLLM's `cache_salt`): besides the cache reset of every refit, no request can be served KV blocks computed
        with other weights."""
        with self.lock:
            if run is not None:
                self.check_run(run)
            if self.broken:
                raise HTTPException(503, f"weights: inconsistent after a failed update ({self.broken}); send a full "
                                         f"update before generating")
            if expected_version is not None and expected_version != self.version:
                raise HTTPException(409, f"expected_version: the engine holds weights version {self.version}, "
                                         f"not {expected_version}")
            version = self.version  # stamped when the generation starts: the weights it samples with
            cache_salt = f"{salt or ''}|weights-v{version}"
            engine_prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=cache_salt) for ids in prompts]
            with self.busy():
                outputs = self.llm.generate(engine_prompts, params, use_tqdm=False)
        return outputs, version

    # -- weights
    def _apply(self, run: str, version: int, load) -> dict:
        """Run `load()` (it puts the new weights into vLLM) as update `version` of `run`, under the lock; a failure
        marks the weights broken (some may be new, some old) and leaves the version where it was."""
        started = time.perf_counter()
        with self.lock:
            waited = time.perf_counter() - started  # for generations in flight: an update waits for them
            self.check_update(run, version)
            try:
                with self.busy():
                    load()
                if not self.llm.reset_prefix_cache():  # mandatory: cached KV of the old weights would be reused
                    raise RuntimeError("the prefix cache could not be reset")
            except Exception as exc:
                why = exc.detail if isinstance(exc, HTTPException) else f"{type(exc).__name__}: {exc}"
                self.broken = f"update to version {version} failed: {why}"
                log.exception(self.broken)
                raise HTTPException(exc.status_code if isinstance(exc, HTTPException) else 500,
                                    f"weights: {self.broken}") from None
            self.run, self.version, self.broken = run, version, None
        log.info(f"weights version {version} applied in {time.perf_counter() - started:.2f}s")
        return {"weights_version": version, "run": run, "seconds": time.perf_counter() - started, "lock_wait_s": waited,
                "idle_s": self.idle_s()}

    def update_http(self, body: "BodyReader", version: int, run: str) -> dict:
        """A safetensors file read from the request body as it arrives: the header first (checked against the
        model before anything loads), then each tensor into a buffer of its own, handed to vLLM at once."""
        try:
            header = safetensors_header(body)
            self.check_tensors([name for name, _, _ in header], [shape for _, _, shape in header],
                               [str(dtype).removeprefix("torch.") for _, dtype, _ in header])

            def arriving():
                for name, dtype, shape in header:
                    tensor = torch.empty(shape, dtype=dtype)
                    body.read_into(tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else bytearray())
                    yield name, tensor

            def load():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": arriving(),
                                                                  "is_checkpoint_format": True})
                body.read_end()
            return self._apply(run, version, load)
        finally:
            body.close()  # whatever was not read is dropped: the request's reader never blocks on us

    def init_group(self, req: InitRequest) -> dict:
        """Join the trainer's group: only at the address this server was given, one set-up at a time, and without the
        generation lock while connecting (a trainer that never answers costs its own request, bounded, nothing
        else)."""
        if req.world_size != 1 + self.tensor_parallel_size:
            raise HTTPException(400, f"world_size: this server's weight-transfer group is the trainer and its "
                                     f"{self.tensor_parallel_size} worker(s): {1 + self.tensor_parallel_size}, not "
                                     f"{req.world_size}")
        if req.master_address != self.trainer_host:
            raise HTTPException(403, f"master_address: this server sets up weight transfers with its trainer at "
                                     f"{self.trainer_host!r} only, not {req.master_address!r}")
        self.check_run(req.run)
        if not self.init_lock.acquire(blocking=False):
            raise HTTPException(409, "weights/init: another transfer set-up is in progress")
        try:
            try:
                self.llm.collective_rpc("init_weight_transfer_engine", args=(
                    {"master_address": req.master_address, "master_port": req.master_port, "backend": req.backend,
                     "timeout_s": req.timeout_s, "world_size": req.world_size},))
            except Exception as exc:  # noqa: BLE001 - the trainer's store did not answer: its request fails, we serve on
                raise HTTPException(502, f"master_address: cannot join the trainer's group at {req.master_address}:"
                                         f"{req.master_port} ({type(exc).__name__}: {exc})") from None
            with self.lock:
                self.check_run(req.run)  # another run may have bound the server meanwhile
                self.run, self.group_ready, self.group_timeout_s = req.run, True, req.timeout_s
        finally:
            self.init_lock.release()
        return {"run": self.run, "weights_version": self.version}

    def update_group(self, req: UpdateRequest, ready_key: str) -> dict:
        """Receive the tensors of `req` over the transfer group; the trainer starts broadcasting once this server
        has checked the request, holds the lock and receives (it sets `ready_key` in the trainer's store). The update
        counts once every tensor every worker received matches the trainer's digests (`take_digests`)."""
        if not (len(req.names) == len(req.dtype_names) == len(req.shapes)):
            raise HTTPException(400, f"names, dtype_names, shapes: {len(req.names)}, {len(req.dtype_names)} and "
                                     f"{len(req.shapes)} entries; one each per tensor")
        self.check_tensors(req.names, req.shapes, req.dtype_names)
        if not self.group_ready:
            raise HTTPException(409, "weights/update: no transfer group; POST /weights/init first")
        if ready_key in self.digests:
            raise HTTPException(409, f"ready_key: an update with key {ready_key!r} is in progress")
        expected: Future = Future()
        self.digests[ready_key] = (req.run, req.version, expected)

        def load():
            self.llm.collective_rpc("start_weight_update")
            try:
                self.llm.collective_rpc("update_weights", args=(
                    {"names": req.names, "dtype_names": req.dtype_names, "shapes": req.shapes,
                     "ready_key": ready_key},))
                try:
                    digests = expected.result(timeout=self.group_timeout_s)
                except FutureTimeout:
                    raise HTTPException(408, f"digests: the trainer sent no digests for update {req.version} within "
                                             f"{self.group_timeout_s:.0f}s of its last tensor") from None
                for worker, received in enumerate(self.llm.collective_rpc(received_digests)):
                    check_digests(req.names, digests, received, worker)
            finally:
                self.llm.collective_rpc("finish_weight_update")
        try:
            return self._apply(req.run, req.version, load)
        finally:
            self.digests.pop(ready_key, None)

    def take_digests(self, req: DigestsRequest) -> dict:
        """The trainer's digests of the update in progress under `req.ready_key`, handed to it."""
        pending = self.digests.get(req.ready_key)
        if pending is None or pending[2].done():
            raise HTTPException(409, f"ready_key: no weight update waits for digests under {req.ready_key!r}")
        run, version, expected = pending
        if (req.run, req.version) != (run, version):
            raise HTTPException(409, f"run, version: the update in progress under this key is version {version} of "
                                     f"run {run!r}, not version {req.version} of {req.run!r}")
        expected.set_result(req.digests)
        return {"digests": len(req.digests)}


def check_digests(names: list[str], expected: list[str], received: list[str], worker: int = 0) -> None:
    """Refuse (400, naming the first tensor) an update whose received tensors are not those the trainer sent."""
    if len(expected) != len(names):
        raise HTTPException(400, f"digests: {len(expected)} for {len(names)} tensors; one sha256 per tensor")
    if len(received) != len(names):
        raise HTTPException(400, f"digests: worker {worker} received {len(received)} of {len(names)} tensors")
    for name, sent, got in zip(names, expected, received):
        if not hmac.compare_digest(sent.lower(), got):
            raise HTTPException(400, f"digests: tensor {name} arrived with sha256 {got[:16]}..., the trainer sent "
                                     f"{sent[:16]}... (worker {worker}): the update is refused (its bytes changed "
                                     f"between the trainer and this server)")


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """The tensor names and shapes of a Hugging Face checkpoint directory (safetensors, sharded or not), read from
    the files' headers."""
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({name: list(f.get_slice(name).get_shape()) for name in f.keys()})
    if not shapes:
        raise FileNotFoundError(f"--model: no safetensors weights in {model_dir}")
    return shapes


class Guard:
    """ASGI middleware in front of every endpoint: GET /health and GET /rlhf/proof (the server's proof of the run's
    secret, components/handshake.py) answer anyone; every other request must be signed with the run's key (401
    unsigned, 403 signed otherwise or sent before: wire.Verifier), and is refused from its Content-Length before a
    byte of its body is read (411 without one, 413 over the limit: `max_body` for JSON, the model's own size for
    /update_weights); at most `max_in_flight` of the run's requests are served at once (503 beyond)."""

    def __init__(self, app, secret: str, max_body: int, max_upload: int, max_in_flight: int = 64):
        self.app, self.max_body, self.max_upload = app, max_body, max_upload
        self.keys = RunKeys(secret)
        self.verifier = Verifier(self.keys)
        self.in_flight = InFlight(max_in_flight)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if (scope["method"], scope["path"]) == ("GET", PROOF_PATH):
            challenge = headers.get(CHALLENGE_HEADER.encode(), b"").decode("latin-1")
            status, extra, detail = answer_proof(self.keys, "rollout", challenge)
            return await _answer(send, scope["path"], status, detail,
                                 {k.encode(): v.encode() for k, v in extra.items()})
        refused = self.verifier.check(scope["method"], scope["path"],
                                      headers.get(b"authorization", b"").decode("latin-1") or None)
        if refused:
            status, detail = refused
            return await _answer(send, scope["path"], status, detail,
                                 {b"www-authenticate": SCHEME.encode()} if status == 401 else None)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length")
            if length is None or not length.isdigit():
                return await _answer(send, scope["path"], 411, "content-length: required (a body of known size)")
            limit = self.max_upload if scope["path"] == "/update_weights" else self.max_body
            if int(length) > limit:
                what = "the model's weights" if scope["path"] == "/update_weights" else "deploy.rollout.max_body_mib"
                return await _answer(send, scope["path"], 413,
                                     f"content-length: {int(length)} bytes exceed this endpoint's limit "
                                                f"of {limit} ({what})")
        if not self.in_flight.enter():
            return await _answer(send, scope["path"], 503, f"busy: {self.in_flight.limit} of the run's requests are "
                                                           f"in flight (--max-in-flight); try again",
                                 {b"retry-after": b"1"})
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight.leave()


async def _answer(send, path: str, status: int, detail: str, headers: Optional[dict] = None) -> None:
    body = json.dumps(error_body(status, detail) if is_openai_path(path) else {"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or {}).items()]})
    await send({"type": "http.response.body", "body": body})


def build_app(served: ServedModel, secret: str, max_body: int = 32 << 20, body_timeout_s: float = 60.0,
              max_in_flight: int = 64) -> FastAPI:
    app = FastAPI(title="rlhf-flows rollout server")

    @app.get("/health")
    def health():
        return JSONResponse(served.describe(), status_code=503 if served.broken else 200)

    @app.post("/generate")
    def generate(req: GenerateRequest) -> dict:
        return served.generate(req)

    @app.post("/update_weights")
    async def update_weights(request: Request, version: int = Query(..., ge=1),
                             run: str = Query(..., min_length=1)) -> dict:
        served.check_update(run, version)  # before reading the body
        if served.tensor_parallel_size > 1:
            raise HTTPException(409, f"update_weights: this server's model is sharded over "
                                     f"{served.tensor_parallel_size} GPU workers, which an HTTP body does not reach: "
                                     f"its weights come over POST /weights/init and /weights/update")
        body = BodyReader(int(request.headers["content-length"]), timeout_s=body_timeout_s)  # Guard checked it
        # the engine reads and loads the tensors as they arrive, in a thread: /health keeps answering meanwhile
        applied = asyncio.ensure_future(run_in_threadpool(served.update_http, body, version, run))
        try:
            async for chunk in request.stream():
                if chunk and not body.closed:
                    await body.feed(chunk)
            await body.feed(None)
        except ClientDisconnect:
            body.abort("the client disconnected")  # the reader ends now, not after body_timeout_s
        except BaseException:
            body.abort("the request was cancelled")
            raise
        return await applied

    @app.post("/weights/init")
    def init(req: InitRequest) -> dict:
        return served.init_group(req)

    @app.post("/weights/update")
    def update(req: UpdateRequest, ready_key: str = Query(..., min_length=1)) -> dict:
        return served.update_group(req, ready_key)

    @app.post("/weights/digests")
    def digests(req: DigestsRequest) -> dict:
        return served.take_digests(req)

    def refusal(request: Request, status: int, detail, headers: Optional[dict] = None) -> JSONResponse:
        body = error_body(status, str(detail)) if is_openai_path(request.url.path) else {"detail": detail}
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def named(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Every refusal names what it refuses: FastAPI's own for a body that is not JSON says `body:` too."""
        detail = exc.detail
        if isinstance(detail, str) and detail.startswith("There was an error parsing the body"):
            detail = f"body: not valid JSON ({detail})"
        return refusal(request, exc.status_code, detail, getattr(exc, "headers", None))

    @app.exception_handler(VLLMClientError)
    async def refused_by_vllm(request: Request, exc: VLLMClientError) -> JSONResponse:
        """vLLM's own checks of a request (SamplingParams, its request models' validators): a 4xx naming the field,
        not a 500 (`temperature` over 2 on /generate, both `add_generation_prompt` and `continue_final_message` on
        /tokenize)."""
        return refusal(request, *client_error(exc))

    add_openai_endpoints(app, served)

    app.add_middleware(Guard, secret=secret, max_body=max_body, max_upload=served.max_upload_bytes,
                       max_in_flight=max_in_flight)
    return app

