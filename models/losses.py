"""Pure loss functions. Each returns the scalar loss and a dict of detached statistics (TRL/CleanRL names)."""

from __future__ import annotations

import torch
from torch import Tensor

from models.advantages import masked_mean, masked_var


def tis_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling weights [B, T]: min(pi_trainer_old / pi_engine, cap) per response token (0 off the
    mask), for rollouts sampled by an engine with its own copy of the weights (veRL's and TRL's TIS). No gradient."""
    return torch.exp(old_logp - engine_logp).clamp(max=cap).detach() * mask


def ppo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ratio_eps: float = 0.2,
                    weights: Tensor | None = None) -> tuple[Tensor, dict]:
    """PPO clipped surrogate: mean over response tokens of max(-A*r, -A*clip(r, 1-eps, 1+eps)), each token's term
    times `weights` when given (truncated importance sampling: tis_weights)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - ratio_eps, 1.0 + ratio_eps)
    per_token = torch.maximum(unclipped, clipped)
    loss = masked_mean(per_token if weights is None else per_token * weights, mask)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            # approx KL(old || new), the low-variance k3 estimator (CleanRL's approx_kl)
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
            "ratio": masked_mean(ratio, mask),
        }
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float | None = 0.2) -> tuple[Tensor, dict]:
    """Clipped value loss: 0.5 * mean(max((v - R)^2, (clip(v, v_old +- c) - R)^2)); unclipped when clip is None."""
    unclipped = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * masked_mean(unclipped, mask)
        clipfrac = torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (clipped_values - returns) ** 2
        loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
        clipfrac = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss, {"clipfrac": clipfrac}


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """-coef * mean entropy over response tokens (add to the loss to encourage exploration)."""
    return -coef * masked_mean(entropy, mask)


def reinforce_loss(logp: Tensor, advantages: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    """REINFORCE with a baseline: mean over response tokens of -logp_t * (r_kl - b), one advantage per sequence [B];
    each token's term times `weights` when given (truncated importance sampling: tis_weights)."""
    per_token = -logp * advantages.unsqueeze(1)
    return masked_mean(per_token if weights is None else per_token * weights, mask)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / Var(R) over the mask (CleanRL's explained_variance)."""
    var_returns = masked_var(returns, mask)
    return 1.0 - masked_var(returns - values, mask) / var_returns.clamp(min=1e-12)


# ---------------------------------------------------------------- the stages before RL (models/stages/)

def completion_mask(prompt_lengths: Tensor, lengths: Tensor, width: int) -> Tensor:
    """[B, width-1] float over next-token positions of right-padded rows: 1 where tokens[:, t+1] is a completion token
    (at or after the prompt's end, before the row's length), so the prompt and the padding carry no loss."""
    positions = torch.arange(1, width, device=lengths.device).unsqueeze(0)
    return ((positions >= prompt_lengths.unsqueeze(1)) & (positions < lengths.unsqueeze(1))).float()


def sft_loss(logp: Tensor, mask: Tensor) -> tuple[Tensor, dict]:
    """Completion-only SFT: the mean over completion tokens of -log p(token | prefix) (`mask` from completion_mask),
    TRL SFTTrainer's loss with completion_only_loss (its token mean over the batch)."""
    loss = masked_mean(-logp, mask)
    return loss, {"loss": loss.detach()}


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None,
                       center_rewards_coefficient: float | None = None) -> tuple[Tensor, dict]:
    """Bradley-Terry reward-model loss over pairs [B], as TRL's RewardTrainer defines it:
    -mean(log sigmoid(r_chosen - r_rejected - margin)) (margin 0 when not given), plus
    center_rewards_coefficient * mean((r_chosen + r_rejected)^2) when set (Eisenstein et al. 2023: rewards are
    defined only up to a shift; this pins their mean near 0)."""
    difference = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -torch.nn.functional.logsigmoid(difference).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss, {"loss": loss.detach(), **reward_metrics(chosen.detach(), rejected.detach())}


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """What TRL's RewardTrainer logs, with its names: accuracy (share of pairs with r_chosen > r_rejected), margin
    (mean r_chosen - r_rejected), min/mean/max_reward (over both rewards of every pair)."""
    both = torch.cat([chosen, rejected])
    return {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "min_reward": both.min(), "mean_reward": both.mean(), "max_reward": both.max()}


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
             beta: float, loss_type: str = "sigmoid", chosen_tokens: Tensor | None = None,
             rejected_tokens: Tensor | None = None) -> tuple[Tensor, dict]:
    """Direct preference optimisation over pairs [B], as TRL 1.16's DPOTrainer computes it, from each completion's
    log-probability summed over its tokens under the policy and the frozen reference:

        log-ratio  h = log pi(y) - log pi_ref(y)            (chosen: h_w, rejected: h_l)
        'sigmoid'  -mean(log sigmoid(beta (h_w - h_l)))      (Rafailov et al. 2023)
        'ipo'      mean((h_w / n_w - h_l / n_l - 1 / (2 beta))^2)   (Azar et al. 2023; n: completion tokens, TRL's
                   length normalisation)

    Stats with TRL's names: rewards/chosen and rewards/rejected (the mean implicit reward beta h), rewards/accuracies
    (share of pairs whose chosen implicit reward exceeds the rejected one's), rewards/margins (mean beta (h_w - h_l)),
    logps/chosen and logps/rejected (the mean summed log-probabilities under the policy)."""
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        per_pair = -torch.nn.functional.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss: loss_type='ipo' needs the completions' token counts")
        per_pair = (chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
                    - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type: {loss_type!r} is not 'sigmoid' or 'ipo'")
    loss = per_pair.mean()
    with torch.no_grad():
        chosen_reward, rejected_reward = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
        stats = {"loss": loss.detach(), "rewards/chosen": chosen_reward.mean(), "rewards/rejected": rejected_reward.mean(),
                 "rewards/accuracies": (chosen_reward > rejected_reward).to(chosen_reward.dtype).mean(),
                 "rewards/margins": (chosen_reward - rejected_reward).mean(),
                 "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean()}
    return loss, stats
