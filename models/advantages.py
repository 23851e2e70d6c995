"""Pure tensor functions of the RL math: KL estimators, reward shaping, advantage estimators (ADVANTAGE_ESTIMATORS,
chosen by name: a new one is one function and one line there), KL control.

Conventions: per-token tensors are [B, T] over *actions* (token t+1 predicted from tokens[:t+1]); `mask` is 1.0 on
response tokens (the EOS token included) and 0.0 on prompt and padding. No I/O, no module state except the KL
controller, so every function is unit-tested against a float64 loop in tests/models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

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


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """log pi - log pi_ref: unbiased for KL(pi || ref) under samples of pi; in the reward its gradient is the KL's."""
    return logp - ref_logp


def k_abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return (logp - ref_logp).abs()


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """0.5 (log pi - log pi_ref)^2: in the loss, its gradient is that of KL(pi || ref) (Schulman's k2)."""
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased for KL(pi || ref) with a low variance (TRL's, unclamped)."""
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio


def k3_plus(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """veRL's straight-through k3+: the value of k3 (as veRL clamps it: its input to +-20, itself to +-10), the
    gradient of k2, which is unbiased for the KL's gradient in the loss (core_algos.kl_penalty, '+' variants)."""
    log_ratio = torch.clamp(ref_logp - logp, -20, 20)
    forward = torch.clamp(torch.expm1(log_ratio) - log_ratio, -10, 10)
    backward = k2(logp, ref_logp)
    return backward - backward.detach() + forward.detach()


KL_ESTIMATORS = {"k1": k1, "abs": k_abs, "k2": k2, "k3": k3, "k3+": k3_plus}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(pi || ref) estimate from log-probs of the sampled tokens (KL_ESTIMATORS[estimator])."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of mask [B, T] (0 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).max(dim=1).values


def shape_scores(scores: Tensor, is_end: Tensor, lengths: Tensor, missing_eos_penalty: float | None = None,
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0, max_len: int = 1) -> Tensor:
    """The sequence scores [B] as the objective sees them: minus `missing_eos_penalty` for a response cut at max_len
    (TRL's RLOO), plus DAPO's soft overlong punishment min(-(l - (max_len - buffer)) / buffer x factor, 0) of a
    response of l tokens (veRL's DAPO reward manager; 0 = off)."""
    out = scores.clone()
    if missing_eos_penalty is not None:
        out = out - missing_eos_penalty * (~is_end.bool()).to(out.dtype)
    if overlong_buffer_len:
        excess = lengths.to(out.dtype) - (max_len - overlong_buffer_len)
        out = out + torch.clamp(-excess / overlong_buffer_len * overlong_penalty_factor, max=0)
    return out


def shape_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token rewards: -beta * KL on every response token, plus the sequence score on the last response token."""
    rewards = -beta * kl * mask
    last = last_token_index(mask)
    has_response = mask.sum(1) > 0
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += torch.where(has_response, scores.to(rewards.dtype), torch.zeros_like(rewards[:, 0]))
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
        lam: float | Tensor = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over [B, T] (Schulman et al. 2016); `lam` a number or one per row [B]
    (VAPO's length-adaptive lambda).

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


def group_mean_std(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Each sample's group mean and unbiased group std [B] (groups: `group_size` consecutive samples)."""
    groups = rewards.view(-1, group_size)
    mean = groups.mean(1, keepdim=True).expand_as(groups).reshape(-1)
    std = (groups.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(groups)).expand_as(groups).reshape(-1)
    return mean, std


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """sum_{s >= t} gamma^(s-t) r_s over the actions of each row (positions off the mask are skipped, carrying the
    sum across them, as in `gae`); 0 off the mask."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        out[:, t] = running * mask[:, t]
    return out


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator sees, over the rows of all ranks (k consecutive samples per prompt)."""

    scores: Tensor  # [B] the sequence scores (after the score shaping: missing EOS, overlong)
    kl: Tensor  # [B, T] the per-token KL penalty (the configured estimator), 0 off the mask
    beta: float  # its coefficient in the reward (0 when the KL is in the loss)
    mask: Tensor  # [B, T] the actions
    group_size: int = 1
    values: Tensor | None = None  # [B, T] the critic's values of the prefixes (gae)
    gamma: float = 1.0
    lam: float = 0.95
    lam_critic: float | None = None  # VAPO: the critic's returns with their own lambda (None: lam)
    length_adaptive_alpha: float = 0.0  # VAPO: > 0 gives each row lambda = 1 - 1 / (alpha x its length)
    scale_rewards: str = "group"


@dataclass(frozen=True)
class AdvantageOutputs:
    advantages: Tensor  # [B, T], 0 off the mask
    returns: Tensor | None = None  # [B, T] the critic's targets (gae)


def sequence_rewards(inp: AdvantageInputs) -> Tensor:
    """Score - beta x the sequence's KL (the KL-shaped reward of a sequence)."""
    return inp.scores - inp.beta * inp.kl.sum(1)


def gae_estimator(inp: AdvantageInputs) -> AdvantageOutputs:
    """PPO's GAE over KL-shaped per-token rewards (the score on the last action), with VAPO's decoupled lambda: the
    policy's advantages from `lam` (or per row 1 - 1/(alpha l), l its length, when length_adaptive_alpha > 0), the
    critic's returns from `lam_critic` (VAPO: 1.0), as NeMo-RL's GeneralizedAdvantageEstimator."""
    rewards = shape_rewards(inp.scores, inp.kl, inp.mask, inp.beta)
    lam: float | Tensor = inp.lam
    if inp.length_adaptive_alpha > 0:
        lam = torch.clamp(1 - 1 / torch.clamp(inp.length_adaptive_alpha * inp.mask.sum(1), min=1), 0, 1)
    advantages, returns = gae(rewards, inp.values, inp.mask, inp.gamma, lam)
    critic_lam = inp.lam if inp.lam_critic is None else inp.lam_critic
    if inp.length_adaptive_alpha > 0 or critic_lam != inp.lam:
        returns = gae(rewards, inp.values, inp.mask, inp.gamma, critic_lam)[1]
    return AdvantageOutputs(advantages, returns)


def rloo_estimator(inp: AdvantageInputs) -> AdvantageOutputs:
    """RLOO (Ahmadian et al. 2024): the KL-shaped sequence reward minus the mean of the other k-1 in its group."""
    rewards = sequence_rewards(inp)
    groups = torch.arange(len(rewards) // inp.group_size).repeat_interleave(inp.group_size)
    return AdvantageOutputs(broadcast(rewards - rloo_baseline(rewards, groups), inp.mask))


GRPO_EPS = 1e-4  # TRL 1.16 adds it to the std


def grpo_estimator(inp: AdvantageInputs) -> AdvantageOutputs:
    """GRPO (Shao et al. 2024) as TRL 1.16 computes it: (r - group mean) / (std + 1e-4), the std unbiased, of the
    group ('group'), of the whole batch ('batch', the group mean still subtracted), or none ('none': Dr. GRPO)."""
    rewards = sequence_rewards(inp)
    mean, std = group_mean_std(rewards, inp.group_size)
    centred = rewards - mean
    if inp.scale_rewards == "group":
        centred = centred / (std + GRPO_EPS)
    elif inp.scale_rewards == "batch":
        centred = centred / ((rewards.std() if len(rewards) > 1 else torch.zeros(())) + GRPO_EPS)
    elif inp.scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {inp.scale_rewards!r}")
    return AdvantageOutputs(broadcast(centred, inp.mask))


def reinforce_pp_estimator(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++ (Hu 2025) as veRL computes it: the reward-to-go of the KL-shaped per-token rewards (the score
    on the last action), whitened over the batch's response tokens; no critic, no group."""
    returns = reward_to_go(shape_rewards(inp.scores, inp.kl, inp.mask, inp.beta), inp.mask, inp.gamma)
    return AdvantageOutputs(masked_whiten(returns, inp.mask))


def reinforce_pp_baseline_estimator(inp: AdvantageInputs) -> AdvantageOutputs:
    """REINFORCE++-baseline (Hu 2025; veRL's reinforce_plus_plus_baseline): the KL-shaped sequence reward minus its
    group's mean, over the response tokens, whitened over the batch's response tokens."""
    rewards = sequence_rewards(inp)
    return AdvantageOutputs(masked_whiten(broadcast(rewards - group_mean_std(rewards, inp.group_size)[0], inp.mask),
                                          inp.mask))


ADVANTAGE_ESTIMATORS: dict[str, Callable[[AdvantageInputs], AdvantageOutputs]] = {
    "gae": gae_estimator, "rloo": rloo_estimator, "grpo": grpo_estimator, "reinforce_pp": reinforce_pp_estimator,
    "reinforce_pp_baseline": reinforce_pp_baseline_estimator}


def broadcast(sequence_values: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T] on the mask."""
    return sequence_values.to(mask.dtype).unsqueeze(1) * mask


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
