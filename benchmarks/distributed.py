"""The actor on 1 vs 2 ranks (FSDP2 over gloo on this CPU): seconds per iteration, and per-rank memory.

1. Seconds per iteration: `rlhf train` (in-process critic / reward, the embedded default) for PPO and RLOO with
   deploy.actor.nproc_per_node = 1 and 2, alternated; the median of step_time over the iterations after the first. On a
   2-core CPU there is no speed-up to expect (2 ranks x 1 thread vs 1 rank x 2 threads, plus the collectives): the
   figure shows the overhead of the distributed path.
2. Per-rank bytes of parameters, gradients and AdamW states, counted from each rank's local shards
   (models.distributed.local_bytes) after one optimizer step, for a GPT-2 of >= 20M parameters built from config
   (random weights): with 2 ranks each should hold about half of what 1 rank holds.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, ensure_tiny_models, log, quick_flag, state_dir, stats, write_result

MEMORY_SCRIPT = '''
import json, os, sys, torch
sys.path.insert(0, {root!r})
from models import distributed
from models.loading import make_optimizer
from models.config import OptimConfig
from models.policy import Policy
me = distributed.from_env()
distributed.init(me, "gloo", 600, torch.device("cpu"), os.environ.get("RLHF_RUN_SECRET", ""))
policy = Policy.load({path!r}, device="cpu", me=me, shard=me.active, reference_device="cpu")
optimizer, _ = make_optimizer(policy.trainable_parameters(), OptimConfig())
tokens = torch.randint(4, 1000, (2, 32))
logp, _ = policy.logprobs(tokens, torch.full((2,), 32))
logp.mean().backward()
optimizer.step()
counts = distributed.local_bytes(policy.model, optimizer)
counts["parameters_total"] = sum(p.numel() for p in policy.model.parameters())
out = [None] * me.world_size
if me.active:
    torch.distributed.all_gather_object(out, counts)
else:
    out = [counts]
if me.is_leader:
    print("RESULT " + json.dumps(out))
distributed.shutdown()
'''


def build_model(directory: Path) -> int:
    """A GPT-2 of ~24M parameters from config (random weights) with the tiny tokenizer, saved with save_pretrained."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # heavy: only here (ranks)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(ensure_tiny_models() / "policy")
    config = GPT2Config(vocab_size=8192, n_positions=256, n_embd=512, n_layer=6, n_head=8,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def memory(world: int, path: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "memory.py"
        script.write_text(MEMORY_SCRIPT.format(root=str(ROOT), path=str(path)))
        argv = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), str(script)]
                if world > 1 else [sys.executable, str(script)])
        env = dict(os.environ, RLHF_RUN_SECRET=secrets.token_urlsafe(32))  # what the ranks prove to each other
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory run on {world} rank(s) failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def seconds_per_iteration(algorithm: str, world: int, iterations: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "m.json"
        env = dict(os.environ, RLHF_STATE_DIR=str(state_dir()))
        subprocess.run([str(Path(sys.executable).parent / "rlhf"), "train", "--preset", "tiny", "--set",
                        f"algorithm={algorithm}",
                        "--set", f"iterations={iterations}", "--set", f"deploy.actor.nproc_per_node={world}",
                        "--metrics-out", str(out)], check=True, capture_output=True, text=True, env=env, timeout=1800)
        history = json.loads(out.read_text())
    return [m["step_time"] for m in history[1:]]


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    iterations, rounds = (3, 1) if quick else (6, 3)
    ensure_tiny_models()
    timing = {}
    for algorithm in ("ppo", "rloo"):
        series = {1: [], 2: []}
        for r in range(rounds):
            for world in ((1, 2) if r % 2 == 0 else (2, 1)):
                series[world] += seconds_per_iteration(algorithm, world, iterations)
                log(f"{algorithm} on {world} rank(s): {series[world][-1]:.3f} s/iteration")
        timing[algorithm] = {f"{w}_ranks_seconds_per_iteration": stats(v) for w, v in series.items()}
        timing[algorithm]["ratio_2_over_1"] = (timing[algorithm]["2_ranks_seconds_per_iteration"]["median"]
                                               / timing[algorithm]["1_ranks_seconds_per_iteration"]["median"])
    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_model(Path(tmp) / "gpt2-24m")
        per_rank = {w: memory(w, Path(tmp) / "gpt2-24m") for w in (1, 2)}
    one = per_rank[1][0]
    halves = {kind: [r[kind] / one[kind] for r in per_rank[2]] for kind in ("params", "grads", "optimizer")}
    result = {"quick": quick, "settings": {"iterations_per_run": iterations, "rounds": rounds,
                                           "config": "embedded default (tiny models, in-process critic/reward)",
                                           "memory_model": f"GPT-2 from config, {n_params:,} parameters, float32"},
              "seconds_per_iteration": timing,
              "memory_bytes_per_rank": {f"{w}_ranks": v for w, v in per_rank.items()},
              "memory_fraction_of_1_rank_per_rank_of_2": halves,
              "target": "with 2 ranks each rank holds about half the bytes of 1 rank",
              "target_met": all(0.4 <= f <= 0.6 for fs in halves.values() for f in fs)}
    write_result("distributed", result)
    return result


if __name__ == "__main__":
    main()
