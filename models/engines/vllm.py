"""The `vllm` rollout engine: rollouts from the vLLM rollout server (components/serving/rollout/), which holds
its own copy of the actor's weights and takes the new ones after every update.

Rank 0 talks to the server for all ranks: every rank's prompts are gathered on rank 0, sent as one request (vLLM
batches the whole global batch at once, which is where its speed comes from), and the samples go back to their
ranks. Weight updates reach the server from rank 0 as well, after every rank took part in gathering them (a
collective with FSDP2 shards), so an update and a generation can never interleave, and one server serves any number
of actor ranks. TRL's vLLM server mode works the same way (the main process generates for all, then scatters).

The server issues the weights version: each update asks for the next one, and every answer names the version it
sampled with, which must be the last one this engine applied. The samples are checked against what a rollout relies
on (a response ends at its stop token when the server says it ended, else runs to max_new_tokens). Logprobs are
those of the sampled distribution (vLLM `processed_logprobs`: temperature, top-k and top-p applied), the behaviour
policy's, so the step can compare them with the trainer's own (sampling/sampling_logp_difference/*) and weight the loss by
truncated importance sampling (models/losses.py: tis_weights).

Asynchronous rollouts (rollout.max_off_policy_steps = k >= 1): rank 0 submits the next batches' requests ahead
(`submit`: a request in a thread of its own, at most k beyond the batch being trained on: the step says which), and
`generate` then takes the answer of its batch instead of asking. The server stamps the version each batch was
sampled with; it is never older than the version at submission (k refits at most before its batch is trained on) and
never newer than the last this engine applied.

How requests and weights travel is not this module's business: it talks to a `RolloutServer` (the HTTP client and
its weight transports are components/serving/rollout/client.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import Tensor

from models.distributed import SINGLE, Dist
from models.engines.base import Rollout, SampleError, Weights, check_samples, from_responses


class EngineRequestError(RuntimeError):
    """The rollout server refused a request or failed it, or its answer breaks the contract; the message says why."""


class RolloutServer(Protocol):
    """What the engine needs from a rollout server (rank 0 only)."""

    def version(self) -> int:
        """The weights version the server holds now (0: the checkpoint it loaded)."""

    def generate(self, request: dict) -> dict:
        """{prompt_token_ids, n, temperature, top_k, top_p, max_new_tokens, stop_token_ids, seed, expected_version}
        -> {weights_version, samples: per prompt, n x {token_ids, logprobs, is_end}}."""

    def load_weights(self, weights: Weights, version: int) -> dict:
        """Send the full weights as update `version` (the server's current one + 1); -> {weights_version, seconds}."""

    def close(self) -> None: ...


class VLLMEngine:
    name = "vllm"
    shares_actor_weights = False

    def __init__(self, pad_id: int, stop_ids: Tensor, me: Dist = SINGLE, weights_dtype: str = "float32"):
        self.pad_id, self.stop_ids, self.me = pad_id, stop_ids, me
        self.weights_dtype = getattr(torch, weights_dtype)
        self.server: RolloutServer | None = None
        self.version: int | None = None  # the weights version the server holds, as this engine last saw it
        self.applied: list[int] = []  # every version this engine made the server apply (rank 0)
        self.last_refit: dict = {}
        self.idle_s: float | None = None  # the server's idle seconds as of its last answer (cumulative)
        self.pending: dict[int, Future] = {}  # rank 0: batches submitted ahead, by the iteration they are for
        self.wait_s = 0.0  # how long the last `generate` waited for its answer (rank 0)
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def for_policy(cls, policy, rollout) -> "VLLMEngine":
        return cls(policy.pad_id, policy.stop_ids, policy.me, rollout.vllm.dtype)

    def connect(self, server: RolloutServer) -> None:
        """Rank 0: the server this engine samples from (the run's services start it, not models/)."""
        self.server = server
        self.version = server.version()

    def submit(self, iteration: int, prompts: list[list[int]], n: int, sampling, generator: torch.Generator | None) -> None:
        """Rank 0: ask for iteration `iteration`'s batch now (every rank's prompts, rank order), answered in the
        background; `generate` for that iteration takes the answer."""
        if iteration in self.pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="rollouts")
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
        floor = self.version
        self.pending[iteration] = self._pool.submit(self.sample, prompts, n, sampling, seed, floor)

    def in_flight(self) -> list[int]:
        """The iterations whose batches are submitted and not taken yet."""
        return sorted(self.pending)

    def _server(self) -> RolloutServer:
        if self.server is None:
            raise RuntimeError("rollout.engine=vllm: no rollout server connected on rank 0 (the run's services "
                               "connect it: components/serving/services.py)")
        return self.server

    def generate(self, prompt_ids: list[list[int]], n: int, sampling, generator: torch.Generator | None = None,
                 iteration: int | None = None) -> Rollout:
        """`n` samples of each of every rank's prompts in one request from rank 0 (or the answer submitted ahead for
        `iteration`); each rank gets its own rows, stamped with the version that sampled them."""
        everyone = self.me.gather_object(prompt_ids)
        per_rank = None
        if everyone is not None:
            try:
                flat = [p for part in everyone for p in part]
                if min(len(p) for p in flat) == 0:
                    raise ValueError("prompts: every prompt must have at least one token")
                started = time.perf_counter()
                if iteration is not None and iteration in self.pending:
                    samples, version, prompts = self.pending.pop(iteration).result()
                    if prompts != flat:
                        raise EngineRequestError(f"the batch submitted for iteration {iteration} holds other prompts "
                                                 f"than the one trained on")
                else:
                    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
                    samples, version, _ = self.sample(flat, n, sampling, seed)
                self.wait_s = time.perf_counter() - started
                per_rank, start = [], 0
                for part in everyone:
                    per_rank.append((samples[start * n:(start + len(part)) * n], version, self.version))
                    start += len(part)
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
        rows, version, self.version = mine  # every rank knows the version its actor's weights are
        return from_responses([p for p in prompt_ids for _ in range(n)], [r["token_ids"] for r in rows],
                              [r["logprobs"] for r in rows], [r["is_end"] for r in rows], self.pad_id,
                              [version] * len(rows))

    def sample(self, prompts: list[list[int]], n: int, sampling, seed: int | None,
               floor: int | None = None) -> tuple[list[dict], int, list[list[int]]]:
        """One request for all prompts (rank 0): n samples each, as consecutive rows; the version they were sampled
        with; the prompts. The answer is checked: the version this engine applied (for a request submitted ahead:
        one it applied since `floor`, the version at submission), n samples per prompt, each a well-formed response."""
        stop_ids = [int(t) for t in self.stop_ids]
        answer = self._server().generate({
            "prompt_token_ids": prompts, "n": n, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens, "stop_token_ids": stop_ids,
            "seed": seed, "expected_version": self.version if floor is None else None})
        version = answer["weights_version"]
        self.idle_s = answer.get("idle_s", self.idle_s)
        if floor is None and self.version is not None and version != self.version:
            raise EngineRequestError(f"rollout server sampled with weights version {version}, this engine applied "
                                     f"version {self.version}")
        if floor is not None and not (floor <= version and (version in self.applied or version == floor)):
            raise EngineRequestError(f"rollout server sampled with weights version {version}, not one this engine "
                                     f"applied since version {floor} (submission)")
        if len(answer["samples"]) != len(prompts) or any(len(s) != n for s in answer["samples"]):
            raise EngineRequestError(f"rollout server answered {[len(s) for s in answer['samples']]} samples for "
                                     f"{len(prompts)} prompts x n={n}")
        rows = [row for per_prompt in answer["samples"] for row in per_prompt]
        try:
            check_samples([r["token_ids"] for r in rows], [r["logprobs"] for r in rows], [r["is_end"] for r in rows],
                          self.stop_ids, sampling.max_new_tokens)
        except SampleError as exc:
            raise EngineRequestError(f"rollout server answered a malformed sample: {exc}") from None
        return rows, version, prompts

    def update_weights(self, weights: Weights) -> None:
        """Every rank iterates `weights` (gathering FSDP2 shards is a collective); rank 0 sends them, one tensor at a
        time, as the server's next version. Non-leaders only take part in the gathering."""
        if not self.me.is_leader:
            for _ in weights.tensors:
                pass
            return
        server = self._server()
        expected = (self.version or 0) + 1
        answer = server.load_weights(weights.cast(self.weights_dtype), expected)
        if answer["weights_version"] != expected:
            raise EngineRequestError(f"rollout server applied weights version {answer['weights_version']}, "
                                     f"expected {expected}")
        self.version = answer["weights_version"]
        self.applied.append(self.version)
        self.idle_s = answer.get("idle_s", self.idle_s)
        self.last_refit = {k: v for k, v in answer.items() if k != "weights_version"}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
