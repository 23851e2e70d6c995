"""Pure loss functions. Each returns the scalar loss (or per-token losses) and a dict of detached statistics
(TRL/CleanRL names).

The RL actor's loss is assembled from a menu of parts, each a pure function of tensors chosen by name
(docs/algorithms.md has the menu and the recipes built from it). A new variant is one function here and one line in its
registry:

    POLICY_LOSSES   the per-token policy-gradient term: ppo (clip, clip-higher, two-sided `delta`, dual clip), cispo,
                    sapo, vespo, reinforce (no ratio)
    AGGREGATIONS    how per-token losses become one number: token-mean, seq-mean-token-mean, seq-mean-token-sum,
                    seq-mean-token-sum-norm (Dr. GRPO's constant normaliser), each as per-row scales and a per-row
                    normaliser, so the update loop (models/update.py) computes it over the global minibatch whatever
                    the ranks and the micro-batches
    CORRECTIONS     engine/trainer mismatch correction for an engine with its own weights (vLLM): token_truncate,
                    token_mask, sequence_truncate, sequence_mask

`policy_objective` puts them together with the KL in the loss (models/advantages.KL_ESTIMATORS), the entropy bonus,
the high-entropy token mask and the off-policy sequence mask, in TRL 1.16 GRPOTrainer's order (tests/models/
test_trl_conformance.py feeds the same batches to TRL's own loss code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from models.advantages import KL_ESTIMATORS, masked_mean, masked_var


# ---------------------------------------------------------------- the policy-gradient term

@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss sees, for the rows of one micro-batch: per-token tensors are [B, T] over actions."""

    logp: Tensor  # the current policy's logprobs (with a graph)
    old_logp: Tensor  # the behaviour (proximal) policy's, no graph
    advantages: Tensor  # [B, T] (a sequence advantage broadcast over its tokens)
    mask: Tensor  # 1.0 on the tokens that carry a loss
    ratio: Tensor  # pi / pi_old: [B, T] (token level) or [B, 1] (sequence level: exp of the mean log-ratio, GSPO)
    epsilon: float = 0.2  # clip below: 1 - epsilon
    epsilon_high: float = 0.2  # clip above: 1 + epsilon_high (cispo: the cap of its weight itself, as TRL)
    delta: float | None = None  # two-sided clip: the unclipped ratio is capped at delta (INTELLECT-2)
    clip_ratio_c: float | None = None  # dual clip (veRL): negative-advantage terms capped at c * |A|
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    is_weights: Tensor | None = None  # [B, T] the mismatch weights of an engine with its own weights (vespo's own use)


def clip_stats(ratio: Tensor, p: PolicyInputs) -> dict[str, Tensor]:
    """TRL's clip metrics: shares of tokens whose ratio is clipped below (A < 0) or above (A > 0), and either."""
    ratio = ratio.detach().expand_as(p.mask)
    low = ((ratio < 1 - p.epsilon) & (p.advantages < 0)).to(p.mask.dtype)
    high = ((ratio > 1 + p.epsilon_high) & (p.advantages > 0)).to(p.mask.dtype)
    return {"clip_ratio/low_mean": masked_mean(low, p.mask), "clip_ratio/high_mean": masked_mean(high, p.mask),
            "clipfrac": masked_mean(low + high, p.mask)}


def ppo_clip(p: PolicyInputs) -> tuple[Tensor, dict]:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps, 1 + eps_high) A) (Schulman et al. 2017; clip-higher: DAPO),
    with TRL's two-sided clip (the unclipped r capped at `delta`) and veRL's dual clip (a negative-advantage term
    capped at -c A: core_algos.compute_policy_loss_vanilla)."""
    ratio = p.ratio
    capped = torch.clamp(ratio, max=p.delta) if p.delta is not None else ratio
    clipped = torch.clamp(ratio, 1 - p.epsilon, 1 + p.epsilon_high)
    loss = -torch.minimum(capped * p.advantages, clipped * p.advantages)
    stats = clip_stats(capped, p)
    if p.clip_ratio_c is not None:
        dual = torch.minimum(loss, -p.advantages * p.clip_ratio_c)
        stats["clip_ratio/dual_mean"] = masked_mean(((loss > dual) & (p.advantages < 0)).to(p.mask.dtype).detach(),
                                                    p.mask)
        loss = torch.where(p.advantages < 0, dual, loss)
    return loss, stats


def cispo(p: PolicyInputs) -> tuple[Tensor, dict]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, detached importance weight, -sg(min(r, eps_high)) A logp:
    every token keeps a gradient (none is clipped away); the cap is `epsilon_high` itself, as TRL defines it
    (recommended 5.0)."""
    weight = torch.clamp(p.ratio, max=p.epsilon_high).detach()
    stats = {"clipfrac": masked_mean(((p.ratio > p.epsilon_high) & (p.advantages > 0)).expand_as(p.mask)
                                     .to(p.mask.dtype).detach(), p.mask)}
    return -weight * p.advantages * p.logp, stats


