"""PPO (clipped surrogate, GAE over a critic's values; Schulman et al. 2017, Ziegler et al. 2019), as NeMo-Aligner
runs it: a critic server gives values (and rewards when it carries the reward model) and trains while the actor does.

Per iteration, inside the shared step (models/step.py): critic_infer for every rank's rollouts on rank 0 ->
KL-shaped per-token rewards -> GAE (VAPO's decoupled and length-adaptive lambda when set) -> advantages whitened over
the response tokens of all ranks -> critic_train fired on rank 0 (async) -> the menu's actor loss -> wait for the
critic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, NonNegativeFloat, PositiveInt

from models.advantages import masked_mean
from models.algorithms.base import (Advantages, Algorithm, Backends, StepData, collect_rewards, estimate,
                                    non_score_reward, request_rewards)
from models.losses import explained_variance
from models.sections import OptimConfig, Section


class PPOConfig(Section):
    rollout_batch_size: PositiveInt = Field(64, description="Prompts (= rollouts) per iteration.")
    minibatch_size: PositiveInt = Field(32, description="Rollouts per actor optimizer step.")
    epochs: PositiveInt = Field(2, description="PPO epochs over each rollout batch.")
    gae_lambda: float = Field(
        0.95, ge=0, le=1,
        description="GAE lambda of the policy's advantages (and of the critic's returns, by default).")
    critic_gae_lambda: float | None = Field(
        None, ge=0, le=1,
        description="VAPO's decoupled GAE: the lambda of the critic's returns (VAPO: 1.0); None = gae_lambda.")
    length_adaptive_alpha: NonNegativeFloat = Field(
        0.0, description="VAPO's length-adaptive GAE: each response's lambda = 1 - 1/(alpha x length); 0 = off.")
    discount: float = Field(1.0, ge=0, le=1, description="Discount factor gamma.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimiser.")


class PPO(Algorithm):
    section = "ppo"
    Config = PPOConfig
    needs_critic = True
    wait_phase = "critic_wait"
    description = "PPO's batch, GAE and optimiser settings (its loss: `loss`)."

    def request_scores(self, batch, chunks, backends: Backends):
        """critic_infer per micro-batch (values, and rewards when the reward model is combined); otherwise rewards
        from the reward backend alongside."""
        critic = backends.critic
        values = [critic.infer_async(batch["tokens"][mb], batch["lengths"][mb]) for mb in chunks]
        rewards = None if critic.combined_reward else request_rewards(backends.reward, batch, chunks)

        def collect() -> dict:
            answers = [f.result() for f in values]
            scored = {"scores": torch.cat([r for _, r in answers])} if rewards is None else collect_rewards(rewards)
            return {"values": torch.cat([v for v, _ in answers]), **scored}
        return collect

    def advantages(self, data: StepData, settings: PPOConfig) -> Advantages:
        """KL-shaped per-token rewards (score on the last response token), GAE per sequence, whitening."""
        # value of prefix t, for action t+1
        values = data.scored["values"][:, :data.tokens.shape[1]][:, :-1] * data.mask
        scores = data.scored["scores"].float()
        advantages, returns = estimate(data, scores, values=values, gamma=settings.discount, lam=settings.gae_lambda,
                                       lam_critic=settings.critic_gae_lambda,
                                       length_adaptive_alpha=settings.length_adaptive_alpha)
        return Advantages(advantages, scores, non_score_reward(data), {"values": values, "returns": returns})

    def update_critic(self, data: StepData, adv: Advantages, backends: Backends):
        """critic_train with every rank's rows (the wire layout: [B, L], values of prefixes)."""
        return backends.critic.train_async(data.tokens, F.pad(adv.extra["returns"], (0, 1)),
                                           F.pad(adv.extra["values"], (0, 1)), F.pad(data.mask, (0, 1)))

    def metrics(self, data: StepData, adv: Advantages, critic_stats: dict | None) -> dict[str, float]:
        values, returns, mask = adv.extra["values"], adv.extra["returns"], data.mask
        return {
            "loss/value_avg": critic_stats["loss_mean"],
            "val/clipfrac_avg": critic_stats.get("clipfrac", float("nan")),
            "val/explained_variance": float(explained_variance(values, returns, mask)),
            "val/advantage_mean": float(masked_mean(adv.advantages, mask)),
            "val/return_mean": float(masked_mean(returns, mask)),
            "val/value_mean": float(masked_mean(values, mask)),
            "critic/step": float(critic_stats.get("step", float("nan"))),
            "critic/skipped_steps": float(critic_stats.get("skipped_steps", 0.0)),
        }
