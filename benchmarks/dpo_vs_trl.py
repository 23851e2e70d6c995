"""DPO, one optimizer step each: ours (models/stages/train.train_step of the dpo stage, models/stages/dpo.py) vs TRL
1.16's `DPOTrainer`, same model, pairs, batch and optimizer, side by side on the same batches.

Both sides: the tiny policy and its frozen reference (a second copy of the same files: TRL builds its reference from
the model's path, ours keeps a frozen copy), the shipped task's builtin preference pairs (TRL tokenizes the text; the
batch TRL trained on is replayed on our side with the very same token rows: each row's prompt length is its
completion mask's run of leading zeros), 32 pairs per optimizer step, no gradient accumulation, the sigmoid loss with
beta 0.1, AdamW lr 1e-3 betas (0.9, 0.95) no weight decay, grad-norm clip 1.0, constant schedule, float32 on the CPU,
no dropout, no logging, no checkpoints.

One "step" = one optimizer step on one batch, its collation included. TRL's trainer runs unchanged (`trainer.train()`);
a subclass only keeps the batch its `training_step` received, and a `TrainerCallback` at each step's end runs one of
our steps on that very batch, outside TRL's clock, so the sides alternate step by step and see the same background
load. Each round builds a fresh trainer and trainee; the first steps of each round are a warm-up and are discarded.
The warm-up steps also check that both sides compute the same thing: both start from the same weights and update them
with the same batches, so TRL's metrics (rewards/*, logps/*) and ours must agree step after step to float32 tolerance
(the first step's rewards are 0 on both sides: the policy is its reference; the third's are not). Target: ours <= 1.0x
TRL's seconds per step (median of the per-pair ratios).

    python -m benchmarks.dpo_vs_trl [--quick]      (needs trl==1.16.0: the bench extra)
"""

from __future__ import annotations

import gc
import statistics
import tempfile

import torch

from benchmarks.common import log, quick_flag, side_by_side, stats, write_result
from models.data import builtin_rows
from models.policy import load_policy_tokenizer
from models.stages.config import DPORun
from models.stages.kinds import build_stage
from models.stages.train import train_step
from models.tiny_files import embedded_model_path

TARGET = 1.0
BATCH = 32
LR = 1e-3
BETA = 0.1
WARMUP = 3  # steps of each round not timed
SAME = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def run_config(state_dir: str) -> DPORun:
    """Our side's config: the tiny policy, one step = BATCH pairs in one micro-batch, AdamW as TRL's."""
    return DPORun.model_validate({"deploy": {"state_dir": state_dir, "device": "cpu"}, "dpo": {
        "batch_size": BATCH, "micro_batch_size": BATCH, "beta": BETA, "optim": {"lr": LR, "betas": [0.9, 0.95]}}})


def trl_args(output_dir: str, steps: int):
    from trl import DPOConfig  # optional: the bench extra

    return DPOConfig(output_dir=output_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9,
                     adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
                     gradient_checkpointing=False, eval_strategy="no", save_strategy="no", report_to="none",
                     logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, seed=0, max_length=None,
                     beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=False)


def trl_rows(inputs: dict) -> dict:
    """The batch TRL's training_step received, as our train command carries it (the same token rows)."""
    ids, attention, completion = (inputs["input_ids"].cpu(), inputs["attention_mask"].cpu(),
                                  inputs["completion_mask"].cpu())
    lengths = attention.sum(1)
    rows = [r[:int(n)].tolist() for r, n in zip(ids, lengths)]
    prompts = [int((m[:int(n)] == 0).long().cumprod(0).sum()) for m, n in zip(completion, lengths)]
    half = len(rows) // 2
    return {"chosen": rows[:half], "rejected": rows[half:], "prompt_lengths": list(zip(prompts[:half], prompts[half:]))}


