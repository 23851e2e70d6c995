"""Pure tensor functions of the RL math: KL penalties, reward shaping, advantage estimators, KL control.

Conventions: per-token tensors are [B, T] over *actions* (token t+1 predicted from tokens[:t+1]); `mask` is 1.0 on
response tokens (the EOS token included) and 0.0 on prompt and padding. No I/O, no module state except the KL
controller, so every function is unit-tested against a float64 loop in tests/models.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask == 1 (0 where the mask is empty)."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of x over the masked positions (Bessel-corrected by default)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            return torch.zeros((), dtype=x.dtype, device=x.device)
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked positions (Bessel-corrected variance); masked-out positions are
    returned as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(pi || ref) estimate from log-probs of the sampled tokens (Schulman's k1/k2/k3, and |k1|)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # exp(ref - logp) - (ref - logp) - 1, always >= 0 and unbiased for KL(pi || ref)
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of mask [B, T] (0 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).max(dim=1).values


def shape_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token rewards: -beta * KL on every response token, plus the sequence score on the last response token."""
    rewards = -beta * kl * mask
    last = last_token_index(mask)
    has_response = mask.sum(1) > 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.where(has_response, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over [B, T] (Schulman et al. 2016).

    The actions are the masked positions of each row, in order: positions off the mask between two actions (a
    multi-turn episode's environment tokens) are skipped, so the next action's value and advantage carry across
    them; the value after the last action is 0 (terminal). Returns (advantages, returns) with returns = advantages +
    values on the mask, and both 0 off the mask.
    """
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * last_gae
        advantages[:, t] = here * on
        last_gae = torch.where(on > 0, here, last_gae)
        next_value = torch.where(on > 0, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def rloo_baseline(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Leave-one-out baseline: b_i = mean reward of the valid j != i in i's group (same prompt).

    Where a group has fewer than two valid samples (or i itself is invalid and no other valid exists), b_i = r_i,
    so the advantage is zero.
    """
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    same = group_ids.unsqueeze(0) == group_ids.unsqueeze(1)  # [i, j]
    others = same & valid.unsqueeze(0) & ~torch.eye(len(rewards), dtype=torch.bool, device=rewards.device)
    count = others.sum(1)
    total = (others.to(rewards.dtype) * rewards.unsqueeze(0)).sum(1)
    group_valid = (same & valid.unsqueeze(0)).sum(1)
    baseline = total / count.clamp(min=1)
    return torch.where((group_valid >= 2) & (count > 0), baseline, rewards)


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps), std unbiased; groups of one get 0."""
    same = (group_ids.unsqueeze(0) == group_ids.unsqueeze(1)).to(rewards.dtype)
    n = same.sum(1)
    mean = same @ rewards / n
    var = (same * (rewards.unsqueeze(0) - mean.unsqueeze(1)) ** 2).sum(1) / (n - 1).clamp(min=1)
    return torch.where(n > 1, (rewards - mean) / (var.sqrt() + eps), torch.zeros_like(rewards))


def reinforce_plus_plus_advantages(rewards: Tensor, eps: float = 1e-8) -> Tensor:
    """REINFORCE++ (Hu 2025): sequence rewards normalised over the whole batch (global baseline)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


class AdaptiveKLController:
    """Ziegler et al. (2019): beta <- beta * (1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if math.isfinite(current_kl):
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class FixedKLController(AdaptiveKLController):
    def __init__(self, init: float):
        super().__init__(init, target=1.0, horizon=1)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value
