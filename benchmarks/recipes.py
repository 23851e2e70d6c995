"""Every recipe (`algorithm`: models/algorithms/recipes.py) learning in 12 iterations, as `rlhf train` runs it, on
three tasks: the shipped task (builtin:sentiment, the tiny reward model, the gold reward logged), a reward file of a
user's own (examples/rewards/review.py:praise on builtin:sentiment_target, a graded score, its own gold), and a
verifiable 0/1 reward file (review.py:names_and_praises, where groups of equal scores are common: dynamic sampling).
Each run's learning is the share of the headroom its gold reward closed (the mean of the last 2 iterations against the
first 2, towards the best score 1), as the tests assert it (>= 0.3). On-policy distillation learns from a teacher that
RLOO trained on the task: the share of the gap between the student's held-out gold reward at 0 and the teacher's it
closed, and the student's reverse KL to the teacher at the first and last iteration. DAPO's extra generation rounds
are counted.

    python -m benchmarks.recipes                     # seeds 0 1 2 with this CPU's default kernels
    python -m benchmarks.recipes --kernels default avx2 avx512 --seeds 0 1 2   # each kernel set in its own process
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, log, stats, write_result
from components.runs import train
from models.config import preset

TASKS = {
    "shipped": {"data.prompts": "builtin:sentiment"},
    "reward_file": {"data.prompts": "builtin:sentiment_target", "reward.source": "function",
                    "reward.function": str(ROOT / "examples/rewards/review.py") + ":praise",
                    "reward.gold": str(ROOT / "examples/rewards/review.py") + ":praise"},
    "verifiable": {"data.prompts": "builtin:sentiment_target", "reward.source": "function",
                   "reward.function": str(ROOT / "examples/rewards/review.py") + ":names_and_praises",
                   "reward.gold": str(ROOT / "examples/rewards/review.py") + ":names_and_praises"},
}
HELD_OUT = {"eval.every": 12, "eval.temperature": 1.0, "eval.samples_per_prompt": 4}
RECIPES = ("ppo", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp", "opd")


def closed(gold: list[float]) -> float:
    start, end = sum(gold[:2]) / 2, sum(gold[-2:]) / 2
    return (end - start) / (1.0 - start)


def one_kernel_set(seeds: list[int], state: Path) -> dict:
    """Every recipe x task x seed in this process (its torch kernels: ATEN_CPU_CAPABILITY as set before it started)."""

    base = {"deploy.state_dir": str(state), "deploy.critic.launch": "in_process", "deploy.reward.launch": "in_process",
            "deploy.tracking.system_metrics": False, "iterations": 12}
    out: dict = {}
    for task, data in TASKS.items():
        held_out = {**HELD_OUT, "eval.prompts": data["data.prompts"]}
        for seed in seeds:
            teacher = train(preset("tiny", **base, **data, **held_out, algorithm="rloo", seed=100 + seed,
                                   run_name=f"teacher-{task}-{seed}-{time.time_ns()}"))
            teacher_gold = teacher["evals"][-1]["eval/gold_reward"]
            for recipe in RECIPES:
                extra = {"model.teacher": teacher["model_dir"], **held_out} if recipe == "opd" else {}
                started = time.perf_counter()
                result = train(preset("tiny", **base, **data, **extra, algorithm=recipe, seed=seed,
                                      run_name=f"{recipe}-{task}-{seed}-{time.time_ns()}"))
                history = result["history"]
                gold = [m["objective/gold_reward"] for m in history]
                row = {"gold": gold, "headroom_closed": closed(gold), "seconds": time.perf_counter() - started}
                if recipe == "dapo":
                    row["extra_rounds"] = [m["dynamic_sampling/extra_rounds"] for m in history]
                    row["filled_groups"] = [m["dynamic_sampling/filled_groups"] for m in history]
                if recipe == "opd":
                    start, end = result["evals"][0]["eval/gold_reward"], result["evals"][-1]["eval/gold_reward"]
                    row.update(teacher_eval_gold=teacher_gold, student_eval_gold=[start, end],
                               teacher_gap_closed=(end - start) / (teacher_gold - start),
                               reverse_kl=[history[0]["opd/reverse_kl"], history[-1]["opd/reverse_kl"]])
                out.setdefault(task, {}).setdefault(recipe, {})[str(seed)] = row
                log(f"{task} {recipe} seed {seed}: {row['headroom_closed']:.2f} of the headroom"
                    + (f", {row['teacher_gap_closed']:.2f} of the gap to the teacher" if recipe == "opd" else ""))
    return out


def summary(runs: dict) -> dict:
    """Per kernel set, task and recipe: min/median/max of the headroom closed (OPD: of the gap to the teacher)."""
    out = {}
    for kernels, tasks in runs.items():
        for task, recipes in tasks.items():
            for recipe, seeds in recipes.items():
                key = "teacher_gap_closed" if recipe == "opd" else "headroom_closed"
                out.setdefault(task, {}).setdefault(recipe, {})[kernels] = stats([r[key] for r in seeds.values()])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kernels", nargs="+", default=None, help="ATEN_CPU_CAPABILITY values, each run apart")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    state = Path(os.environ.get("RLHF_STATE_DIR", ROOT / ".rlhf" / "bench-recipes")).absolute()
    if args.child:
        Path(args.child).write_text(json.dumps(one_kernel_set(args.seeds, state)))
        return 0
    runs = {}
    for kernels in args.kernels or [os.environ.get("ATEN_CPU_CAPABILITY", "default kernels of this CPU")]:
        out = state / f"recipes-{kernels.replace(' ', '_')}.json"
        state.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.kernels:
            env["ATEN_CPU_CAPABILITY"] = kernels
        subprocess.run([sys.executable, "-m", "benchmarks.recipes", "--child", str(out), "--seeds",
                        *map(str, args.seeds)], check=True, env=env, cwd=ROOT)
        runs[kernels] = json.loads(out.read_text())
    write_result("recipes", {"iterations": 12, "seeds": args.seeds, "tasks": {k: v for k, v in TASKS.items()},
                             "held_out": HELD_OUT, "summary": summary(runs), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
