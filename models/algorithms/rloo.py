"""REINFORCE with a leave-one-out baseline (RLOO; Ahmadian et al. 2024), and the GRPO and REINFORCE++ estimators.

No critic: a reward backend scores k rollouts per prompt (a rank samples all k of each of its prompts, so groups never
split across ranks). reward_with_kl = score - beta * KL(sequence) -> baseline -> loss = -logp * (r_kl - b).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from pydantic import Field, PositiveInt, field_validator

from models.advantages import grpo_advantages, masked_mean, reinforce_plus_plus_advantages, rloo_baseline
from models.algorithms.base import Advantages, Algorithm, StepData
from models.losses import ppo_policy_loss, reinforce_loss
from models.sections import OptimConfig, Section


class ReinforceConfig(Section):
    rollout_batch_size: PositiveInt = Field(16, description="Prompts per iteration; each gets `num_rollouts_per_prompt` samples.")
    num_rollouts_per_prompt: int = Field(4, description="k samples per prompt for the leave-one-out baseline (>= 2).")
    minibatch_size: PositiveInt = Field(32, description="Rollouts per actor optimizer step.")
    epochs: PositiveInt = Field(2, description="Passes over each rollout batch.")
    advantage_estimator: Literal["rloo", "grpo", "reinforce++"] = Field("rloo", description="Baseline/normalisation of sequence rewards.")
    whiten_advantages: bool = Field(False, description="Additionally normalise advantages over the batch.")
    clip_eps: Optional[float] = Field(0.2, gt=0, description="Clip the ratio to the behaviour policy on reused samples (PPO-style, as TRL's RLOO); the first step is plain -logp*A. None: REINFORCE on every step.")
    missing_eos_penalty: Optional[float] = Field(None, description="Subtract this from the score of responses that hit max_new_tokens without EOS.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimiser.")

    @field_validator("num_rollouts_per_prompt")
    @classmethod
    def _k_at_least_two(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be >= 2 for a leave-one-out baseline, got {v}")
        return v


class RLOO(Algorithm):
    name = "rloo"
    section = "reinforce"
    Config = ReinforceConfig
    description = "REINFORCE/RLOO settings."

    def samples_per_prompt(self, settings: ReinforceConfig) -> int:
        return settings.num_rollouts_per_prompt

    def advantages(self, data: StepData, settings: ReinforceConfig) -> Advantages:
        """Sequence reward with KL, then the baseline: within a prompt's group or batch-wide."""
        k = data.samples_per_prompt
        scores = data.scored["scores"]
        if settings.missing_eos_penalty is not None:
            scores = scores - settings.missing_eos_penalty * (~data.is_end).float()
        non_score = -data.beta * data.kl_tokens.sum(1)
        reward_with_kl = scores + non_score
        group_ids = torch.arange(len(scores) // k).repeat_interleave(k)
        if settings.advantage_estimator == "rloo":
            advantages = reward_with_kl - rloo_baseline(reward_with_kl, group_ids)
        elif settings.advantage_estimator == "grpo":
            advantages = grpo_advantages(reward_with_kl, group_ids)
        else:
            advantages = reinforce_plus_plus_advantages(reward_with_kl)
        if settings.whiten_advantages and len(advantages) > 1:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        return Advantages(advantages, scores, non_score)

    def loss(self, data: StepData, adv: Advantages, settings: ReinforceConfig):
        """REINFORCE loss -logp * (r_kl - b). The first optimizer step is on-policy (ratio = 1, the gradient is exactly
        that of -logp * A); later minibatches/epochs reuse the samples, so the ratio to the behaviour policy is kept and
        clipped, as TRL's RLOO does (clip_eps=None: plain REINFORCE throughout)."""
        advantages, mask, old_logp, tis = adv.advantages, data.mask, data.old_logp, data.tis

        def loss_fn(logp, entropy, idx):
            m, a = mask[idx], advantages[idx].unsqueeze(1).expand_as(logp)
            w = tis[idx] if tis is not None else None
            if settings.clip_eps is None:
                loss = reinforce_loss(logp, advantages[idx], m, w)
                log_ratio = logp.detach() - old_logp[idx]
                stats = {"approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, m),
                         "ratio": masked_mean(log_ratio.exp(), m), "clipfrac": torch.zeros(())}
            else:
                loss, stats = ppo_policy_loss(logp, old_logp[idx], a, m, settings.clip_eps, w)
            stats.update(loss=loss.detach(), entropy=masked_mean(entropy.detach(), m))
            return loss, stats
        return loss_fn

    def metrics(self, data: StepData, adv: Advantages, critic_stats) -> dict[str, float]:
        return {"val/advantage_mean": float(adv.advantages.mean()),
                "val/advantage_std": float(adv.advantages.std()) if len(adv.advantages) > 1 else 0.0}
