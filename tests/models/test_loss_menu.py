"""The loss menu's parts that TRL does not have (its own are checked against TRL's code in test_trl_conformance.py),
each against a float64 reference of the formula as veRL or NeMo-RL write it, written here from their code (the file
and line read are cited); the mismatch correction and its metrics; and the aggregation, which must give one
minibatch loss whatever the micro-batches (the ranks: tests/models/test_distributed.py)."""

from __future__ import annotations

import math

import pytest
import torch

from models.advantages import (AdvantageInputs, gae_estimator, k2, k3_plus, masked_whiten,
                               reinforce_pp_baseline_estimator, reinforce_pp_estimator, rloo_estimator, shape_scores)
from models.losses import (AGGREGATIONS, CORRECTIONS, Menu, aggregate, high_entropy_mask, mismatch_metrics,
                           mismatch_weights, policy_objective)
from models.update import minibatch_update

pytestmark = pytest.mark.fast
F64 = torch.float64


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(sum(map(ord, request.node.name)))


def ragged(B: int, T: int, gen) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    lengths[0] = T
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)


def batch(gen, B=6, T=8):
    mask = ragged(B, T, gen)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3 * mask
    logp = (old + 0.5 * torch.randn(B, T, generator=gen, dtype=F64) * mask).requires_grad_(True)
    adv = torch.randn(B, generator=gen, dtype=F64).unsqueeze(1) * mask
    return logp, old, adv, mask


