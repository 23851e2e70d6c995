"""The stages before RL, one optimizer step each: ours (models/stages/train.train_step) vs TRL 1.16's `SFTTrainer` and
`RewardTrainer`, same model, rows, batch and optimizer.

Both sides: the tiny policy (SFT: the causal LM; reward model: its backbone with a new one-label score head, the
same initialisation on both sides), the shipped task's builtin rows tokenized once (models/stages/data.py) and handed
to TRL pre-tokenized (SFT: input_ids + completion_mask with completion_only_loss; reward model: chosen_ids /
rejected_ids), 32 rows (pairs) per optimizer step, no gradient accumulation, AdamW lr 1e-3 betas (0.9, 0.95) no weight
decay, grad-norm clip 1.0, constant schedule, float32 on the CPU, no dropout, no logging, no checkpoints.

One "step" = one optimizer step on one batch, its collation included. TRL's trainer runs unchanged
(`trainer.train()`); a subclass only keeps the batch its `training_step` received, and a `TrainerCallback` at each
step's end runs one of our steps on that very batch (the same rows, lengths and padding), outside TRL's clock, so the
sides alternate step by step and see the same background load. TRL's clock runs from the end of our previous step to
the end of its own (its data loading and collation included). Each round builds a fresh trainer and trainee; the
first steps of each round are a warm-up and are discarded. Target: ours <= 1.0x TRL's seconds per step (median of
the per-pair ratios).
"""

from __future__ import annotations

import gc
import statistics
import tempfile

import torch

from benchmarks.common import log, quick_flag, side_by_side, stats, write_result
from models.stages.config import RewardModelRun, SFTRun
from models.resolve import resolve_data
from models.stages.data import load_pairs, load_sequences
from models.stages.kinds import build_stage
from models.stages.train import train_step
from models.policy import load_policy_tokenizer
from models.tiny_files import embedded_model_path

TARGET = 1.0
BATCH = 32
LR = 1e-3
WARMUP = 3  # steps of each round not timed


def run_config(stage: str, state_dir: str):
    """Our side's config: the tiny policy, one step = BATCH rows in one micro-batch, AdamW as TRL's."""
    section = {"batch_size": BATCH, "micro_batch_size": BATCH, "optim": {"lr": LR, "betas": [0.9, 0.95]}}
    run = SFTRun if stage == "sft" else RewardModelRun
    return run.model_validate({"deploy": {"state_dir": state_dir, "device": "cpu"}, stage: section})


def trl_args(stage: str, output_dir: str, steps: int):
    from trl import RewardConfig, SFTConfig  # optional: the bench extra

    common = dict(output_dir=output_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                  max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9,
                  adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=False, fp16=False,
                  gradient_checkpointing=False, eval_strategy="no", save_strategy="no", report_to="none",
                  logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0, seed=0, max_length=None)
    if stage == "sft":
        return SFTConfig(completion_only_loss=True, packing=False, padding_free=False, **common)
    return RewardConfig(center_rewards_coefficient=None, **common)


def trl_rows(stage: str, inputs: dict) -> dict:
    """The batch TRL's training_step received, as our train command carries it (the same token rows)."""
    ids, attention = inputs["input_ids"].cpu(), inputs["attention_mask"].cpu()
    rows = [r[:int(n)].tolist() for r, n in zip(ids, attention.sum(1))]
    if stage == "sft":
        labels = inputs["labels"].cpu()
        prompt_lengths = [int((row[:int(n)] == -100).long().cumprod(0).sum())
                          for row, n in zip(labels, attention.sum(1))]
        return {"ids": rows, "prompt_lengths": prompt_lengths}
    half = len(rows) // 2
    return {"chosen": rows[:half], "rejected": rows[half:]}


