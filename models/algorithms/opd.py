"""On-policy distillation (`algorithm: opd`): the student samples, a teacher (model.teacher) scores the student's own
tokens, and the per-token reverse KL sample log pi_teacher - log pi_student is each token's advantage (Agarwal et al.
2024, GKD's on-policy case; Thinking Machines 2025; veRL's distillation with use_policy_gradient and prime-rl's OPD
compute the same), optionally plus loss.task_reward_weight x the task reward's advantages (the recipe's estimator,
rloo). The teacher runs where the reward model does: in this process, or in the run's reward server behind the
run's secret (its `teacher_logprobs` model), on the student's token ids, so the tokenizers must match (checked
before anything loads, models/prepare.py).

Why the sampled-token signal and not a full-vocabulary divergence (TRL's DistillationTrainer back-propagates a
generalised JSD over the vocabulary): the teacher then answers one logprob per token, a [B, T] tensor over HTTP
instead of [B, T, V], so it can be a server of its own like the reward model; the signal goes through the same
policy objective (clipping, aggregation, mismatch correction) as every recipe's.
"""

from __future__ import annotations

import torch

from models.advantages import masked_mean
from models.algorithms.base import Advantages, Backends, StepData, collect_rewards, estimate, request_rewards
from models.algorithms.group import Group, ReinforceConfig

TEACHER_SIGNAL_CLAMP = 10.0  # |log pi_teacher - log pi_student| per token is clamped to this (veRL's loss_max_clamp)


def teacher_advantages(old_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] the negated per-token reverse-KL sample, log pi_teacher - log pi_student of each sampled token."""
    return torch.clamp(teacher_logp - old_logp, -TEACHER_SIGNAL_CLAMP, TEACHER_SIGNAL_CLAMP) * mask


class OPD(Group):
    needs_teacher = True

    def request_scores(self, batch, chunks, backends: Backends):
        """The task rewards and the teacher's logprobs of every rank's rollouts, per micro-batch (one server)."""
        rewards = request_rewards(backends.reward, batch, chunks)
        teacher = [backends.reward.teacher_logprobs_async(batch["tokens"][mb], batch["lengths"][mb]) for mb in chunks]

        def collect() -> dict:
            width = batch["tokens"].shape[1] - 1
            parts = [f.result() for f in teacher]
            logp = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]).float()
            return {**collect_rewards(rewards), "teacher_logp": logp}
        return collect

    def advantages(self, data: StepData, settings: ReinforceConfig) -> Advantages:
        teacher_logp = data.scored["teacher_logp"][:, :data.mask.shape[1]]
        advantages = teacher_advantages(data.old_logp, teacher_logp, data.mask)
        scores = data.scored["scores"].float()
        if data.settings.task_reward_weight:
            task, _ = estimate(data, scores)
            advantages = advantages + data.settings.task_reward_weight * task
        return Advantages(advantages, scores, torch.zeros(len(scores)), {"teacher_logp": teacher_logp})

    def metrics(self, data: StepData, adv: Advantages, critic_stats) -> dict[str, float]:
        reverse_kl = (data.old_logp - adv.extra["teacher_logp"]) * data.mask
        return {**super().metrics(data, adv, critic_stats),
                "opd/reverse_kl": float(reverse_kl.sum() / data.mask.sum().clamp(min=1)),
                "opd/reverse_kl_seq": float(reverse_kl.sum(1).mean()),
                "opd/teacher_logp": float(masked_mean(adv.extra["teacher_logp"], data.mask))}