def test_the_dual_clip_is_verl_s(gen):
    """veRL's compute_policy_loss_vanilla (verl/trainer/ppo/core_algos.py L1285-1378 @1dda039): the pessimistic
    clipped loss, and where A < 0 its minimum with -A x clip_ratio_c; loss and gradient per token."""
    logp, old, adv, mask = batch(gen)
    c, eps_low, eps_high = 1.5, 0.2, 0.28
    menu = Menu(epsilon=eps_low, epsilon_high=eps_high, clip_ratio_c=c)
    ours = aggregate(policy_objective(logp, old, adv, mask, menu)[0], mask, "token-mean", 1)
    (grad,) = torch.autograd.grad(ours, logp)
    x = logp.detach().clone().requires_grad_(True)
    r = torch.exp(torch.clamp(x - old, -20, 20))
    clipped = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - eps_low, 1 + eps_high))
    theirs = torch.where(adv < 0, torch.minimum(clipped, -adv * c), clipped)
    theirs = (theirs * mask).sum() / mask.sum()
    (their_grad,) = torch.autograd.grad(theirs, x)
    assert ((adv < 0) & (clipped > -adv * c) & (mask > 0)).any()  # the dual clip binds somewhere
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, their_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_each_aggregation_is_verl_s_agg_loss(gen, mode):
    """veRL's agg_loss (core_algos.py L1140-1207 @1dda039) on one data-parallel rank, global_batch_size = B and
    loss_scale_factor = the maximum response length (Dr. GRPO's constant): token-mean sum S / sum m;
    seq-mean-token-sum sum_i S_i / B; seq-mean-token-mean sum_i S_i / n_i / B; seq-mean-token-sum-norm
    sum_i S_i / B / L. veRL adds 1e-8 to n_i where ours clamps it at 1 (the same on non-empty rows)."""
    B, T = 7, 9
    mask = ragged(B, T, gen)
    loss = torch.randn(B, T, generator=gen, dtype=F64)
    S, n = (loss * mask).sum(1), mask.sum(1)
    expected = {"token-mean": S.sum() / mask.sum(), "seq-mean-token-sum": S.sum() / B,
                "seq-mean-token-mean": (S / (n + 1e-8)).sum() / B, "seq-mean-token-sum-norm": S.sum() / B / T}[mode]
    torch.testing.assert_close(aggregate(loss, mask, mode, T), expected, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_the_minibatch_loss_and_step_are_the_same_whatever_the_micro_batches(gen, mode):
    """The update loop weighs each micro-batch by its rows' share of the minibatch's weight: the optimizer step of a
    minibatch is the one of the whole aggregate, for micro-batches of 1, 2, 3 or all rows (float64, 1e-12)."""
    B, T, D = 6, 5, 4
    mask = ragged(B, T, gen)
    features = torch.randn(B, T, D, generator=gen, dtype=F64)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * mask
    adv = torch.randn(B, generator=gen, dtype=F64)
    menu = Menu(loss_agg_mode=mode, epsilon_high=0.28, max_len=T)
    scale, norm = AGGREGATIONS[mode](mask, T)
    results = []
    for micro in (1, 2, 3, B):
        weights = torch.nn.Parameter(torch.zeros(D, dtype=F64))
        optimizer = torch.optim.SGD([weights], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

        def micro_loss(idx):
            logp = torch.log_softmax(features[idx] @ weights, dim=-1) + old[idx]  # any differentiable logprobs
            per_token, stats = policy_objective(logp, old[idx], adv[idx], mask[idx], menu)
            m = mask[idx]
            return (scale[idx].unsqueeze(1) * per_token * m).sum() / norm[idx].sum().clamp(min=1e-12), stats

        stats = minibatch_update([weights], optimizer, scheduler, micro_loss, norm, torch.arange(B), B, B, 1, micro,
                                 1e9, torch.Generator().manual_seed(0))
        results.append((weights.detach().clone(), stats["ratio"]))
    logp = torch.log_softmax(features @ torch.zeros(D, dtype=F64), dim=-1) + old
    whole = aggregate(policy_objective(logp, old, adv, mask, menu)[0], mask, mode, T)
    assert float(whole.abs()) > 0
    for weights, _ in results[1:]:
        torch.testing.assert_close(weights, results[0][0], rtol=1e-12, atol=1e-14)
    assert float(results[0][0].abs().max()) > 1e-6  # the step moved the weights


def test_k3_plus_has_k3_s_value_and_k2_s_gradient():
    """veRL's straight-through k3+ (core_algos.kl_penalty L2187-2213, kl_penalty_forward L2215-2251 @1dda039): the
    value of the clamped k3 (its input to +-20, itself to +-10), the gradient of k2, (lp - lp_ref)."""
    logp = torch.tensor([-0.5, -2.0, -7.0, -0.1], dtype=F64, requires_grad=True)
    ref = torch.tensor([-0.7, -1.0, -0.5, -0.1], dtype=F64)
    value = k3_plus(logp, ref)
    u = torch.clamp(ref - logp.detach(), -20, 20)
    torch.testing.assert_close(value.detach(), torch.clamp(torch.exp(u) - u - 1, -10, 10), rtol=1e-12, atol=1e-14)
    assert value[2].item() == 10.0  # the clamp binds: exp(6.5) - 7.5 > 10
    (grad,) = torch.autograd.grad(value.sum(), logp)
    (k2_grad,) = torch.autograd.grad(k2(logp, ref).sum(), logp)
    torch.testing.assert_close(grad, logp.detach() - ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, k2_grad)


def gae_reference(rewards, values, mask, gamma, lam):
    """A float64 loop over each row's actions (NeMo-RL's GeneralizedAdvantageEstimator, advantage_estimator.py
    L523-547 @7ea279a: masked positions carry the next action's value and advantage)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        lam_b = lam[b] if isinstance(lam, list) else lam
        last, next_value = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b, t] == 0:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam_b * last
            adv[b, t] = last
            next_value = values[b, t]
    return adv


def test_vapo_s_decoupled_and_length_adaptive_gae(gen):
    """VAPO (Yue et al. 2025) as NeMo-RL computes it (advantage_estimator.py L412-490 @7ea279a): the critic's
    returns from lam_critic, the policy's advantages from lambda_i = clamp(1 - 1/clamp(alpha l_i, 1), 0, 1)."""
    B, T = 5, 9
    mask = ragged(B, T, gen)
    values = torch.randn(B, T, generator=gen, dtype=F64) * mask
    scores = torch.randn(B, generator=gen, dtype=F64)
    kl = torch.randn(B, T, generator=gen, dtype=F64).abs() * mask * 0.1
    inp = AdvantageInputs(scores, kl, 0.05, mask, values=values, gamma=1.0, lam=0.95, lam_critic=1.0,
                          length_adaptive_alpha=0.3)
    out = gae_estimator(inp)
    rewards = -0.05 * kl * mask
    for b in range(B):
        last = int(mask[b].nonzero().max())
        rewards[b, last] += scores[b]
    lengths = mask.sum(1).tolist()
    lam_policy = [min(max(1 - 1 / max(0.3 * n, 1), 0.0), 1.0) for n in lengths]
    assert len(set(lam_policy)) > 1  # rows of other lengths get other lambdas
    torch.testing.assert_close(out.advantages, gae_reference(rewards, values, mask, 1.0, lam_policy), rtol=1e-12,
                               atol=1e-12)
    returns = (gae_reference(rewards, values, mask, 1.0, 1.0) + values) * mask
    torch.testing.assert_close(out.returns, returns, rtol=1e-12, atol=1e-12)


def verl_whiten(x, mask):
    """veRL's masked_whiten (verl/utils/torch_functional.py L294-346 @1dda039): Bessel-corrected token statistics,
    (x - mean) * rsqrt(var + 1e-8)."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def test_reinforce_pp_is_verl_s(gen):
    """veRL's reinforce_plus_plus (core_algos.py L693-731 @1dda039): the reward-to-go (gamma 1) of the KL-shaped
    token rewards, the score on the last action, whitened over the response tokens."""
    B, T = 6, 7
    mask = ragged(B, T, gen)
    scores = torch.randn(B, generator=gen, dtype=F64)
    kl = torch.randn(B, T, generator=gen, dtype=F64) * mask
    out = reinforce_pp_estimator(AdvantageInputs(scores, kl, 0.1, mask)).advantages
    rewards = -0.1 * kl * mask
    for b in range(B):
        rewards[b, int(mask[b].nonzero().max())] += scores[b]
    returns = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                running = rewards[b, t] + running
                returns[b, t] = running
    torch.testing.assert_close(out, verl_whiten(returns, mask) * mask, rtol=1e-10, atol=1e-12)


def test_reinforce_pp_baseline_is_verl_s(gen):
    """veRL's reinforce_plus_plus_baseline (core_algos.py L533-586 @1dda039): the KL-shaped sequence reward minus its
    group's mean, on every response token, whitened over the batch's response tokens."""
    k, groups, T = 4, 3, 6
    B = k * groups
    mask = ragged(B, T, gen)
    scores = torch.randn(B, generator=gen, dtype=F64)
    kl = torch.randn(B, T, generator=gen, dtype=F64) * mask
    out = reinforce_pp_baseline_estimator(AdvantageInputs(scores, kl, 0.1, mask, group_size=k)).advantages
    s = scores - 0.1 * (kl * mask).sum(1)
    centred = torch.stack([s[i] - s[(i // k) * k:(i // k + 1) * k].mean() for i in range(B)])
    torch.testing.assert_close(out, verl_whiten(centred.unsqueeze(1) * mask, mask) * mask, rtol=1e-10, atol=1e-12)


def test_rloo_is_the_score_minus_the_mean_of_the_others(gen):
    k, B, T = 4, 8, 5
    mask = ragged(B, T, gen)
    scores = torch.randn(B, generator=gen, dtype=F64)
    kl = torch.randn(B, T, generator=gen, dtype=F64) * mask
    out = rloo_estimator(AdvantageInputs(scores, kl, 0.2, mask, group_size=k)).advantages
    s = scores - 0.2 * kl.sum(1)
    for i in range(B):
        others = [s[j] for j in range((i // k) * k, (i // k + 1) * k) if j != i]
        torch.testing.assert_close(out[i], (s[i] - sum(others) / (k - 1)) * mask[i], rtol=1e-12, atol=1e-14)


def test_the_soft_overlong_punishment_is_dapo_s():
    """veRL's DAPO reward manager (verl/workers/reward_manager/dapo.py L25-132 @1dda039): min(-(l - (L - buffer)) /
    buffer x factor, 0); and TRL RLOO's missing-EOS penalty on responses without a stop token."""
    L, buffer, factor = 16, 4, 0.5
    lengths = torch.tensor([3, 12, 13, 15, 16])
    scores = torch.ones(5, dtype=F64)
    out = shape_scores(scores, torch.ones(5, dtype=torch.bool), lengths, None, buffer, factor, L)
    expected = [1 + min(-(n - (L - buffer)) / buffer * factor, 0) for n in lengths.tolist()]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64))
    assert out[0] == 1 and out[-1] == 1 - factor
    ended = torch.tensor([True, False, True, False, True])
    torch.testing.assert_close(shape_scores(scores, ended, lengths, 0.7, 0, 1.0, L),
                               torch.tensor([1, 0.3, 1, 0.3, 1], dtype=F64))


