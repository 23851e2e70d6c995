"""The vLLM rollout server: vLLM's own engine behind a small FastAPI app (uvicorn), run in its own environment.

It runs in `.venv-vllm` (Makefile `vllm-venv`), never in the project's: vLLM needs numpy >= 2, PyTriton pins numpy < 2.
So this module imports nothing from the project. On a cluster it is its own pod, from an image with `vllm`.

Why our own FastAPI app around `vllm.LLM`, and not vLLM's OpenAI server with a worker extension: the three things a
trainer needs are generate-from-token-ids with the sampled distribution's logprobs, an in-place weight update that
clears the prefix cache, and a weights version on every answer. With `LLM` in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) all three are direct calls: the new tensors go straight to
`collective_rpc("reload_weights")` (the update path verified on CPU, see ../shared/ENVIRONMENT.md), one lock orders
updates and generations, and no request can be answered by a half-updated engine. The OpenAI server runs its engine
in another process, where tensors do not survive `collective_rpc`, and its endpoints speak text completions.

Endpoints:
  GET  /health          200 once the engine is loaded: model, weights version, vocabulary size, max model length
  POST /generate        token ids in; per prompt n samples: token ids, per-token logprobs, whether each ended
  POST /update_weights  body: a safetensors file of the FULL state dict (HF names, tied lm_head included);
                        query: version=<int>; the prefix cache is cleared; answers the version and the seconds taken
Bad input is a 4xx whose body names the field (`detail`), and the server keeps serving.

Start: python -m components.serving.rollout_server --model DIR --port P [--dtype ... --max-model-len ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Optional

# in-process engine (tensors reach the model directly) and quiet start-up; set before vllm is imported
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import uvicorn  # noqa: E402
from fastapi import FastAPI, HTTPException, Query, Request  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load  # noqa: E402
from starlette.concurrency import run_in_threadpool  # noqa: E402
from vllm import LLM, SamplingParams, TokensPrompt  # noqa: E402

log = logging.getLogger("rlhf.rollout_server")


class GenerateRequest(BaseModel):
    """One batch of prompts; every prompt gets `n` samples drawn with the same sampling settings."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[list[int]] = Field(min_length=1, description="Prompts as token ids, one list per prompt (no padding).")
    n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (logprobs are of the tempered distribution); 0 = greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 disables).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass (1.0 disables).")
    max_new_tokens: int = Field(16, ge=1, description="Longest response in tokens.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Token ids that end a response (kept in it).")
    seed: Optional[int] = Field(None, ge=0, description="Seed of this request's sampling: sample j of prompt i uses seed + i * n + j (every sample its own stream).")
    expected_version: Optional[int] = Field(None, description="Refuse (409) unless the engine holds this weights version.")


