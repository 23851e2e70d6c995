"""Overlap: how much critic time the PPO iteration hides behind the actor's own work.

The benchmark wraps (here, not in the library) the critic backend in a timing proxy that stamps when each request is
made and when its future completes, and wraps the actor's `policy.logprobs` to stamp its forward passes:

    hidden fraction (critic_infer) = |critic infer busy  ∩  actor logprob/reference forwards| / |critic infer busy|
    hidden fraction (critic_train) = |critic train busy  ∩  actor train phase|                / |critic train busy|

"busy" is the union of [request made, future completed] intervals (what the actor would wait for if it did nothing
else); the actor train phase runs from the critic_train request to the moment the actor asks for its result.
Measured for the critic over HTTP (PyTriton child process, the default launch) and in process. Target: >= 80% for
critic_infer.
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import log, quick_flag, stats, write_result
from benchmarks.critic_http import PPORunner, bench_config, http_critic, local_critic

TARGET = 0.80


class _StampedFuture:
    """A future whose first `result()` call is stamped (the moment the actor starts waiting)."""

    def __init__(self, future, record):
        self._future, self._record = future, record

    def result(self, timeout=None):
        self._record.setdefault("waited", time.perf_counter())
        return self._future.result(timeout)

    def __getattr__(self, name):
        return getattr(self._future, name)


class TimedCritic:
    """CriticBackend proxy: records (kind, made, returned, done, waited) per request."""

    def __init__(self, inner):
        self.inner = inner
        self.combined_reward = inner.combined_reward
        self.events: list[dict] = []

    def _track(self, kind, call, *args):
        record = {"kind": kind, "made": time.perf_counter()}
        future = call(*args)
        record["returned"] = time.perf_counter()  # client-side work done on the actor's thread before returning
        future.add_done_callback(lambda _: record.setdefault("done", time.perf_counter()))
        self.events.append(record)
        return _StampedFuture(future, record)

    def infer_async(self, tokens, lengths):
        return self._track("infer", self.inner.infer_async, tokens, lengths)

    def train_async(self, tokens, returns, prev_values, mask):
        return self._track("train", self.inner.train_async, tokens, returns, prev_values, mask)

    def save(self):
        return self.inner.save()


def stamp_logprobs(policy, intervals: list[tuple[float, float, str]]) -> None:
    """Wrap this policy's `logprobs` (instance attribute) to record (start, end, phase) of every forward."""
    inner = policy.logprobs

    def logprobs(*args, reference=False, **kwargs):
        phase = "reference" if reference else ("logprobs" if not torch.is_grad_enabled() else "train")
        start = time.perf_counter()
        try:
            return inner(*args, reference=reference, **kwargs)
        finally:
            intervals.append((start, time.perf_counter(), phase))

    policy.logprobs = logprobs


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def measure(intervals) -> float:
    return sum(end - start for start, end in union(intervals))


def intersection(a, b) -> float:
    total = 0.0
    for s1, e1 in union(a):
        for s2, e2 in union(b):
            total += max(0.0, min(e1, e2) - max(s1, s2))
    return total


class OverlapSide:
    """A PPO runner whose critic and actor forwards are stamped; `step()` runs and analyses one iteration."""

    def __init__(self, cfg, critic):
        self.proxy = TimedCritic(critic)
        self.runner = PPORunner(cfg, self.proxy)
        self.forwards: list[tuple[float, float, str]] = []
        stamp_logprobs(self.runner.state.policy, self.forwards)
        self.iterations: list[dict] = []

    def step(self, record: bool = True) -> None:
        self.proxy.events.clear()
        self.forwards.clear()
        iteration = self.runner.run(1, warmup=0)[0]
        if not record:
            return
        infer = [e for e in self.proxy.events if e["kind"] == "infer"]
        train = [e for e in self.proxy.events if e["kind"] == "train"]
        infer_busy = [(e["made"], e["done"]) for e in infer]
        actor_rollout = [(s, e) for s, e, phase in self.forwards if phase in ("logprobs", "reference")]
        train_busy = [(e["made"], e["done"]) for e in train]
        actor_train = [(e["returned"], e["waited"]) for e in train]
        infer_s, train_s = measure(infer_busy), measure(train_busy)
        hidden = intersection(infer_busy, actor_rollout)
        self.iterations.append({
            "iteration_s": iteration["seconds"],
            "critic_infer_requests": len(infer),
            "critic_infer_busy_s": infer_s,
            "actor_logprob_reference_s": measure(actor_rollout),
            "infer_hidden_s": hidden,
            "infer_hidden_fraction": hidden / infer_s if infer_s else 1.0,
            "critic_wait_s": iteration["phases"]["critic_wait"],
            "client_submit_s": sum(e["returned"] - e["made"] for e in infer),
            "critic_train_busy_s": train_s,
            "actor_train_s": measure(actor_train),
            "train_hidden_fraction": intersection(train_busy, actor_train) / train_s if train_s else 1.0,
            "critic_train_wait_s": iteration["phases"]["critic_train_wait"],
        })

    def summary(self) -> dict:
        its = self.iterations
        return {"per_iteration_stats": {k: stats([it[k] for it in its]) for k in its[0]},
                "infer_hidden_fraction_pooled": sum(i["infer_hidden_s"] for i in its)
                / max(1e-12, sum(i["critic_infer_busy_s"] for i in its))}


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    iterations = 6 if quick else 40
    cfg = bench_config()
    with local_critic(cfg) as local, http_critic(cfg) as remote:
        runs = {"http": OverlapSide(cfg, remote), "in_process": OverlapSide(cfg, local)}
        for run in runs.values():
            run.step(record=False)  # warm-up
        for i in range(iterations):
            for name in (("http", "in_process") if i % 2 == 0 else ("in_process", "http")):
                runs[name].step()
    sides = {name: run.summary() for name, run in runs.items()}
    for name, side in sides.items():
        s = side["per_iteration_stats"]
        log(f"overlap {name}: critic_infer hidden {s['infer_hidden_fraction']['median']:.0%} "
            f"(busy {s['critic_infer_busy_s']['median'] * 1e3:.1f} ms vs actor logprob/reference "
            f"{s['actor_logprob_reference_s']['median'] * 1e3:.1f} ms); critic_train hidden "
            f"{s['train_hidden_fraction']['median']:.0%}")
    headline = sides["http"]["per_iteration_stats"]["infer_hidden_fraction"]
    result = {
        "quick": quick,
        "what": "fraction of critic busy time overlapped with actor work in one PPO iteration (models.step.train_step)",
        "definition": __doc__.strip().split("\n\n")[1],
        "repetitions": {"iterations_per_side": iterations, "warmup_iterations_discarded": 1,
                        "order": "interleaved per iteration, ABBA"},
        "settings": {"rollout_batch_size": cfg.ppo.rollout_batch_size,
                     "micro_batch_size": cfg.generation.micro_batch_size,
                     "critic_infer_requests_per_iteration": -(-cfg.ppo.rollout_batch_size
                                                              // cfg.generation.micro_batch_size),
                     "recompute_logprobs": cfg.generation.recompute_logprobs, "dtype": cfg.model.dtype},
        "http": sides["http"],
        "in_process": sides["in_process"],
        "infer_hidden_fraction_http": headline,
        "train_hidden_fraction_http": sides["http"]["per_iteration_stats"]["train_hidden_fraction"],
        "target": f"critic_infer hidden fraction >= {TARGET:.0%} (HTTP critic)",
        "target_met": headline["median"] >= TARGET,
    }
    write_result("overlap", result)
    return result


if __name__ == "__main__":
    main()