@pytest.mark.parametrize("mode", list(CORRECTIONS))
def test_each_mismatch_correction_weighs_the_loss_as_its_definition_says(gen, mode):
    """pi_trainer / pi_engine per token (token_*) or its product per sequence (sequence_*), truncated to [low, high]
    (*_truncate) or 0 outside it (*_mask); the loss is the uncorrected per-token loss times those weights, and the
    metrics count what was outside."""
    logp, old, adv, mask = batch(gen, B=8, T=6)
    engine = old + 0.3 * torch.randn(old.shape, generator=gen, dtype=F64) * mask
    low, high = 0.8, 1.25
    weights = mismatch_weights(old, engine, mask, mode, low, high)
    ratio = torch.exp((old - engine) * mask)
    if mode.startswith("sequence"):
        ratio = ratio.prod(1, keepdim=True)
    expected = ratio.clamp(low, high) if mode.endswith("truncate") else torch.where((ratio < low) | (ratio > high),
                                                                                   torch.zeros_like(ratio), ratio)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-14)
    outside = (ratio < low) | (ratio > high)
    units = outside[mask > 0] if mode.startswith("token") else outside.flatten()
    assert 0 < float(units.double().mean()) < 1  # the bounds bind on some, not all
    plain = policy_objective(logp, old, adv, mask, Menu())[0]
    corrected = policy_objective(logp, old, adv, mask, Menu(), is_weights=weights)[0]
    torch.testing.assert_close(corrected, plain * weights)
    metrics = mismatch_metrics(old, engine, mask, mode, low, high)
    share = float(units.double().mean())
    assert metrics["mismatch/masked_frac" if mode.endswith("mask") else "mismatch/clipped_frac"] == pytest.approx(share)