def run_round(stage: str, steps: int, state_dir: str) -> tuple[list[float], list[float], list[int], dict]:
    """TRL's trainer for WARMUP + steps optimizer steps, one of ours after each on the same batch; returns TRL's and
    our seconds per step, the tokens per step (after the warm-up) and facts about TRL's setup."""
    from datasets import Dataset  # optional: comes with trl (the bench extra)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # heavy
    from transformers.trainer_callback import PrinterCallback  # heavy: as above
    from trl import RewardTrainer, SFTTrainer  # optional: the bench extra

    path = str(embedded_model_path("tiny/policy"))
    tokenizer = load_policy_tokenizer(path)
    cfg = run_config(stage, state_dir)
    ours = build_stage(cfg)  # seeds torch with cfg.seed first: the new score head is drawn from seed 0
    torch.manual_seed(cfg.seed)
    if stage == "sft":
        data = load_sequences(resolve_data("builtin:sentiment_sft", "sft.data"), "train", tokenizer, 64)
        dataset = Dataset.from_dict({"input_ids": data.ids, "completion_mask": [
            [0] * p + [1] * (len(ids) - p) for ids, p in zip(data.ids, data.prompt_lengths)]})
        model, trainer_class = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), SFTTrainer
    else:
        data = load_pairs(resolve_data("builtin:sentiment_preference", "reward_model.data"), "train", tokenizer, 64)
        dataset = Dataset.from_dict({"chosen_ids": data.chosen, "rejected_ids": data.rejected})
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id
        trainer_class = RewardTrainer
    trainer_class, callback, timings = side_by_side(trainer_class,
                                                    lambda batch: train_step(ours, cfg, trl_rows(stage, batch)))
    with tempfile.TemporaryDirectory(prefix=f"trl-{stage}-") as out:
        args = trl_args(stage, out, WARMUP + steps)
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                callbacks=[callback])
        trainer.remove_callback(PrinterCallback)
        facts = {"trainer": trainer_class.__name__, "optim": str(getattr(args.optim, "value", args.optim)),
                 "model_dtype": str(trainer.model.dtype), "device": str(trainer.accelerator.device),
                 "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
                 "rows": len(data)}
        trainer.train()
    if len(timings["trl"]) != WARMUP + steps:
        raise RuntimeError(f"TRL ran {len(timings['trl'])} steps, expected {WARMUP + steps}")
    return timings["trl"][WARMUP:], timings["ours"][WARMUP:], timings["tokens"][WARMUP:], facts


def compare(stage: str, rounds: int, steps: int) -> dict:
    ours, trl, tokens, per_round, facts = [], [], [], [], {}
    with tempfile.TemporaryDirectory(prefix="stages-bench-") as state_dir:
        for r in range(rounds):
            gc.collect()
            t, o, n, facts = run_round(stage, steps, state_dir)
            trl, ours, tokens = trl + t, ours + o, tokens + n
            per_round.append({"ours_s": statistics.median(o), "trl_s": statistics.median(t),
                              "time_ratio": statistics.median(o) / statistics.median(t)})
            log(f"stages_vs_trl ({stage}) round {r + 1}/{rounds}: ours {per_round[-1]['ours_s'] * 1e3:.1f} ms/step, "
                f"TRL {per_round[-1]['trl_s'] * 1e3:.1f} ms/step, ratio {per_round[-1]['time_ratio']:.2f}")
    return {"trl_facts": facts, "ours_seconds_per_step": stats(ours), "trl_seconds_per_step": stats(trl),
            "tokens_per_step": stats(tokens), "per_round": per_round,
            "time_ratio_ours_over_trl": stats([o / t for o, t in zip(ours, trl)]),
            "time_ratio_of_medians": statistics.median(ours) / statistics.median(trl)}


SETTINGS = {
    "model": ["tiny/policy (GPT-2, 2 layers x 64)", "the same files"],
    "rows": ["builtin:sentiment_sft / sentiment_preference train, tokenized once (models/stages/data.py)",
             "the same token ids, pre-tokenized (input_ids + completion_mask; chosen_ids / rejected_ids)"],
    "batch": [f"{BATCH} rows (pairs) per optimizer step, one micro-batch", f"per_device_train_batch_size={BATCH}, "
              "gradient_accumulation_steps=1; the exact batch TRL trained on is replayed on our side"],
    "optimizer": [f"torch.optim.AdamW(fused=True) lr={LR} betas=(0.9, 0.95) wd=0, clip 1.0, constant",
                  f"Trainer's AdamW (optim in trl_facts) lr={LR} betas=(0.9, 0.95) wd=0, max_grad_norm=1.0, constant"],
    "SFT loss": ["mean -log p over completion tokens (models/losses.sft_loss)",
                 "completion_only_loss=True: labels -100 on the prompt, token mean (fused LM-head log-probs)"],
    "reward-model loss": ["-log sigmoid(r_c - r_r), scored at length-1 (models/losses.bradley_terry_loss)",
                          "-log sigmoid(r_c - r_r), HF's pooling at the last non-pad token"],
    "dtype / device": ["float32 / cpu", "float32 / cpu (use_cpu=True)"],
}


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    rounds, steps = (1, 10) if quick else (3, 40)
    result = {"quick": quick, "what": "seconds per optimizer step (its batch's collation included), ours / TRL 1.16",
              "repetitions": {"rounds": rounds, "timed_steps_per_round_per_side": steps,
                              "warmup_steps_discarded_per_round": WARMUP,
                              "order": "interleaved: after each TRL step (TrainerCallback.on_step_end) one of ours on "
                                       "the same batch, outside TRL's clock; a new trainer and trainee per round"},
              "settings_ours_vs_trl": SETTINGS}
    for stage in ("sft", "reward_model"):
        result[stage] = compare(stage, rounds, steps)
    result["target"] = f"median per-pair time ratio <= {TARGET} for both stages"
    result["target_met"] = all(result[s]["time_ratio_ours_over_trl"]["median"] <= TARGET
                               for s in ("sft", "reward_model"))
    write_result("stages_vs_trl", result)
    return result


if __name__ == "__main__":
    main()
