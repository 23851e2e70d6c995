"""RLOO iteration: ours (models.step.train_step, algorithm=rloo) vs TRL 1.16 `RLOOTrainer`, same model, prompts, reward
and settings.

Both sides: the tiny policy, the built-in sentiment prompts, k rollouts per prompt, the same response length and
sampling (temperature, no top-k/top-p), the gold reward function `models.tasks.sentiment:gold_reward` as a Python
reward, the same KL coefficient beta (k1 sequence KL in the reward), AdamW with the same lr/betas/clip, and the same
number of optimizer steps per iteration (TRL: steps_per_generation x num_iterations; ours: epochs x minibatches).

One "iteration" = one generation batch of B prompts x k rollouts plus its optimizer steps. TRL's trainer runs
unchanged (`trainer.train()`); a TrainerCallback marks the end of each of TRL's iterations (on_step_end of its last
optimizer step) and there runs one of our iterations, outside TRL's clock. So the two sides alternate A/B every
iteration and see the same background load. To split TRL's time into phases, a subclass only wraps `_generate`,
`_generate_and_score_completions` and `training_step` with timers, and the callback stamps the optimizer step. Each
round builds a fresh trainer and actor; the first iteration of each side per round is a warm-up and is discarded.

Two modes: "fixed policy" (lr 1e-9 on both sides, the headline) keeps both sides sampling the initial policy, so they
generate the same lengths and do the same work per iteration; "learning" uses the configured lr, where the two
objectives move the response lengths apart (ours shortens them on this task, TRL's lengthens them).
Target: ours <= 0.7x TRL's seconds per iteration (median of the per-pair ratios, fixed policy).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from contextlib import contextmanager

from benchmarks.common import log, quick_flag, stats, tiny_config, top_ops, write_result
from models.loop import build_actor, build_local_reward, load_prompts, prompt_batches
from models.reward import load_reward_function
from models.algorithms import Backends, resolve
from models.step import train_step

GOLD = "models.tasks.sentiment:gold_reward"
TARGET = 0.7
FIXED_POLICY_LR = 1e-9  # both policies stay (numerically) at their start: same response lengths on both sides


def bench_config(lr: float | None = None):
    overrides = {"reward.source": "function", "reward.function": GOLD, "reward.gold": None}
    if lr is not None:
        overrides["reinforce.optim.lr"] = lr
    return tiny_config(algorithm="rloo", **overrides)


def optimizer_steps_per_iteration(cfg) -> int:
    rf = cfg.reinforce
    rollouts = rf.rollout_batch_size * rf.num_rollouts_per_prompt
    return rf.epochs * -(-rollouts // rf.minibatch_size)


# ---------------------------------------------------------------------------------------------------------------- ours
class OurRLOO:
    """Our side: actor, in-process function reward and prompt stream; `iteration()` runs and times one RLOO
    iteration."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.state = build_actor(cfg)
        self.reward = build_local_reward(cfg)
        self.batches = prompt_batches(load_prompts(cfg), cfg.reinforce.rollout_batch_size, cfg.seed)
        # optimizer hooks split the train phase into forward+backward and the optimizer step
        self.optimizer_s, self._step_start = 0.0, 0.0
        self.state.optimizer.register_step_pre_hook(lambda *_: setattr(self, "_step_start", time.perf_counter()))
        self.state.optimizer.register_step_post_hook(lambda *_: setattr(
            self, "optimizer_s", self.optimizer_s + time.perf_counter() - self._step_start))

    def iteration(self) -> dict:
        prompts = next(self.batches)
        self.optimizer_s = 0.0
        start = time.perf_counter()
        metrics, _ = train_step(self.state, prompts, self.cfg, Backends(reward=self.reward))
        seconds = time.perf_counter() - start
        phases = {"generate": metrics["time/generate"],
                  "logprobs+reference+reward": sum(metrics.get(f"time/{p}", 0.0)
                                                   for p in ("logprobs", "reference", "reward_wait")),
                  "loss forward+backward": metrics["time/train"] - self.optimizer_s,
                  "optimizer step": self.optimizer_s}
        phases["other"] = seconds - sum(phases.values())
        return {"seconds": seconds, "tokens": metrics["tokens/generated"], "phases": phases}


