"""What PPO and REINFORCE share: actor state, phase timers, rollout + logprobs, the minibatch update loop, metrics."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from models.advantages import AdaptiveKLController, FixedKLController, kl_penalty, masked_mean
from models.config import KLConfig, OptimConfig, RLHFConfig
from models.loading import make_optimizer
from models.policy import Policy, Rollout


@dataclass
class ActorState:
    """Everything about the actor that a checkpoint must restore."""

    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_ctl: AdaptiveKLController
    generator: torch.Generator  # sampling and minibatch order
    iteration: int = 0
    episode: int = 0  # rollouts consumed so far

    @classmethod
    def create(cls, policy: Policy, optim: OptimConfig, kl: KLConfig, seed: int) -> "ActorState":
        optimizer, scheduler = make_optimizer(policy.trainable_parameters(), optim)
        kl_ctl = AdaptiveKLController(kl.init, kl.target, kl.horizon) if kl.adaptive else FixedKLController(kl.init)
        return cls(policy, optimizer, scheduler, kl_ctl, torch.Generator().manual_seed(seed))

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "kl_ctl": self.kl_ctl.state_dict(), "generator": self.generator.get_state(),
                "iteration": self.iteration, "episode": self.episode}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.generator.set_state(state["generator"])
        self.iteration, self.episode = int(state["iteration"]), int(state["episode"])


class Timers:
    """Wall-clock seconds per phase, reported as time/<phase>."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def needs_logprob_recompute(cfg: RLHFConfig) -> bool:
    """Sampling-time logprobs equal a full recomputation in float32 without dropout; lower precisions recompute."""
    return cfg.generation.recompute_logprobs if cfg.generation.recompute_logprobs is not None else cfg.model.dtype != "float32"


def rollout_logprobs(policy: Policy, rollout: Rollout, cfg: RLHFConfig, timers: Timers,
                     between: Callable[[slice], None] | None = None) -> tuple[Tensor, Tensor]:
    """Old (behaviour) and reference logprobs [B, L-1] per micro-batch; `between(mb)` runs before each micro-batch
    (used to fire remote requests so they overlap with the actor's forward passes)."""
    old, ref = [], []
    recompute = needs_logprob_recompute(cfg)
    temperature = cfg.generation.temperature
    for mb in micro_batches(len(rollout), cfg.generation.micro_batch_size):
        if between is not None:
            between(mb)
        tokens, lengths = rollout.tokens[mb], rollout.lengths[mb]
        with timers("logprobs"):
            if recompute:
                was_training = policy.model.training
                policy.model.eval()  # behaviour logprobs without (LoRA) dropout noise
                with torch.no_grad():
                    old.append(policy.logprobs(tokens, lengths, temperature)[0].cpu())
                policy.model.train(was_training)
            else:
                old.append(rollout.sample_logprobs[mb])
        with timers("reference"):
            ref.append(policy.logprobs(tokens, lengths, temperature, reference=True)[0].cpu())
    mask = rollout.response_mask
    return torch.cat(old) * mask, torch.cat(ref) * mask


def sequence_kl(old_logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str) -> tuple[Tensor, Tensor]:
    """Per-token KL penalty [B, L-1] (chosen estimator) and the per-sequence k1 KL [B] that is reported."""
    return kl_penalty(old_logp, ref_logp, estimator) * mask, ((old_logp - ref_logp) * mask).sum(1)


LossFn = Callable[[Tensor, Tensor | None, Tensor], tuple[Tensor, dict]]


def actor_update(state: ActorState, rollout: Rollout, loss_fn: LossFn, minibatch_size: int, epochs: int,
                 micro_batch_size: int, grad_clip: float, temperature: float, entropy_grad: bool = False) -> dict[str, float]:
    """Epochs x shuffled minibatches; each minibatch is one optimizer step over gradient-accumulated micro-batches.

    `loss_fn(new_logp, entropy, index)` returns the token-mean loss of the rows `index` and detached stats; each
    micro-batch is weighted by its share of the minibatch's response tokens, so the step does not depend on how the
    minibatch is split. The entropy carries a graph only when `entropy_grad` (an entropy bonus is in the loss).
    """
    policy, B = state.policy, len(rollout)
    mask = rollout.response_mask
    policy.model.train()
    sums: dict[str, float] = {}
    counts = 0
    for _ in range(epochs):
        order = torch.randperm(B, generator=state.generator)
        for start in range(0, B, minibatch_size):
            rows = order[start:start + minibatch_size]
            total_tokens = mask[rows].sum().clamp(min=1)
            state.optimizer.zero_grad(set_to_none=True)
            for mb in micro_batches(len(rows), micro_batch_size):
                idx = rows[mb]
                logp, entropy = policy.logprobs(rollout.tokens[idx], rollout.lengths[idx], temperature, with_entropy=True,
                                                entropy_grad=entropy_grad)
                loss, stats = loss_fn(logp.cpu(), entropy.cpu(), idx)
                share = float(mask[idx].sum() / total_tokens)
                (loss * share).backward()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v) * share
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), grad_clip)
            state.optimizer.step()
            state.scheduler.step()
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(grad_norm)
            counts += 1
    return {k: v / counts for k, v in sums.items()}


def common_metrics(state: ActorState, rollout: Rollout, scores: Tensor, gold: Tensor | None, kl_seq: Tensor,
                   non_score: Tensor, old_logp: Tensor, timers: Timers) -> dict[str, float]:
    """Metrics that mean the same for PPO and RLOO (TRL's names where one exists)."""
    mask = rollout.response_mask
    response_tokens = int(rollout.response_lengths.sum())
    metrics = {
        "objective/kl": float(kl_seq.mean()),
        "objective/kl_coef": float(state.kl_ctl.value),
        "objective/entropy": float((-old_logp * mask).sum(1).mean()),
        "objective/non_score_reward": float(non_score.mean()),
        "objective/rlhf_reward": float((scores + non_score).mean()),
        "objective/scores": float(scores.mean()),
        "objective/scores_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "val/num_eos_tokens": float(rollout.is_end.sum()),
        "val/response_length": float(rollout.response_lengths.float().mean()),
        "lr": float(state.scheduler.get_last_lr()[0]),
        "episode": float(state.episode),
        "iteration": float(state.iteration),
        "tokens/generated": float(response_tokens),
    }
    if gold is not None:
        metrics["objective/gold_reward"] = float(gold.mean())
    metrics.update(timers.metrics())
    if "generate" in timers.seconds:
        metrics["throughput/generate_tokens_per_s"] = response_tokens / max(timers.seconds["generate"], 1e-9)
    return metrics


def token_mean(x: Tensor, mask: Tensor) -> float:
    return float(masked_mean(x, mask))