def sapo(p: PolicyInputs) -> tuple[Tensor, dict]:
    """SAPO (soft adaptive policy optimisation): a sigmoid gate instead of a hard clip, -(4/tau) sigmoid(tau (r - 1)) A,
    tau = sapo_temperature_pos where A > 0, else sapo_temperature_neg; its slope at r = 1 is PPO's."""
    tau = torch.where(p.advantages > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    return -torch.sigmoid(tau * (p.ratio - 1)) * 4 / tau * p.advantages, {}


VESPO = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}  # TRL 1.16's defaults


def vespo(p: PolicyInputs) -> tuple[Tensor, dict]:
    """VESPO as TRL 1.16 implements it: -phi A logp with a detached per-sequence Gamma weight phi = exp(lambda +
    k log w - lambda w) of the sequence's importance weight w (token log-ratios summed, the log mismatch weights of
    every position added), (k, lambda) by the advantage's sign (VESPO's defaults)."""
    floor = math.log(1e-8)
    with torch.no_grad():
        log_w = (torch.clamp(p.logp - p.old_logp, -20, 20) * p.mask).sum(1, keepdim=True)
        if p.is_weights is not None:
            log_w = log_w + torch.clamp(torch.log(p.is_weights), min=floor, max=20).sum(1, keepdim=True)
        log_w = torch.clamp(log_w, min=floor, max=20)
        positive = p.advantages >= 0
        k = torch.where(positive, VESPO["k_pos"], VESPO["k_neg"])
        lam = torch.clamp(torch.where(positive, VESPO["lambda_pos"], VESPO["lambda_neg"]), min=1e-4)
        phi = torch.nan_to_num(torch.exp(lam + k * log_w - lam * torch.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * p.advantages * p.logp, {"vespo/phi_seq_mean": masked_mean(phi.expand_as(p.mask), p.mask)}


def reinforce(p: PolicyInputs) -> tuple[Tensor, dict]:
    """REINFORCE -logp A: no ratio, no clip (the gradient of the first, on-policy step of every other loss)."""
    return -p.logp * p.advantages, {"clipfrac": torch.zeros((), dtype=p.mask.dtype)}


POLICY_LOSSES: dict[str, Callable[[PolicyInputs], tuple[Tensor, dict]]] = {
    "ppo": ppo_clip, "cispo": cispo, "sapo": sapo, "vespo": vespo, "reinforce": reinforce}


def policy_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """pi / pi_old per token [B, T], or per sequence [B, 1] as GSPO defines it: exp of the mean token log-ratio."""
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


# ---------------------------------------------------------------- aggregation

def token_mean(mask: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """DAPO's token-level mean over the minibatch: every token weighs the same."""
    return torch.ones(mask.shape[0], dtype=mask.dtype), mask.sum(1)


def seq_mean_token_mean(mask: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """GRPO's: each sequence's token mean, then the mean over sequences."""
    return 1 / mask.sum(1).clamp(min=1), torch.ones(mask.shape[0], dtype=mask.dtype)


def seq_mean_token_sum(mask: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Each sequence's token sum, then the mean over sequences (veRL; TRL's luspo)."""
    return torch.ones(mask.shape[0], dtype=mask.dtype), torch.ones(mask.shape[0], dtype=mask.dtype)


def seq_mean_token_sum_norm(mask: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """Dr. GRPO's: the tokens' sum over (sequences x max_new_tokens), a constant normaliser with no length bias."""
    return torch.ones(mask.shape[0], dtype=mask.dtype), torch.full((mask.shape[0],), float(max_len), dtype=mask.dtype)


AGGREGATIONS: dict[str, Callable[[Tensor, int], tuple[Tensor, Tensor]]] = {
    "token-mean": token_mean, "seq-mean-token-mean": seq_mean_token_mean, "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm}


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_len: int) -> Tensor:
    """The loss of one batch: sum_b scale_b sum_t mask * loss / sum_b norm_b (AGGREGATIONS[mode]); the update loop
    computes the same over a minibatch split across ranks and micro-batches."""
    scale, norm = AGGREGATIONS[mode](mask, max_len)
    return (scale.unsqueeze(1) * per_token * mask).sum() / norm.sum().clamp(min=1e-12)


# ---------------------------------------------------------------- engine/trainer mismatch

def token_truncate(log_ratio: Tensor, mask: Tensor, low: float | None, high: float | None) -> Tensor:
    return torch.exp(log_ratio).clamp(min=low, max=high)


def token_mask(log_ratio: Tensor, mask: Tensor, low: float | None, high: float | None) -> Tensor:
    return outside_to_zero(torch.exp(log_ratio), low, high)


def sequence_truncate(log_ratio: Tensor, mask: Tensor, low: float | None, high: float | None) -> Tensor:
    return torch.exp((log_ratio * mask).sum(1, keepdim=True)).clamp(min=low, max=high)


def sequence_mask(log_ratio: Tensor, mask: Tensor, low: float | None, high: float | None) -> Tensor:
    return outside_to_zero(torch.exp((log_ratio * mask).sum(1, keepdim=True)), low, high)


def outside_to_zero(ratio: Tensor, low: float | None, high: float | None) -> Tensor:
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if low is not None:
        keep &= ratio >= low
    if high is not None:
        keep &= ratio <= high
    return torch.where(keep, ratio, torch.zeros_like(ratio))


CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float | None, float | None], Tensor]] = {
    "token_truncate": token_truncate, "token_mask": token_mask, "sequence_truncate": sequence_truncate,
    "sequence_mask": sequence_mask}


def mismatch_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, low: float | None,
                     high: float | None) -> Tensor:
    """Importance weights pi_trainer / pi_engine for rollouts an engine with its own copy of the weights sampled
    (TRL 1.16's vllm_importance_sampling_*): per token [B, T] or per sequence [B, 1] (exp of the summed log-ratio),
    truncated to [low, high] or set to 0 outside it. No gradient."""
    log_ratio = torch.nan_to_num((old_logp - engine_logp) * mask, nan=0.0).detach()
    return CORRECTIONS[mode](log_ratio, mask, low, high)


def mismatch_metrics(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, low: float | None,
                     high: float | None) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the same tokens, as NeMo-RL gates on them
    (token_mult_prob_error: the token mean of exp|log p_train - log p_engine|, 1 when they agree; gen_kl: k3 of
    KL(engine || trainer) per token), and what the correction did: the shares of tokens (token modes) or sequences
    (sequence modes) it masked or clipped. Over the rows given (the caller gathers every rank's)."""
    on = mask > 0
    diff = (old_logp - engine_logp)[on].double()
    out = {"mismatch/token_mult_prob_error": float(torch.exp(diff.abs()).mean()) if len(diff) else 1.0,
           "mismatch/gen_kl": float((torch.expm1(diff) - diff).mean()) if len(diff) else 0.0}
    log_ratio = torch.nan_to_num((old_logp - engine_logp) * mask, nan=0.0)
    if mode.startswith("token"):
        units = torch.exp(log_ratio)[on]
    else:
        units = torch.exp(log_ratio.sum(1))[mask.sum(1) > 0]
    outside = torch.zeros_like(units, dtype=torch.bool)
    if low is not None:
        outside |= units < low
    if high is not None:
        outside |= units > high
    share = float(outside.double().mean()) if len(units) else 0.0
    out["mismatch/masked_frac"] = share if mode.endswith("mask") else 0.0
    out["mismatch/clipped_frac"] = share if mode.endswith("truncate") else 0.0
    return out


# ---------------------------------------------------------------- the masks

def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """[B, T] 1.0 on the tokens whose entropy is at least the (1 - quantile) quantile of the masked tokens' (TRL's
    top_entropy_quantile; Wang et al. 2025, 'the 20% high-entropy forking tokens'); the quantile in float32 with
    linear interpolation, as TRL computes it."""
    values = entropy[mask > 0].float()
    if quantile >= 1 or not len(values):
        return mask.clone() if quantile >= 1 else torch.zeros_like(mask)
    threshold = torch.quantile(values, 1 - quantile)
    return ((entropy * mask >= threshold) & (mask > 0)).to(mask.dtype)


def off_policy_sequence_mask(logp: Tensor, sampling_logp: Tensor, advantages: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """[B, 1] DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): a sequence with a
    negative advantage whose mean KL(sampler || current) per token exceeds `threshold` carries no loss."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    sequence_advantage = advantages[:, :1]
    return ((sequence_advantage >= 0) | (mean_kl <= threshold)).to(mask.dtype)


# ---------------------------------------------------------------- the actor's objective, assembled

@dataclass(frozen=True)
class Menu:
    """The resolved settings of the actor's loss (models/algorithms/recipes.resolve: the config's `loss` and `kl`
    sections over the recipe's values)."""

    policy_loss: str = "ppo"
    importance_sampling_level: str = "token"
    loss_agg_mode: str = "token-mean"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    clip_ratio_c: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None
    kl_in_loss: bool = False
    kl_estimator: str = "k1"
    max_len: int = 1  # generation.max_new_tokens: Dr. GRPO's constant normaliser


def policy_objective(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, menu: Menu,
                     ref_logp: Tensor | None = None, beta: float = 0.0, entropy: Tensor | None = None,
                     entropy_mask: Tensor | None = None, is_weights: Tensor | None = None,
                     engine_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """The actor's per-token loss [B, T] for the rows of a micro-batch, in TRL 1.16 GRPOTrainer's order: the policy
    term (POLICY_LOSSES[menu.policy_loss] on the token- or sequence-level ratio), times the off-policy sequence mask,
    the high-entropy token mask and the mismatch weights; plus beta x the KL to the reference (in the loss, times the
    ratio: TRL's bias-corrected estimate, which none of the masks touch); minus entropy_coef x the entropy on the
    trained tokens (aggregated with the loss, as veRL does). `advantages` [B, T] or [B] (broadcast)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    ratio = policy_ratio(logp, old_logp, mask, menu.importance_sampling_level)
    inputs = PolicyInputs(logp, old_logp, advantages, mask, ratio, menu.epsilon, menu.epsilon_high, menu.delta,
                          menu.clip_ratio_c, menu.sapo_temperature_pos, menu.sapo_temperature_neg, is_weights)
    loss, stats = POLICY_LOSSES[menu.policy_loss](inputs)
    loss = loss.expand_as(logp)
    if menu.off_policy_mask_threshold is not None:
        sampled = engine_logp if engine_logp is not None else old_logp
        loss = loss * off_policy_sequence_mask(logp, sampled, advantages, mask, menu.off_policy_mask_threshold)
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if is_weights is not None and menu.policy_loss != "vespo":  # vespo folds the engine's ratio into its weight
        loss = loss * is_weights
    if menu.kl_in_loss and beta != 0:
        kl = KL_ESTIMATORS[menu.kl_estimator](logp, ref_logp) * ratio
        loss = loss + beta * kl
        stats["kl_loss"] = masked_mean(kl.detach(), mask)
    if menu.entropy_coef and entropy is not None:
        loss = loss - menu.entropy_coef * entropy * (entropy_mask if entropy_mask is not None else 1.0)
    with torch.no_grad():
        log_ratio = (logp - old_logp).detach()
        stats.update(approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
                     ratio=masked_mean(ratio.detach().expand_as(mask), mask))
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = 0.2) -> tuple[Tensor, dict]:
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
        stats = {"loss": loss.detach(), "rewards/chosen": chosen_reward.mean(),
                 "rewards/rejected": rejected_reward.mean(),
                 "rewards/accuracies": (chosen_reward > rejected_reward).to(chosen_reward.dtype).mean(),
                 "rewards/margins": (chosen_reward - rejected_reward).mean(),
                 "logps/chosen": chosen_logps.detach().mean(), "logps/rejected": rejected_logps.detach().mean()}
    return loss, stats