# ----------------------------------------------------------------------------------------------------------------- TRL
def trl_args(cfg, output_dir: str, iterations: int):
    """RLOOConfig matching our config; `iterations` generation batches."""
    from trl import RLOOConfig  # optional: the bench extra

    return RLOOConfig(**trl_kwargs(cfg, output_dir, iterations))


def trl_kwargs(cfg, output_dir: str, iterations: int) -> dict:
    """The arguments TRL's RLOOConfig and GRPOConfig share, matching our config; `iterations` generation batches."""
    rf, gen, optim = cfg.reinforce, cfg.generation, cfg.reinforce.optim
    rollouts = rf.rollout_batch_size * rf.num_rollouts_per_prompt
    if rollouts % rf.minibatch_size:
        raise ValueError(f"rollouts per iteration ({rollouts}) must be a multiple of the minibatch "
                         f"({rf.minibatch_size})")
    return dict(
        output_dir=output_dir,
        # batch geometry: one generation batch of B*k rollouts, minibatches of `minibatch_size`, `epochs` passes
        per_device_train_batch_size=rf.minibatch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=rollouts // rf.minibatch_size,
        num_iterations=rf.epochs,
        num_generations=rf.num_rollouts_per_prompt,
        max_steps=optimizer_steps_per_iteration(cfg) * iterations,
        # sampling
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_k=gen.top_k,
        top_p=gen.top_p,
        use_vllm=False,
        # objective
        beta=resolve(cfg).kl_beta,
        epsilon=resolve(cfg).menu.epsilon,
        # optimiser (AdamW, constant schedule, grad clip)
        learning_rate=optim.lr,
        lr_scheduler_type="constant",
        warmup_steps=optim.warmup_steps,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        weight_decay=optim.weight_decay,
        max_grad_norm=optim.grad_clip,
        # precision / device / memory: like ours (float32, CPU, no activation checkpointing, no dropout)
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        # no eval, no logging, no checkpoints
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=cfg.seed,
    )


