"""Asynchronous rollouts: RLOO with rollout.max_off_policy_steps k = 0, 1, 2 through the vLLM rollout server.

Throughput, disaggregated as on a cluster: the rollout server on CPU core 1 (rollout.vllm.cpu_cores, 1 thread), the
actor on core 0 (taskset, 1 thread). On this 2-core machine that is the only way the two can overlap: sharing the
cores, each phase already uses both. The model is a ~110M Qwen2-shaped one with random weights (benchmarks/
rollout_engine.py), which rarely ends a response early: every response has max_new_tokens tokens. Sizes are chosen so
that generating a batch and training on it take comparable time on these cores (a CPU decodes at a cost set by reading
the weights once per token step, whatever the batch; training scales with the tokens in the batch: few sequences and
long responses make the two comparable, as long responses do on GPU clusters). For each k: iterations per minute
(from the median seconds per iteration after the first two), time/rollout_wait (the actor waiting for rollouts),
time/engine_idle (the server neither generating nor loading weights) and staleness; the ideal speed-up of overlapping
is (generate + train) / max(generate, train), from the k=0 run's own phases. For reference, k=0 with both sides
sharing both cores (the default on one machine).

Learning at equal samples: the tiny policy on the shipped task, RLOO, 12 iterations, k=0 and k=1 over 3 seeds (the
server sharing the cores, 1 thread): the mean gold gain (the last two iterations' mean minus the first two's).

And the same k=0 / k=1 pair at sizes where generation and training take closer to equal time (BALANCED: 2 prompts x 2
samples x 256 tokens), where overlapping can gain more.

    python -m benchmarks.async_rollouts [--quick] [--parts throughput throughput_balanced learning]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, results_dir, state_dir, stats, tiny_config, write_result
from benchmarks.rollout_engine import build_random_model

RLHF = [sys.executable, "-m", "components.cli.main", "train", "--preset", "tiny"]
SIZES = {"algorithm": "rloo", "reinforce.rollout_batch_size": 4, "reinforce.num_rollouts_per_prompt": 2,
         "reinforce.minibatch_size": 8, "reinforce.epochs": 1, "generation.max_new_tokens": 128,
         "generation.micro_batch_size": 8, "reward.source": "function",
         "reward.function": "models.tasks.sentiment:gold_reward", "rollout.engine": "vllm"}


def train(overrides: dict, out: Path, pin_actor: str | None, env: dict) -> list[dict]:
    """`rlhf train` with `overrides` in a process of its own (the actor pinned to `pin_actor` cores with one thread
    when given); the per-iteration metrics."""
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    prefix = ["taskset", "-c", pin_actor] if pin_actor else []
    run_env = dict(env, OMP_NUM_THREADS="1") if pin_actor else env
    started = time.perf_counter()
    proc = subprocess.run(prefix + RLHF + args + ["--metrics-out", str(out)], capture_output=True, text=True,
                          env=run_env, timeout=7200)
    if proc.returncode != 0:
        raise RuntimeError(f"rlhf train {overrides} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log(f"  ran in {time.perf_counter() - started:.0f}s")
    return json.loads(out.read_text())


RUNS = [("k0_shared_cores", 0, None), ("k0", 0, "0"), ("k1", 1, "0"), ("k2", 2, "0")]  # (name, k, actor's cores)
# the same model with generation and training closer to equal (ideal speed-up nearer 2x): 2 prompts x 2 samples x 256
# tokens (fewer sequences make training shorter; on a CPU a decoding step costs about the same for 4 rows as for 8)
BALANCED = {"reinforce.rollout_batch_size": 2, "reinforce.minibatch_size": 4, "generation.micro_batch_size": 4,
            "generation.max_new_tokens": 256}


def throughput(model_dir: str, iterations: int, env: dict, tmp: Path, runs=RUNS, sizes: dict | None = None) -> dict:
    """Each run of `runs` (the actor pinned to its cores and the server to core 1, or both sharing): iterations per
    minute and the phases."""
    cases = {}
    for name, k, pin in runs:
        overrides = {**SIZES, **(sizes or {}), "model.policy": model_dir, "iterations": iterations,
                     "rollout.max_off_policy_steps": k,
                     **({"deploy.rollout.threads": 1, "deploy.rollout.cpu_cores": "1"} if pin else {})}
        log(f"async_rollouts: {name} ({iterations} iterations)")
        history = train(overrides, tmp / f"{name}.json", pin, env)[2:]  # the first two warm the engine up
        step = [m["step_time"] for m in history]
        generate = [m["time/generate"] for m in history]
        train_s = [m["step_time"] - m["time/generate"] for m in history]
        cases[name] = {
            "max_off_policy_steps": k, "actor_cores": pin or "0,1 (shared)",
            "server_cores": "1" if pin else "0,1 (shared)",
            "seconds_per_iteration": stats(step), "iterations_per_minute": 60 / statistics.median(step),
            "rollout_wait_s": stats([m["time/rollout_wait"] for m in history]),
            "engine_idle_s": stats([m["time/engine_idle"] for m in history]),
            "generate_s": stats(generate), "train_s": stats(train_s),
            "refit_s": stats([m["time/refit"] for m in history]),
            "staleness_max": max(m["rollout/staleness_max"] for m in history),
            "staleness_mean": statistics.mean(m["rollout/staleness_mean"] for m in history),
            "refit_wait_s": stats([m["time/refit_wait"] for m in history]),
            "measured_iterations": len(history)}
    base = cases["k0"]
    gen, tr = base["generate_s"]["median"], base["train_s"]["median"]
    ideal = (gen + tr) / max(gen, tr)
    for name in [n for n in ("k1", "k2") if n in cases]:
        speedup = cases[name]["iterations_per_minute"] / base["iterations_per_minute"]
        cases[name].update(speedup_over_k0=speedup, ideal_speedup=ideal, share_of_ideal=speedup / ideal)
    log("async_rollouts: " + ", ".join(f"{n} {c['iterations_per_minute']:.2f} it/min" for n, c in cases.items())
        + f"; ideal x{ideal:.2f}" + (f", k=1 x{cases['k1']['speedup_over_k0']:.2f}" if "k1" in cases else ""))
    return cases


def learning(seeds: list[int], iterations: int, env: dict, tmp: Path) -> dict:
    cfg = tiny_config()
    curves = {}
    for k in (0, 1):
        for seed in seeds:
            overrides = {"algorithm": "rloo", "iterations": iterations, "seed": seed, "rollout.engine": "vllm",
                         "deploy.rollout.threads": 1, "rollout.max_off_policy_steps": k,
                         "model.policy": cfg.local_path("model.policy"),
                         "model.reward": cfg.local_path("model.reward")}
            log(f"async_rollouts: learning k={k} seed={seed}")
            curves[f"k{k}_seed{seed}"] = [m["objective/gold_reward"]
                                          for m in train(overrides, tmp / f"l{k}{seed}.json", None, env)]
    gains = {k: [(c[-1] + c[-2]) / 2 - (c[0] + c[1]) / 2 for name, c in curves.items() if name.startswith(f"k{k}_")]
             for k in (0, 1)}
    result = {"iterations": iterations, "seeds": seeds, "gold_reward_curves": curves,
              "gold_gain": {f"k{k}": stats(g) for k, g in gains.items()},
              "mean_gain_k1_minus_k0": statistics.mean(gains[1]) - statistics.mean(gains[0])}
    log(f"async_rollouts: mean gold gain k=0 {statistics.mean(gains[0]):+.3f}, k=1 {statistics.mean(gains[1]):+.3f}")
    return result


PARTS = ("throughput", "throughput_balanced", "learning")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a check, not for reporting)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="run only these parts; the others keep their results from the last full run's file")
    args = parser.parse_args(argv)
    quick, env = args.quick, dict(os.environ, HF_HUB_OFFLINE="1", RLHF_STATE_DIR=str(state_dir()))
    tiny_config()  # the tiny models exist before the runs start
    previous = results_dir(quick) / "async_rollouts.json"
    result = json.loads(previous.read_text()) if set(args.parts) != set(PARTS) and previous.exists() else {}
    for stale in ("benchmark", "created", "machine", "versions", "load_average_1_5_15_min_at_end"):
        result.pop(stale, None)
    result.update(quick=quick, what="RLOO with asynchronous rollouts (rollout.max_off_policy_steps) through the vLLM "
                                    "rollout server", parts_run_last=args.parts)
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        model = Path(tmp) / "qwen2_110m"
        params = build_random_model(model, tiny_config().local_path("model.policy"))
        iterations = 5 if quick else 10
        if "throughput" in args.parts:
            result["throughput"] = {"model": "qwen2_110m_random", "parameters": params, "sizes": SIZES,
                                    "cases": throughput(str(model), iterations, env, Path(tmp))}
        if "throughput_balanced" in args.parts:
            result["throughput_balanced"] = {
                "model": "qwen2_110m_random", "parameters": params, "sizes": {**SIZES, **BALANCED},
                "cases": throughput(str(model), iterations, env, Path(tmp), runs=RUNS[1:3], sizes=BALANCED)}
        if "learning" in args.parts:
            result["learning"] = learning([0] if quick else [0, 1, 2], 4 if quick else 12, env, Path(tmp))
    write_result("async_rollouts", result)
    return result


if __name__ == "__main__":
    main()
