"""The `vllm` rollout engine: rollouts from the vLLM rollout server (components/serving/rollout/), which holds
its own copy of the actor's weights and takes the new ones after every update.

Rank 0 talks to the server for all ranks: every rank's prompts are gathered on rank 0, sent as one request (vLLM
batches the whole global batch at once, which is where its speed comes from), and the samples go back to their
ranks. Weight updates reach the server from rank 0 as well, after every rank took part in gathering them (a
collective with FSDP2 shards), so an update and a generation can never interleave, and one server serves any number
of actor ranks. TRL's vLLM server mode works the same way (the main process generates for all, then scatters).

Replicas (`deploy.rollout.replicas`): the global batch is split into one contiguous share of whole prompts per
replica (equal shares: the replicas are alike), asked for at once; a prompt's samples all come from one replica, so
RLOO/GRPO groups stay whole, and each share's seed is the batch's seed offset by its first prompt's place, so a
prompt is sampled with the same seed whatever the replica count (the server seeds sample j of prompt i with
seed + i * n + j). Every update goes to every replica: each tensor is gathered once and handed to all of them at once
(`to_every_replica`), and each must answer the same, next version: the replicas never hold different weights.

The server issues the weights version: each update asks for the next one, and every answer names the version it
sampled with, which must be the last one this engine applied. The samples are checked against what a rollout relies
on (a response ends at its stop token when the server says it ended, else runs to max_new_tokens). Logprobs are
those of the sampled distribution (vLLM `processed_logprobs`: temperature, top-k and top-p applied), the behaviour
policy's, so the step can compare them with the trainer's own (sampling/sampling_logp_difference/*) and weight the loss
by truncated importance sampling (models/losses.py: tis_weights).

Asynchronous rollouts (rollout.max_off_policy_steps = k >= 1): rank 0 submits the next batches' requests ahead
(`submit`: a request in a thread of its own, at most k beyond the batch being trained on: the step says which), and
`generate` then takes the answer of its batch instead of asking. The server stamps the version each batch was
sampled with; it is never older than the version at submission (k refits at most before its batch is trained on) and
never newer than the last this engine applied.

How requests and weights travel is not this module's business: it talks to a `RolloutServer` (the HTTP client and
its weight transports are components/serving/rollout/client.py).
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch
from torch import Tensor

from models.distributed import SINGLE, Dist
from models.engines.base import Rollout, SampleError, Weights, check_samples, from_responses


class EngineRequestError(RuntimeError):
    """The rollout server refused a request or failed it, or its answer breaks the contract; the message says why."""


class RolloutServer(Protocol):
    """What the engine needs from a rollout server (rank 0 only); one per replica."""

    url: str

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
        self.servers: list[RolloutServer] = []  # one per replica (rank 0)
        self.version: int | None = None  # the weights version every replica holds, as this engine last saw it
        self.applied: list[int] = []  # every version this engine made the replicas apply (rank 0)
        self.last_refit: dict = {}
        self.idle: dict[int, float] = {}  # each replica's idle seconds as of its last answer (cumulative)
        self.pending: dict[int, Future] = {}  # rank 0: batches submitted ahead, by the iteration they are for
        self.wait_s = 0.0  # how long the last `generate` waited for its answer (rank 0)
        self._pool: ThreadPoolExecutor | None = None
        self._replica_pool: ThreadPoolExecutor | None = None

    @classmethod
    def for_policy(cls, policy, rollout) -> "VLLMEngine":
        return cls(policy.pad_id, policy.stop_ids, policy.me, rollout.vllm.dtype)

    def connect(self, servers: RolloutServer | list[RolloutServer]) -> None:
        """Rank 0: the servers this engine samples from, one per replica (the run's services start them, not
        models/); they must hold one weights version."""
        self.servers = list(servers) if isinstance(servers, (list, tuple)) else [servers]
        versions = [server.version() for server in self.servers]
        if len(set(versions)) > 1:
            raise EngineRequestError(f"rollout server replicas hold different weights versions "
                                     f"{dict(zip(self.urls, versions))}: they must start alike")
        self.version = versions[0]
        if len(self.servers) > 1:
            self._replica_pool = ThreadPoolExecutor(4 * len(self.servers), thread_name_prefix="replicas")

    @property
    def urls(self) -> list[str]:
        return [getattr(server, "url", "?") for server in self.servers]

    @property
    def idle_s(self) -> float | None:
        """The replicas' idle seconds as of their last answers (cumulative), their mean."""
        return sum(self.idle.values()) / len(self.idle) if self.idle else None

    def replica(self, index: int) -> str:
        """How a replica is named in an error: 'rollout server replica i (url)', or 'rollout server (url)'."""
        where = self.urls[index]
        return f"rollout server replica {index} ({where})" if len(self.servers) > 1 else f"rollout server ({where})"

    def submit(self, iteration: int, prompts: list[list[int]], n: int, sampling,
               generator: torch.Generator | None) -> None:
        """Rank 0: ask for iteration `iteration`'s batch now (every rank's prompts, rank order), answered in the
        background; `generate` for that iteration takes the answer."""
        if iteration in self.pending:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="rollouts")
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None else None
        floor = self.version
        self.pending[iteration] = self._pool.submit(self.sample, prompts, n, sampling, seed, floor)

    def _servers(self) -> list[RolloutServer]:
        if not self.servers:
            raise RuntimeError("rollout.engine=vllm: no rollout server connected on rank 0 (the run's services "
                               "connect it: components/serving/services.py)")
        return self.servers

    def _each(self, calls: list[Callable[[], dict]]) -> list[dict]:
        """Run `calls` (one per replica taking part) at once; their answers in order. The first failure is raised
        naming its replica, once every call ended (none is left running)."""
        if len(calls) == 1:
            return [calls[0]()]
        futures = [self._replica_pool.submit(call) for call in calls]
        for future in futures:
            future.exception()  # waits
        for index, future in enumerate(futures):
            if (exc := future.exception()) is not None:
                if isinstance(exc, EngineRequestError):
                    raise EngineRequestError(f"{self.replica(index)}: {exc}") from exc
                raise exc
        return [future.result() for future in futures]

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
                    samples, versions, prompts = self.pending.pop(iteration).result()
                    if prompts != flat:
                        raise EngineRequestError(f"the batch submitted for iteration {iteration} holds other prompts "
                                                 f"than the one trained on")
                else:
                    seed = (int(torch.randint(0, 2**31 - 1, (1,), generator=generator)) if generator is not None
                            else None)
                    samples, versions, _ = self.sample(flat, n, sampling, seed)
                self.wait_s = time.perf_counter() - started
                per_rank, start = [], 0
                for part in everyone:
                    rows = slice(start * n, (start + len(part)) * n)
                    per_rank.append((samples[rows], versions[rows], self.version))
                    start += len(part)
            except Exception as exc:
                if not self.me.active:
                    raise
                failure = exc
                per_rank = [{"error": f"{type(exc).__name__}: {exc}"}] * self.me.world_size
        mine = self.me.scatter_object(per_rank)
        if isinstance(mine, dict):
            if self.me.is_leader:
                raise failure
            raise EngineRequestError(f"rank 0 could not sample from the rollout server: {mine['error']}")
        rows, versions, self.version = mine  # every rank knows the version its actor's weights are
        return from_responses([p for p in prompt_ids for _ in range(n)], [r["token_ids"] for r in rows],
                              [r["logprobs"] for r in rows], [r["is_end"] for r in rows], self.pad_id, versions)

    def sample(self, prompts: list[list[int]], n: int, sampling, seed: int | None,
               floor: int | None = None) -> tuple[list[dict], list[int], list[list[int]]]:
        """All prompts (rank 0), n samples each as consecutive rows, asked for at once in one share per replica;
        the version each row was sampled with; the prompts. Each answer is checked: the version this engine applied
        (for a request submitted ahead: one it applied since `floor`, the version at submission), n samples per
        prompt, each a well-formed response."""
        servers = self._servers()
        shares = [share for share in replica_shares(len(prompts), len(servers)) if share.stop > share.start]
        stop_ids = [int(t) for t in self.stop_ids]

        def ask(index: int, share: slice) -> Callable[[], dict]:
            return lambda: servers[index].generate({
                "prompt_token_ids": prompts[share], "n": n, "temperature": sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens,
                "stop_token_ids": stop_ids, "seed": None if seed is None else seed + share.start * n,
                "expected_version": self.version if floor is None else None})

        answers = self._each([ask(index, share) for index, share in enumerate(shares)])
        rows, versions = [], []
        for index, (share, answer) in enumerate(zip(shares, answers)):
            version = answer["weights_version"]
            self.idle[index] = answer.get("idle_s", self.idle.get(index))
            if floor is None and self.version is not None and version != self.version:
                raise EngineRequestError(f"{self.replica(index)} sampled with weights version {version}, this engine "
                                         f"applied version {self.version}")
            if floor is not None and not (floor <= version and (version in self.applied or version == floor)):
                raise EngineRequestError(f"{self.replica(index)} sampled with weights version {version}, not one this "
                                         f"engine applied since version {floor} (submission)")
            count = share.stop - share.start
            if len(answer["samples"]) != count or any(len(s) != n for s in answer["samples"]):
                raise EngineRequestError(f"{self.replica(index)} answered {[len(s) for s in answer['samples']]} "
                                         f"samples for {count} prompts x n={n}")
            mine = [row for per_prompt in answer["samples"] for row in per_prompt]
            try:
                check_samples([r["token_ids"] for r in mine], [r["logprobs"] for r in mine],
                              [r["is_end"] for r in mine], self.stop_ids, sampling.max_new_tokens)
            except SampleError as exc:
                raise EngineRequestError(f"{self.replica(index)} answered a malformed sample: {exc}") from None
            rows += mine
            versions += [version] * len(mine)
        return rows, versions, prompts

    def update_weights(self, weights: Weights) -> None:
        """Every rank iterates `weights` (gathering FSDP2 shards is a collective); rank 0 sends them, one tensor at a
        time, to every replica at once as its next version, and every replica must answer that version.
        Non-leaders only take part in the gathering."""
        if not self.me.is_leader:
            for _ in weights.tensors:
                pass
            return
        servers = self._servers()
        expected = (self.version or 0) + 1
        weights = weights.cast(self.weights_dtype)
        if len(servers) == 1:
            answers = [servers[0].load_weights(weights, expected)]
        else:
            answers = to_every_replica(weights, [lambda copy, server=server: server.load_weights(copy, expected)
                                                 for server in servers], self._replica_pool, self.replica)
        for index, answer in enumerate(answers):
            if answer["weights_version"] != expected:
                raise EngineRequestError(f"{self.replica(index)} applied weights version {answer['weights_version']}, "
                                         f"expected {expected}: the replicas would sample with other weights")
            self.idle[index] = answer.get("idle_s", self.idle.get(index))
        self.version = expected
        self.applied.append(self.version)
        self.last_refit = {k: v for k, v in answers[0].items() if k not in ("weights_version", "idle_s")}
        for key in ("seconds", "lock_wait_s", "total_s"):  # a refit lasts as long as its slowest replica's
            if key in self.last_refit:
                self.last_refit[key] = max(answer.get(key, 0.0) for answer in answers)
        self.last_refit.update(idle_s=self.idle_s, versions=[answer["weights_version"] for answer in answers])

    def close(self) -> None:
        for pool in (self._pool, self._replica_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()


def replica_shares(count: int, replicas: int) -> list[slice]:
    """Replica r's contiguous share of `count` prompts: equal shares (sizes differ by one at most), in order."""
    base, extra = divmod(count, replicas)
    shares, start = [], 0
    for r in range(replicas):
        size = base + (1 if r < extra else 0)
        shares.append(slice(start, start + size))
        start += size
    return shares


DONE = object()  # the end of a replica's tensors


def to_every_replica(weights: Weights, sends: list[Callable[[Weights], dict]], pool: ThreadPoolExecutor,
                     name: Callable[[int], str], depth: int = 2) -> list[dict]:
    """Call every `send` (one per replica) at once, in threads of `pool`, each with its own `Weights` whose tensors
    come from one pass over `weights.tensors` in this thread (on rank 0 a collective with the other ranks: it runs to
    the end whatever a replica does); at most `depth` tensors wait for a slower replica. Returns the answers in
    order; the first replica that failed is raised, named."""
    queues = [queue.Queue(maxsize=depth) for _ in sends]

    def arriving(inbox: queue.Queue):
        while (tensor := inbox.get()) is not DONE:
            yield tensor

    futures = [pool.submit(send, Weights(weights.specs, arriving(inbox))) for send, inbox in zip(sends, queues)]

    def hand(item) -> None:
        for inbox, future in zip(queues, futures):
            while not future.done():  # a replica that failed (or is done) takes nothing more
                try:
                    inbox.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue

    for tensor in weights.tensors:
        hand(tensor)
    hand(DONE)
    answers = []
    for index, future in enumerate(futures):
        try:
            answers.append(future.result())
        except Exception as exc:
            raise EngineRequestError(f"{name(index)}: the weight update failed: {type(exc).__name__}: {exc}") from exc
    return answers