class Engine:
    """vllm.LLM plus the checks and the weights version; one lock orders generations and weight updates."""

    def __init__(self, model: str, dtype: str, max_model_len: Optional[int], seed: int, enforce_eager: bool,
                 gpu_memory_utilization: float, initial_version: int, instance: str = ""):
        self.instance = instance  # the launcher's token, echoed by /health: it knows it reached its own server
        self.broken: Optional[str] = None  # why the weights are inconsistent (a failed update), until the next one
        self.model_dir = model
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                       gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                       enable_prefix_caching=True)
        config = self.llm.llm_engine.model_config
        self.vocab_size = config.get_vocab_size()
        self.max_model_len = config.max_model_len
        self.weight_names = checkpoint_names(Path(model))
        if getattr(config.hf_config, "tie_word_embeddings", False):
            # save_pretrained leaves a tied head out of the checkpoint, but an update must carry it: without it the
            # engine keeps its old head (verified on CPU, ../shared/ENVIRONMENT.md)
            self.weight_names.add("lm_head.weight")
        self.version = initial_version
        self.lock = threading.Lock()

    def describe(self) -> dict:
        return {"status": "ok", "model": self.model_dir, "weights_version": self.version, "instance": self.instance,
                "vocab_size": self.vocab_size, "max_model_len": self.max_model_len, "broken": self.broken}

    def generate(self, req: GenerateRequest) -> dict:
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
            raise HTTPException(400, f"stop_token_ids: token id {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})")
        # one SamplingParams per prompt: vLLM seeds sample j of a request with seed + j, so one seed for all prompts
        # would give sample j of every prompt the same random stream (correlated samples across the batch)
        params = [SamplingParams(n=req.n, temperature=req.temperature, top_k=req.top_k or -1, top_p=req.top_p,
                                 max_tokens=req.max_new_tokens, stop_token_ids=req.stop_token_ids, logprobs=0,
                                 seed=None if req.seed is None else req.seed + i * req.n, detokenize=False)
                  for i in range(len(req.prompt_token_ids))]
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req.prompt_token_ids]
        with self.lock:
            if self.broken:
                raise HTTPException(503, f"weights: inconsistent after a failed update ({self.broken}); send a full "
                                         f"update before generating")
            if req.expected_version is not None and req.expected_version != self.version:
                raise HTTPException(409, f"expected_version: the engine holds weights version {self.version}, "
                                         f"not {req.expected_version}")
            version = self.version
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for out in outputs:
            rows = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                logprobs = [step[t].logprob for step, t in zip(c.logprobs, ids)]
                rows.append({"token_ids": ids, "logprobs": logprobs, "is_end": c.finish_reason == "stop"})
            samples.append(rows)
        return {"weights_version": version, "samples": samples}

    def update_weights(self, body: bytes, version: int) -> dict:
        try:
            weights = load(body)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
            raise HTTPException(400, f"body: not a safetensors file ({exc})") from None
        missing = sorted(self.weight_names - weights.keys())
        unknown = sorted(weights.keys() - self.weight_names)
        if missing or unknown:
            raise HTTPException(400, "body: the full state dict is expected under the checkpoint's names"
                                     + (f"; missing {missing[:5]}" if missing else "")
                                     + (f"; unknown {unknown[:5]}" if unknown else ""))
        started = time.perf_counter()
        with self.lock:
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items()),
                                                                  "is_checkpoint_format": True})
                del weights
                if not self.llm.reset_prefix_cache():  # mandatory: cached KV of the old weights would be reused
                    raise RuntimeError("the prefix cache could not be reset")
            except Exception as exc:  # noqa: BLE001 - some weights may be new, some old: refuse to sample
                self.broken = f"update to version {version} failed: {type(exc).__name__}: {exc}"
                log.exception(self.broken)
                raise HTTPException(500, f"body: {self.broken}") from None
            self.version, self.broken = version, None
        return {"weights_version": version, "seconds": time.perf_counter() - started}


def checkpoint_names(model_dir: Path) -> set[str]:
    """The tensor names of a Hugging Face checkpoint directory (safetensors, sharded or not), without reading them."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    if not names:
        raise FileNotFoundError(f"--model: no safetensors weights in {model_dir}")
    return names


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="rlhf-flows rollout server")

    @app.get("/health")
    def health() -> dict:
        return engine.describe()

    @app.post("/generate")
    def generate(req: GenerateRequest) -> dict:
        return engine.generate(req)

    @app.post("/update_weights")
    async def update_weights(request: Request, version: int = Query(..., ge=0)) -> dict:
        body = await request.body()
        # the engine call blocks for seconds: off the event loop, so /health keeps answering
        return await run_in_threadpool(engine.update_weights, body, version)

    return app


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (config, tokenizer, weights).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None, help="Default: the model's own limit.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--initial-version", type=int, default=0)
    parser.add_argument("--instance", default="", help="Token echoed by /health (the launcher checks it).")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # the port first, before the model loads: a port taken by someone else fails at once, naming it
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        log.error(f"--port: cannot bind {args.host}:{args.port}: {exc.strerror or exc}")
        raise SystemExit(2) from None
    started = time.perf_counter()
    engine = Engine(args.model, args.dtype, args.max_model_len, args.seed, args.enforce_eager,
                    args.gpu_memory_utilization, args.initial_version, args.instance)
    log.info(f"engine loaded in {time.perf_counter() - started:.1f}s: {json.dumps(engine.describe())}")
    uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    main()
