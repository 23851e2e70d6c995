"""The critic-free recipes' iteration against TRL 1.16's `GRPOTrainer` with the same `loss_type`, same model, prompts,
k, reward and settings (benchmarks/rloo_vs_trl.py's harness: TRL's trainer runs unchanged, one of our iterations
runs after each of its iterations from a TrainerCallback, outside its clock, so the sides alternate and share the
machine's load; the first iteration of each side per round is a warm-up).

    ours (algorithm=)   TRL GRPOConfig
    grpo                loss_type=grpo, beta=0.04 (k3 KL in the loss: both compute the reference's logprobs)
    dr_grpo             loss_type=dr_grpo, scale_rewards=none
    dapo                loss_type=dapo, epsilon_high=0.28 (ours without dynamic sampling and the overlong
                        punishment, which TRL's loss_type does not do; their cost: benchmarks/recipes.py)
    gspo                loss_type=grpo, importance_sampling_level=sequence, epsilon=3e-4, epsilon_high=4e-4
    cispo               loss_type=cispo, epsilon_high=5.0

Fixed policy (lr 1e-9 on both sides): both keep sampling the initial policy, so they do the same work per
iteration. Target: ours <= 0.7x TRL's seconds per iteration (median of the per-pair ratios).
"""

from __future__ import annotations

import gc
import statistics

from benchmarks.common import log, quick_flag, stats, tiny_config, write_result
from benchmarks.rloo_vs_trl import FIXED_POLICY_LR, GOLD, OurRLOO, run_round, summarize, trl_kwargs
from models.algorithms import resolve

TARGET = 0.7
MATCHING = {"grpo": {"loss_type": "grpo"}, "dr_grpo": {"loss_type": "dr_grpo"}, "dapo": {"loss_type": "dapo"},
            "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"}, "cispo": {"loss_type": "cispo"}}


def bench_config(recipe: str):
    return tiny_config(algorithm=recipe, **{"reward.source": "function", "reward.function": GOLD, "reward.gold": None,
                                            "reinforce.optim.lr": FIXED_POLICY_LR, "loss.dynamic_sampling": False,
                                            "loss.overlong_buffer_len": 0})


def grpo_args(recipe: str):
    """GRPOConfig with TRL's loss_type of `recipe` and the recipe's clip, KL and reward scaling."""
    def args_for(cfg, output_dir: str, iterations: int):
        from trl import GRPOConfig  # optional: the bench extra

        settings = resolve(cfg)
        kwargs = {**trl_kwargs(cfg, output_dir, iterations), **MATCHING[recipe], "beta": settings.kl_beta,
                  "epsilon": settings.menu.epsilon, "epsilon_high": settings.menu.epsilon_high,
                  "scale_rewards": settings.scale_rewards}
        return GRPOConfig(**kwargs)
    return args_for


def compare(recipe: str, rounds: int, iterations: int) -> dict:
    from trl import GRPOTrainer  # optional: the bench extra

    cfg = bench_config(recipe)
    ours, trl, per_round = [], [], []
    for r in range(rounds):
        gc.collect()
        trl_records, by_side, facts = run_round(cfg, iterations, {"ours": OurRLOO(cfg)}, GRPOTrainer, grpo_args(recipe))
        ours += by_side["ours"]
        trl += trl_records
        o, t = (statistics.median(x["seconds"] for x in recs) for recs in (by_side["ours"], trl_records))
        per_round.append({"ours_s": o, "trl_s": t, "time_ratio": o / t})
        log(f"grpo_vs_trl {recipe} round {r + 1}/{rounds}: ours {o:.3f} s/it, TRL {t:.3f} s/it, ratio {o / t:.2f}")
    ratio = stats([o["seconds"] / t["seconds"] for o, t in zip(ours, trl)])
    return {"trl": {**MATCHING[recipe], "epsilon_high": resolve(cfg).menu.epsilon_high, "beta": resolve(cfg).kl_beta},
            "trl_facts": facts, "ours": summarize(ours), "trl_side": summarize(trl), "per_round": per_round,
            "time_ratio_ours_over_trl": ratio, "target_met": ratio["median"] <= TARGET}


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    rounds, iterations = (1, 6) if quick else (3, 15)
    results = {recipe: compare(recipe, rounds, iterations) for recipe in MATCHING}
    result = {"quick": quick, "what": "seconds per iteration (a generation batch and its optimizer steps), ours / TRL "
                                      "GRPOTrainer with the same loss_type, fixed policy",
              "repetitions": {"rounds": rounds, "timed_iterations_per_round_per_side": iterations,
                              "warmup_iterations_discarded_per_round": 1},
              "recipes": results, "target": f"median per-pair time ratio <= {TARGET}",
              "target_met": all(r["target_met"] for r in results.values())}
    write_result("grpo_vs_trl", result)
    return result


if __name__ == "__main__":
    main()
