"""The `vllm` rollout engine: rollouts from the vLLM rollout server (components/serving/rollout_server.py), which holds
its own copy of the actor's weights and takes the new ones after every update.

Rank 0 talks to the server for all ranks: every rank's prompts are gathered on rank 0, sent as one request (vLLM
batches the whole global batch at once, which is where its speed comes from), and the samples go back to their
ranks. Weight updates reach the server from rank 0 as well, after every rank took part in gathering them (a
collective with FSDP2 shards), so an update and a generation can never interleave, and one server serves any number
of actor ranks. TRL's vLLM server mode works the same way (the main process generates for all, then scatters).

Every answer carries the weights version it was sampled with; the engine refuses an answer from another version than
the last one it sent. Logprobs are those of the sampled distribution (vLLM `processed_logprobs`: temperature, top-k and
top-p applied), so the step can compare them with the trainer's own (rollout/logprob_diff_*) and weight the loss by
truncated importance sampling (models/losses.py: tis_weights).
"""

from __future__ import annotations

import time
from typing import Iterable

import httpx
import torch
from safetensors.torch import save
from torch import Tensor

from models.distributed import SINGLE, Dist
from models.rollout.base import Rollout, right_pad


CHUNK = 4 << 20  # bytes per piece of a streamed weight update


class EngineRequestError(RuntimeError):
    """The rollout server refused a request (4xx) or failed it (5xx); the message carries its reason."""


class RolloutClient:
    """HTTP client of the rollout server (rank 0 only)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def health(self) -> dict:
        return self._check(self.http.get("/health"))

    def generate(self, body: dict) -> dict:
        return self._check(self.http.post("/generate", json=body))

    def update_weights(self, blob: bytes, version: int) -> dict:
        """POST the safetensors bytes, streamed in 4 MiB pieces: httpx sends one bytes body through h11 at ~50 MB/s
        (10 s for a 110M-parameter model in float32 on this CPU), an iterator of large pieces at memory speed."""
        view = memoryview(blob)
        pieces = (bytes(view[i:i + CHUNK]) for i in range(0, len(blob), CHUNK))
        return self._check(self.http.post("/update_weights", params={"version": version}, content=pieces,
                                          headers={"content-type": "application/octet-stream",
                                                   "content-length": str(len(blob))}))

    def _check(self, response: httpx.Response) -> dict:
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise EngineRequestError(f"rollout server {self.url}{response.request.url.path} answered "
                                     f"{response.status_code}: {detail}")
        return response.json()

    def close(self) -> None:
        self.http.close()


def safetensors_bytes(weights: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None = None) -> bytes:
    """The full state dict as one safetensors file in memory (tied tensors copied: safetensors refuses shared ones)."""
    tensors, seen = {}, set()
    for name, tensor in weights:
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    return save(tensors)


class VLLMEngine:
    name = "vllm"
    shares_actor_weights = False

    def __init__(self, pad_id: int, stop_ids: Tensor, me: Dist = SINGLE, weights_dtype: str = "float32"):
        self.pad_id, self.stop_ids, self.me = pad_id, stop_ids, me
        self.weights_dtype = getattr(torch, weights_dtype)
        self.client: RolloutClient | None = None
        self.version: int | None = None  # the version last sent (None: the server's initial weights)
        self.last_refit: dict = {}

    @classmethod
    def for_policy(cls, policy, rollout) -> "VLLMEngine":
        return cls(policy.pad_id, policy.stop_ids, policy.me, rollout.vllm.dtype)

    def connect(self, client: RolloutClient) -> None:
        """Rank 0: the server this engine samples from (the flow starts it, models/rollout does not)."""
        self.client = client

    def _client(self) -> RolloutClient:
        if self.client is None:
            raise RuntimeError("rollout.engine=vllm: no rollout server connected on rank 0 (start it with "
                               "components.serving.rollout.rollout_service)")
        return self.client

    def generate(self, prompt_ids: list[list[int]], gen, generator: torch.Generator | None = None) -> Rollout:
        """Sample every rank's prompts in one request from rank 0; each rank gets back its own rows."""
        everyone = self.me.gather_object(prompt_ids)
        per_rank = None
        if everyone is not None:
            try:
                flat = [p for part in everyone for p in part]
                if min(len(p) for p in flat) == 0:
                    raise ValueError("prompts: every prompt must have at least one token")
                seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
                rows = self.sample(flat, gen, seed)
                sizes, start, per_rank = [len(part) for part in everyone], 0, []
                for size in sizes:
                    per_rank.append(rows[start:start + size])
                    start += size
            except Exception as exc:  # noqa: BLE001 - every rank must leave the scatter, then all raise
                if not self.me.active:
                    raise
                failure = exc
                per_rank = [{"error": f"{type(exc).__name__}: {exc}"}] * self.me.world_size
        mine = self.me.scatter_object(per_rank)
        if isinstance(mine, dict):
            if self.me.is_leader:
                raise failure
            raise EngineRequestError(f"rank 0 could not sample from the rollout server: {mine['error']}")
        width = max(len(r["token_ids"]) for r in mine)
        new_tokens = torch.full((len(mine), width), self.pad_id, dtype=torch.long)
        new_logps = torch.zeros((len(mine), width))
        for i, r in enumerate(mine):
            new_tokens[i, :len(r["token_ids"])] = torch.tensor(r["token_ids"], dtype=torch.long)
            new_logps[i, :len(r["logprobs"])] = torch.tensor(r["logprobs"])
        # vLLM ends a sample at a stop token (kept in the response) or at max_new_tokens: right_pad's own rule
        return right_pad(prompt_ids, new_tokens, new_logps, self.stop_ids, self.pad_id)

    def sample(self, prompts: list[list[int]], gen, seed: int | None) -> list[dict]:
        """One request for all rows (rank 0): consecutive equal prompts become one prompt with n samples when every
        prompt repeats the same number of times (k samples per prompt), else one sample per row."""
        groups: list[list] = []
        for p in prompts:
            if groups and groups[-1][0] == p:
                groups[-1][1] += 1
            else:
                groups.append([p, 1])
        n = groups[0][1] if len({count for _, count in groups}) == 1 else 1
        unique = [p for p, _ in groups] if n > 1 else prompts
        body = {"prompt_token_ids": unique, "n": n, "temperature": gen.temperature, "top_k": gen.top_k,
                "top_p": gen.top_p, "max_new_tokens": gen.max_new_tokens,
                "stop_token_ids": [int(t) for t in self.stop_ids], "seed": seed, "expected_version": self.version}
        answer = self._client().generate(body)
        if self.version is not None and answer["weights_version"] != self.version:
            raise EngineRequestError(f"rollout server sampled with weights version {answer['weights_version']}, "
                                     f"expected {self.version}")
        return [row for per_prompt in answer["samples"] for row in per_prompt]

    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Every rank iterates `weights` (gathering FSDP2 shards is a collective); rank 0 sends them as one
        safetensors file and the server clears its prefix cache. Non-leaders only take part in the gathering."""
        if not self.me.is_leader:
            for _ in weights:
                pass
            return
        started = time.perf_counter()
        blob = safetensors_bytes(weights, self.weights_dtype)
        packed = time.perf_counter()
        version = (self.version or 0) + 1
        answer = self._client().update_weights(blob, version)
        self.version = answer["weights_version"]
        self.last_refit = {"bytes": len(blob), "gather_pack_s": packed - started, "server_s": answer["seconds"],
                           "total_s": time.perf_counter() - started}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