def run_round(cfg, iterations: int, sides: dict | None = None, trainer_class=None,
              args_for=trl_args) -> tuple[list[dict], dict[str, list[dict]], dict]:
    """TRL's RLOOTrainer (or `trainer_class`, with the config `args_for(cfg, output_dir, iterations)` gives it) for
    `iterations` + 1 generation batches; after each of TRL's iterations, one iteration of each of our sides (default:
    {"ours": OurRLOO(cfg)}).

    Returns (TRL records, {side: records}, facts); the first iteration of every side is a warm-up and is dropped.
    """
    from datasets import Dataset  # optional: comes with trl (the bench extra)
    from transformers import AutoTokenizer, TrainerCallback  # heavy: the Trainer stack, only for the TRL side
    from transformers.trainer_callback import PrinterCallback  # heavy: as above
    from trl import RLOOTrainer  # optional: the bench extra

    gold = load_reward_function(GOLD)
    steps = optimizer_steps_per_iteration(cfg)
    sides = sides or {"ours": OurRLOO(cfg)}
    tokens: list[int] = []
    trl_seconds: list[float] = []
    our_records: dict[str, list[dict]] = {name: [] for name in sides}
    phase_log: list[tuple[int, str, float]] = []  # (TRL iteration, phase, seconds)

    def gold_reward(prompts, completions, completion_ids, **kwargs):
        tokens.append(sum(len(ids) for ids in completion_ids))  # completion tokens up to and including EOS
        return gold(prompts, completions)

    class Interleave(TrainerCallback):
        """TRL's clock runs from the end of our previous iteration to the end of its last optimizer step of the
        generation batch; then one of our iterations runs, outside TRL's clock."""

        def __init__(self):
            self.start = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.start is None:
                self.start = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            phase_log.append((state.global_step // steps, "optimizer", time.perf_counter() - self.optimizer_start))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps == 0:
                trl_seconds.append(time.perf_counter() - self.start)
                for name, side in sides.items():
                    our_records[name].append(side.iteration())
                self.start = time.perf_counter()

    class TimedRLOOTrainer(trainer_class or RLOOTrainer):
        """TRL's trainer, unchanged; timers around its generation, generation+scoring and training steps."""

        @contextmanager
        def _phase(self, name):
            start = time.perf_counter()
            try:
                yield
            finally:
                phase_log.append((self.state.global_step // steps, name, time.perf_counter() - start))

        def _generate(self, prompts):
            with self._phase("generate"):
                return super()._generate(prompts)

        def _generate_and_score_completions(self, inputs):
            with self._phase("rollout"):
                return super()._generate_and_score_completions(inputs)

        def training_step(self, *args, **kwargs):  # _prepare_inputs (the rollout, once per batch), loss, backward
            with self._phase("training_step"):
                return super().training_step(*args, **kwargs)

    policy_path = cfg.local_path("model.policy")
    with tempfile.TemporaryDirectory(prefix="trl-") as out:
        args = args_for(cfg, out, iterations + 1)
        trainer = TimedRLOOTrainer(model=policy_path, reward_funcs=gold_reward, args=args,
                                   train_dataset=Dataset.from_dict({"prompt": load_prompts(cfg)}),
                                   processing_class=AutoTokenizer.from_pretrained(policy_path),
                                   callbacks=[Interleave()])
        trainer.remove_callback(PrinterCallback)  # no metrics dict printed at the end
        facts = {"gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
                 "generation_batch_size": args.generation_batch_size, "steps_per_generation": args.steps_per_generation,
                 "optim": str(getattr(args.optim, "value", args.optim)),
                 "model_dtype": str(trainer.model.dtype), "device": str(trainer.accelerator.device)}
        trainer.train()
    if len(trl_seconds) != iterations + 1 or len(tokens) != iterations + 1:
        raise RuntimeError(f"TRL ran {len(trl_seconds)} iterations and {len(tokens)} generations; "
                           f"expected {iterations + 1}")
    trl_records = []
    for it in range(1, iterations + 1):  # iteration 0 is the warm-up
        phase = {name: sum(s for i, n, s in phase_log if i == it and n == name)
                 for name in ("generate", "rollout", "training_step", "optimizer")}
        phases = {"generate": phase["generate"], "logprobs+reference+reward": phase["rollout"] - phase["generate"],
                  "loss forward+backward": phase["training_step"] - phase["rollout"],
                  "optimizer step": phase["optimizer"]}
        phases["other"] = trl_seconds[it] - sum(phases.values())
        trl_records.append({"seconds": trl_seconds[it], "tokens": tokens[it], "phases": phases})
    return trl_records, {name: records[1:] for name, records in our_records.items()}, facts


# ---------------------------------------------------------------------------------------------------------------- main
def settings_side_by_side(cfg, trl_facts: dict) -> dict:
    rf, gen = cfg.reinforce, cfg.generation
    k, B = rf.num_rollouts_per_prompt, rf.rollout_batch_size
    steps = optimizer_steps_per_iteration(cfg)
    return {
        "prompts per iteration": [B, trl_facts["generation_batch_size"] // k],
        "rollouts per prompt (k / num_generations)": [k, k],
        "rollouts per iteration": [B * k, trl_facts["generation_batch_size"]],
        "rollouts per optimizer step": [rf.minibatch_size, rf.minibatch_size],
        "optimizer steps per iteration": [f"{steps} (epochs={rf.epochs} x {B * k // rf.minibatch_size} minibatches)",
                                          f"{steps} (num_iterations={rf.epochs} x steps_per_generation="
                                          f"{trl_facts['steps_per_generation']})"],
        "max new tokens / max_completion_length": [gen.max_new_tokens, gen.max_new_tokens],
        "temperature, top_k, top_p": [[gen.temperature, gen.top_k, gen.top_p]] * 2,
        "reward": [GOLD + " (FunctionReward)", GOLD + " (reward_funcs callable)"],
        "KL coefficient beta (k1, in the sequence reward)": [resolve(cfg).kl_beta] * 2,
        "optimizer": [f"AdamW lr={rf.optim.lr} betas={tuple(rf.optim.betas)} clip={rf.optim.grad_clip}"] * 2,
        "dtype / device": ["float32 / cpu", f"{trl_facts['model_dtype']} / {trl_facts['device']}"],
        "AdamW implementation": ["torch.optim.AdamW(fused=True)", trl_facts["optim"]],
        "activation checkpointing": [False, trl_facts["gradient_checkpointing"]],
        "loss": [f"PPO-clipped per-token ratio (epsilon={resolve(cfg).menu.epsilon}), token-mean",
                 f"clipped sequence-level ratio, epsilon={resolve(cfg).menu.epsilon}, sequence-mean"],
        "behaviour logprobs": ["kept from sampling (float32)", "recomputed with a forward pass"],
        "logprob forward micro-batch": [gen.micro_batch_size, rf.minibatch_size],
        "generation": ["models.policy.Policy.generate (own KV-cache loop)", "transformers model.generate"],
    }


def summarize(records: list[dict]) -> dict:
    phases = {name: stats([r["phases"][name] for r in records]) for name in records[0]["phases"]}
    return {"seconds_per_iteration": stats([r["seconds"] for r in records]),
            "generated_tokens_per_iteration": stats([r["tokens"] for r in records]),
            "generated_tokens_per_second": stats([r["tokens"] / r["seconds"] for r in records]),
            "phases_seconds": phases}


def compare(cfg, rounds: int, iterations: int, label: str) -> dict:
    """`rounds` fresh trainer+actor pairs, `iterations` interleaved pairs each; summaries and per-pair ratios."""
    ours, trl, per_round = [], [], []
    trl_facts = {}
    for r in range(rounds):
        gc.collect()
        trl_records, by_side, trl_facts = run_round(cfg, iterations)
        ours += by_side["ours"]
        trl += trl_records
        o, t = (statistics.median(x["seconds"] for x in recs) for recs in (by_side["ours"], trl_records))
        per_round.append({"ours_s": o, "trl_s": t, "time_ratio": o / t})
        log(f"rloo_vs_trl ({label}) round {r + 1}/{rounds}: ours {o:.3f} s/it, TRL {t:.3f} s/it, ratio {o / t:.2f}")
    return {
        "settings_ours_vs_trl": settings_side_by_side(cfg, trl_facts),
        "ours": summarize(ours),
        "trl": summarize(trl),
        "per_round": per_round,
        "time_ratio_ours_over_trl": stats([o["seconds"] / t["seconds"] for o, t in zip(ours, trl)]),
        "time_ratio_of_medians": statistics.median(o["seconds"] for o in ours)
        / statistics.median(t["seconds"] for t in trl),
        "tokens_per_second_ratio_ours_over_trl": stats([(o["tokens"] / o["seconds"]) / (t["tokens"] / t["seconds"])
                                                        for o, t in zip(ours, trl)]),
    }


def main(argv=None) -> dict:
    quick = quick_flag(argv)
    rounds, iterations = (1, 8) if quick else (5, 30)
    fixed = compare(bench_config(lr=FIXED_POLICY_LR), rounds, iterations, "fixed policy")
    learning = compare(bench_config(), 1 if quick else 3, iterations, "learning")
    profiled = OurRLOO(bench_config(lr=FIXED_POLICY_LR))
    profiled.iteration()
    ops = top_ops(profiled.iteration, repeat=3)
    result = {
        "quick": quick,
        "what": "seconds per RLOO iteration (generation batch + its optimizer steps), ours / TRL RLOOTrainer",
        "repetitions": {"rounds": rounds, "timed_iterations_per_round_per_side": iterations,
                        "learning_rounds": 1 if quick else 3, "warmup_iterations_discarded_per_round": 1,
                        "order": "interleaved: each TRL iteration is followed by one of ours (run from a "
                                 "TrainerCallback, outside TRL's clock); a new trainer and actor per round"},
        "modes": {"fixed_policy": f"lr={FIXED_POLICY_LR} on both sides: both keep sampling the initial policy, so the "
                                  "response lengths (and the work per iteration) match; every computation still runs "
                                  "(headline, judged against the target)",
                  "learning": "the configured lr on both sides: the two objectives move the policies (and response "
                              "lengths) apart, so the work per iteration differs between the sides"},
        **fixed,
        "learning": learning,
        "ours_top_ops_torch_profiler": ops,
        "target": f"median per-pair time ratio <= {TARGET} (fixed policy)",
        "target_met": fixed["time_ratio_ours_over_trl"]["median"] <= TARGET,
    }
    write_result("rloo_vs_trl", result)
    return result


if __name__ == "__main__":
    main()
