"""PPO (clipped surrogate, GAE over a critic's values; Schulman et al. 2017, Ziegler et al. 2019), as NeMo-Aligner
runs it: a critic server gives values (and rewards when it carries the reward model) and trains while the actor does.

Per iteration, inside the shared step (models/step.py): critic_infer for every rank's rollouts on rank 0 ->
KL-shaped per-token rewards -> GAE -> advantages whitened over the response tokens of all ranks -> critic_train fired
on rank 0 (async) -> clipped-surrogate actor update (+ entropy bonus) -> wait for the critic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field, PositiveInt

from models.advantages import gae, masked_mean, masked_whiten, shape_rewards
from models.algorithms.base import Advantages, Algorithm, Backends, StepData, collect_rewards, request_rewards
from models.losses import entropy_bonus, explained_variance, ppo_policy_loss
from models.sections import OptimConfig, Section


class PPOConfig(Section):
    rollout_batch_size: PositiveInt = Field(64, description="Prompts (= rollouts) per iteration.")
    minibatch_size: PositiveInt = Field(32, description="Rollouts per actor optimizer step.")
    epochs: PositiveInt = Field(2, description="PPO epochs over each rollout batch.")
    ratio_eps: float = Field(0.2, gt=0, description="Clip range of the policy ratio.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    discount: float = Field(1.0, ge=0, le=1, description="Discount factor gamma.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    whiten_advantages: bool = Field(True, description="Normalise advantages over the response tokens of the batch.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Actor optimiser.")


class PPO(Algorithm):
    name = "ppo"
    section = "ppo"
    Config = PPOConfig
    needs_critic = True
    wait_phase = "critic_wait"
    description = "PPO actor settings."

    def entropy_grad(self, settings: PPOConfig) -> bool:
        return settings.entropy_coef > 0

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
        mask = data.mask
        values = data.scored["values"][:, :data.tokens.shape[1]][:, :-1] * mask  # value of prefix t, for action t+1
        scores = data.scored["scores"].float()
        rewards = shape_rewards(scores, data.kl_tokens, mask, data.beta)
        advantages, returns = gae(rewards, values, mask, settings.discount, settings.gae_lambda)
        if settings.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        return Advantages(advantages, scores, (-data.beta * data.kl_tokens).sum(1),
                          {"values": values, "returns": returns})

    def update_critic(self, data: StepData, adv: Advantages, backends: Backends):
        """critic_train with every rank's rows (the wire layout: [B, L], values of prefixes)."""
        return backends.critic.train_async(data.tokens, F.pad(adv.extra["returns"], (0, 1)),
                                           F.pad(adv.extra["values"], (0, 1)), F.pad(data.mask, (0, 1)))

    def loss(self, data: StepData, adv: Advantages, settings: PPOConfig):
        """Clipped surrogate (+ entropy bonus) on the rows `idx`."""
        def loss_fn(logp, entropy, idx):
            m = data.mask[idx]
            loss, stats = ppo_policy_loss(logp, data.old_logp[idx], adv.advantages[idx], m, settings.ratio_eps,
                                         data.tis[idx] if data.tis is not None else None)
            if settings.entropy_coef > 0:
                loss = loss + entropy_bonus(entropy, m, settings.entropy_coef)
            stats["loss"] = loss.detach()
            stats["entropy"] = masked_mean(entropy.detach(), m)
            return loss, stats
        return loss_fn

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