def test_the_mismatch_metrics_are_nemo_rl_s(gen):
    """NeMo-RL's ClippedPGLossFn (nemo_rl/algorithms/loss/loss_functions.py L404-427 @7ea279a): token_mult_prob_error
    the token mean of exp|log p_gen - log p_train|, gen_kl_error the token mean of k3 of (train - gen): exp(d) - 1 -
    d."""
    _, old, _, mask = batch(gen)
    engine = old + 0.2 * torch.randn(old.shape, generator=gen, dtype=F64) * mask
    m = mismatch_metrics(old, engine, mask, "token_truncate", None, 2.0)
    on = mask > 0
    d = (old - engine)[on]
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(float(torch.exp(d.abs()).mean()), rel=1e-12)
    assert m["mismatch/gen_kl"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()), rel=1e-10)
    same = mismatch_metrics(old, old, mask, "sequence_mask", None, 3.0)
    assert same["mismatch/token_mult_prob_error"] == 1.0 and same["mismatch/gen_kl"] == 0.0
    assert same["mismatch/masked_frac"] == 0.0


def test_the_high_entropy_mask_keeps_the_top_share_of_the_response_tokens(gen):
    mask = ragged(10, 12, gen)
    entropy = torch.rand(10, 12, generator=gen, dtype=F64) * 4
    kept = high_entropy_mask(entropy, mask, 0.2)
    on = entropy[mask > 0]
    threshold = torch.quantile(on.float(), 0.8)
    assert torch.equal(kept, ((entropy >= threshold) & (mask > 0)).to(F64))
    assert abs(float(kept.sum()) / float(mask.sum()) - 0.2) < 0.05
    assert float(entropy[kept > 0].min()) >= float(entropy[(mask > 0) & (kept == 0)].max())
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask)


def test_whitening_keeps_zero_off_the_mask(gen):
    mask = ragged(4, 6, gen)
    x = torch.randn(4, 6, generator=gen, dtype=F64)
    out = masked_whiten(x, mask)
    assert torch.equal(out * (1 - mask), torch.zeros_like(out))
    assert float((out * mask).sum() / mask.sum()) == pytest.approx(0.0, abs=1e-12)
    assert math.isfinite(float(out.sum()))