def run_round(steps: int, state_dir: str) -> tuple[list[float], list[float], list[int], dict, dict]:
    """TRL's trainer for WARMUP + steps optimizer steps, one of ours after each on the same batch; returns TRL's and
    our seconds per step, the tokens per step (after the warm-up), facts about TRL's setup and the first step's
    metrics of both sides."""
    from datasets import Dataset  # optional: comes with trl (the bench extra)
    from transformers import AutoModelForCausalLM  # heavy
    from transformers.trainer_callback import PrinterCallback  # heavy: as above
    from trl import DPOTrainer  # optional: the bench extra

    path = str(embedded_model_path("tiny/policy"))
    tokenizer = load_policy_tokenizer(path)
    cfg = run_config(state_dir)
    ours = build_stage(cfg)
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in builtin_rows("sentiment_preference", "train")]
    dataset = Dataset.from_list(rows)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    first: list[dict] = []

    def ours_on(batch: dict) -> None:
        metrics = train_step(ours, cfg, trl_rows(batch))
        if len(first) < WARMUP:  # the warm-up steps: the same numbers on both sides
            step = len(first)
            first.append({"ours": {name: metrics[f"train/{name}"] for name in SAME},
                          "trl": {name: trainer._metrics["train"][name][step] for name in SAME}})

    trainer_class, callback, timings = side_by_side(DPOTrainer, ours_on)
    with tempfile.TemporaryDirectory(prefix="trl-dpo-") as out:
        args = trl_args(out, WARMUP + steps)
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                callbacks=[callback])
        trainer.remove_callback(PrinterCallback)
        facts = {"trainer": "DPOTrainer", "optim": str(getattr(args.optim, "value", args.optim)),
                 "model_dtype": str(trainer.model.dtype), "device": str(trainer.accelerator.device),
                 "reference": type(trainer.ref_model).__name__, "loss_type": list(args.loss_type), "beta": args.beta,
                 "pairs": len(rows)}
        trainer.train()
    if len(timings["trl"]) != WARMUP + steps:
        raise RuntimeError(f"TRL ran {len(timings['trl'])} steps, expected {WARMUP + steps}")
    return timings["trl"][WARMUP:], timings["ours"][WARMUP:], timings["tokens"][WARMUP:], facts, first


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    rounds, steps = (1, 10) if quick else (3, 40)
    ours, trl, tokens, per_round, facts, checks = [], [], [], [], {}, []
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as state_dir:
        for r in range(rounds):
            gc.collect()
            t, o, n, facts, first = run_round(steps, state_dir)
            trl, ours, tokens = trl + t, ours + o, tokens + n
            per_round.append({"ours_s": statistics.median(o), "trl_s": statistics.median(t),
                              "time_ratio": statistics.median(o) / statistics.median(t)})
            worst = [max(abs(step["ours"][k] - step["trl"][k]) for k in SAME) for step in first]
            checks.append({"warmup_steps": first, "max_abs_difference_per_step": worst})
            log(f"dpo_vs_trl round {r + 1}/{rounds}: ours {per_round[-1]['ours_s'] * 1e3:.1f} ms/step, TRL "
                f"{per_round[-1]['trl_s'] * 1e3:.1f} ms/step, ratio {per_round[-1]['time_ratio']:.2f}; the warm-up "
                f"steps' metrics differ by <= {', '.join(f'{w:.1e}' for w in worst)}")
    result = {"quick": quick, "what": "seconds per optimizer step (its batch's collation included), ours / TRL 1.16",
              "repetitions": {"rounds": rounds, "timed_steps_per_round_per_side": steps,
                              "warmup_steps_discarded_per_round": WARMUP,
                              "order": "interleaved: after each TRL step (TrainerCallback.on_step_end) one of ours on "
                                       "the same batch, outside TRL's clock; a new trainer and trainee per round"},
              "settings_ours_vs_trl": {
                  "model": ["tiny/policy (GPT-2, 2 layers x 64) + a frozen copy as the reference",
                            "the same files; the reference built by DPOTrainer from the model's path"],
                  "pairs": ["builtin:sentiment_preference train: TRL's batch replayed with the same token rows",
                            "the same pairs as text (prompt, chosen, rejected), tokenized by DPOTrainer"],
                  "batch": [f"{BATCH} pairs per optimizer step, one micro-batch (chosen and rejected together)",
                            f"per_device_train_batch_size={BATCH}, gradient_accumulation_steps=1"],
                  "loss": [f"sigmoid, beta={BETA} (models/losses.dpo_loss)", f"loss_type=['sigmoid'], beta={BETA}"],
                  "optimizer": [f"torch.optim.AdamW(fused=True) lr={LR} betas=(0.9, 0.95) wd=0, clip 1.0, constant",
                                f"Trainer's AdamW lr={LR} betas=(0.9, 0.95) wd=0, max_grad_norm=1.0, constant"],
                  "dtype / device": ["float32 / cpu", "float32 / cpu (use_cpu=True)"]},
              "trl_facts": facts, "ours_seconds_per_step": stats(ours), "trl_seconds_per_step": stats(trl),
              "tokens_per_step": stats(tokens), "per_round": per_round, "same_computation": checks,
              "time_ratio_ours_over_trl": stats([o / t for o, t in zip(ours, trl)]),
              "time_ratio_of_medians": statistics.median(ours) / statistics.median(trl),
              "target": f"median per-pair time ratio <= {TARGET}"}
    result["target_met"] = result["time_ratio_ours_over_trl"]["median"] <= TARGET
    write_result("dpo_vs_trl", result)
    return result


if __name__ == "__main__":
    main()
