"""Loss functions: float64 references, textbook gradient signs, clipping engagement (the RL loss through the menu's
policy objective with PPO's and REINFORCE's policy terms, a token mean; the rest of the menu: test_loss_menu.py)."""

import math

import pytest
import torch

from models.losses import Menu, aggregate, dpo_loss, explained_variance, mismatch_weights, policy_objective, value_loss

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


def ppo_policy_loss(logp, old, adv, mask, eps=0.2, weights=None):
    """PPO's clipped surrogate, a token mean (the ppo recipe's loss), with mismatch weights when given."""
    per_token, stats = policy_objective(logp, old, adv, mask, Menu(epsilon=eps, epsilon_high=eps), is_weights=weights)
    return aggregate(per_token, mask, "token-mean", 1), stats


def reinforce_loss(logp, adv, mask, weights=None):
    per_token, _ = policy_objective(logp, logp.detach(), adv, mask, Menu(policy_loss="reinforce"), is_weights=weights)
    return aggregate(per_token, mask, "token-mean", 1)


def tis_weights(old, engine, mask, cap):
    return mismatch_weights(old, engine, mask, "token_truncate", None, cap)


def test_ppo_loss_matches_reference():
    gen = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    loss, stats = ppo_policy_loss(logp, old, adv, mask, 0.2)
    terms, clipped, kls = [], [], []
    for b in range(3):
        for t in range(5):
            if mask[b, t] == 0:
                continue
            r = torch.exp(logp[b, t] - old[b, t]).item()
            a = adv[b, t].item()
            u, c = -a * r, -a * min(max(r, 0.8), 1.2)
            terms.append(max(u, c))
            clipped.append(1.0 if c > u else 0.0)
            kls.append((r - 1) - (logp[b, t] - old[b, t]).item())
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped))
    assert stats["approx_kl"].item() == pytest.approx(sum(kls) / len(kls), rel=1e-10)


@pytest.mark.parametrize("log_ratio,adv,expect_grad", [
    (0.0, 1.0, "negative"),    # inside the clip range, A>0: raise logp (d loss / d logp < 0)
    (0.0, -1.0, "positive"),   # inside, A<0: lower logp
    (0.5, 1.0, "zero"),        # ratio 1.65 > 1.2 with A>0: clipped, no gradient
    (-0.5, -1.0, "zero"),      # ratio 0.61 < 0.8 with A<0: clipped, no gradient
    (0.5, -1.0, "positive"),   # ratio above range but A<0: unclipped branch is the max, gradient flows
    (-0.5, 1.0, "negative"),   # ratio below range but A>0: gradient flows
])
def test_ppo_gradient_sign(log_ratio, adv, expect_grad):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logp = (old + log_ratio).clone().requires_grad_(True)
    loss, stats = ppo_policy_loss(logp, old, torch.tensor([[adv]], dtype=torch.float64),
                                  torch.ones(1, 1, dtype=torch.float64))
    loss.backward()
    g = logp.grad.item()
    if expect_grad == "zero":
        assert g == 0.0 and stats["clipfrac"].item() == 1.0
    elif expect_grad == "negative":
        assert g < 0
    else:
        assert g > 0


def test_value_loss_clipping():
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 2.0, 0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    expected = []
    for v, o, r in zip([0.5, 2.0, 0.5], [0.0] * 3, [1.0, 1.0, -1.0]):
        vc = o + min(max(v - o, -0.2), 0.2)
        expected.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
    assert loss.item() == pytest.approx(sum(expected) / 3, rel=1e-12)
    # position 0: clipped value (0.2) is further from the return (1.0) than 0.5 -> clipped branch, no gradient
    loss.backward()
    assert values.grad[0, 0].item() == 0.0
    assert values.grad[0, 1].item() != 0.0  # unclipped branch larger: gradient flows
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)  # only position 0 takes the clipped branch
    unclipped, _ = value_loss(values.detach(), old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.25 + 1.0 + 2.25) / 3)


def test_reinforce_loss_and_entropy():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    loss = reinforce_loss(logp, adv, mask)
    assert loss.item() == pytest.approx((2 * 1 + 2 * 2 - 0.5 * 3) / 5)
    loss.backward()
    assert logp.grad[0, 0] < 0 and logp.grad[1, 0] > 0 and logp.grad[0, 2] == 0
    ent = torch.tensor([[1.0, 3.0, 9.0]], dtype=torch.float64)
    one = torch.zeros(1, 3, dtype=torch.float64)
    bonus, _ = policy_objective(one, one, torch.zeros(1), one + 1, Menu(policy_loss="reinforce", entropy_coef=0.1),
                                entropy=ent)
    assert aggregate(bonus, torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64), "token-mean",
                     1).item() == pytest.approx(-0.2)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.zeros_like(returns) + 2.5, returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(0.5 * returns, returns, mask).item() == pytest.approx(0.75)


def test_truncated_importance_sampling_matches_reference():
    """TIS: each token's weight is min(pi_trainer_old / pi_engine, cap), no gradient; the PPO and REINFORCE losses
    weight each token's term by it, computed here from scratch in float64 one token at a time."""
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 3
    engine = old + 0.8 * torch.randn(3, 6, generator=gen, dtype=torch.float64)  # wide: some weights hit the cap
    logp = (old + 0.1 * torch.randn(3, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    seq_adv = torch.randn(3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    cap = 1.2
    w = tis_weights(old, engine, mask, cap)
    assert not w.requires_grad
    ppo_terms, rf_terms, capped = [], [], 0
    for b in range(3):
        for t in range(6):
            if mask[b, t] == 0:
                continue
            weight = min(math.exp(old[b, t].item() - engine[b, t].item()), cap)
            capped += weight == cap
            assert w[b, t].item() == pytest.approx(weight, rel=1e-12)
            r, a = math.exp(logp[b, t].item() - old[b, t].item()), adv[b, t].item()
            ppo_terms.append(weight * max(-a * r, -a * min(max(r, 0.8), 1.2)))
            rf_terms.append(weight * -logp[b, t].item() * seq_adv[b].item())
    assert 0 < capped < len(ppo_terms)  # the cap is exercised, and not everywhere
    loss, _ = ppo_policy_loss(logp, old, adv, mask, 0.2, w)
    assert loss.item() == pytest.approx(sum(ppo_terms) / len(ppo_terms), rel=1e-12)
    assert reinforce_loss(logp, seq_adv, mask, w).item() == pytest.approx(sum(rf_terms) / len(rf_terms), rel=1e-12)
    # the gradient flows through logp only, scaled per token by the weight
    reinforce_loss(logp, seq_adv, mask, w).backward()
    expected = -(w * seq_adv.unsqueeze(1)) / mask.sum()
    torch.testing.assert_close(logp.grad, expected * mask, rtol=1e-12, atol=0)


def test_weights_of_one_change_nothing():
    """The native engine samples with the trainer's weights: its weight would be exactly 1, and the step passes none;
    a weight of ones gives the same loss as no weight."""
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(2, 4, generator=gen)
    logp, adv, mask = old + 0.1, torch.randn(2, 4, generator=gen), torch.ones(2, 4)
    assert torch.equal(tis_weights(old, old, mask, 2.0), torch.ones(2, 4))
    assert torch.equal(ppo_policy_loss(logp, old, adv, mask, 0.2, torch.ones(2, 4))[0],
                       ppo_policy_loss(logp, old, adv, mask, 0.2)[0])


def test_decoupled_ppo_with_stale_rollouts_matches_a_float64_reference(tiny_models):
    """Asynchronous rollouts: a batch sampled by the weights of 2 updates ago (the behaviour policy, the engine's
    logprobs) is trained on by the current weights. The clip is around the proximal policy, the trainer's logprobs
    recomputed when the batch is consumed (AReaL's decoupled PPO), and each token is weighted by
    min(pi_proximal / pi_behaviour, cap) (truncated importance sampling toward the behaviour policy). Checked
    token by token in float64 against a loop written here, loss and gradient, for PPO's clipped loss and REINFORCE's;
    anchoring the clip on the behaviour policy instead would give another loss (the test would see it)."""
    from models.config import Sampling
    from models.engines import NativeEngine
    from models.policy import Policy
    from models.tasks import sentiment

    policy = Policy.load(tiny_models["policy"])
    ids = policy.encode_prompts(sentiment.prompts(4))
    ro = NativeEngine.for_policy(policy).generate(ids, 2, Sampling(max_new_tokens=6), torch.Generator().manual_seed(0))
    mask = ro.response_mask.double()

    def logprobs():
        with torch.no_grad():
            return policy.logprobs(ro.tokens, ro.lengths)[0].double() * mask

    behaviour = ro.sample_logprobs.double()  # version v-2: what sampled the tokens
    torch.manual_seed(0)
    for _ in range(2):  # two updates since (staleness 2)
        with torch.no_grad():
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    proximal = logprobs()  # version v: the weights the batch is trained from
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # a minibatch step into the update
    theta = logprobs().clone().requires_grad_()
    assert (proximal - behaviour).abs().max() > 0.05 and (theta - proximal).abs().max() > 0.01  # really stale
    adv = torch.randn(len(ro), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    token_adv = adv.unsqueeze(1).expand_as(mask)
    cap, eps = 1.5, 0.2
    w = tis_weights(proximal, behaviour, mask, cap)
    loss, _ = ppo_policy_loss(theta, proximal, token_adv, mask, eps, w)
    loss.backward()
    terms, grads, n = [], torch.zeros_like(mask), mask.sum().item()
    for b in range(len(ro)):
        for t in range(mask.shape[1]):
            if mask[b, t] == 0:
                continue
            weight = min(math.exp(proximal[b, t].item() - behaviour[b, t].item()), cap)
            r, a = math.exp(theta[b, t].item() - proximal[b, t].item()), adv[b].item()
            unclipped, clipped = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
            terms.append(weight * max(unclipped, clipped))
            grads[b, t] = weight * (-a * r if unclipped >= clipped else 0.0) / n  # d/d logp of the max
    assert loss.item() == pytest.approx(sum(terms) / n, rel=1e-12)
    torch.testing.assert_close(theta.grad, grads, rtol=1e-10, atol=1e-14)
    behaviour_anchored, _ = ppo_policy_loss(theta.detach(), behaviour, token_adv, mask, eps, w)
    assert abs(behaviour_anchored.item() - loss.item()) > 1e-3
    # REINFORCE (RLOO with clip_eps=None, GRPO, REINFORCE++): -logp * A per token, weighted alike
    reference = sum(min(math.exp(proximal[b, t].item() - behaviour[b, t].item()), cap) * -theta[b, t].item()
                    * adv[b].item()
                    for b in range(len(ro)) for t in range(mask.shape[1]) if mask[b, t]) / n
    assert reinforce_loss(theta, adv, mask, w).item() == pytest.approx(reference, rel=1e-12)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_trls_metrics_match_a_float64_reference(loss_type):
    """DPO's loss, its gradient and TRL's metrics from per-pair sums of completion log-probabilities, against a
    float64 reference written pair by pair (Rafailov et al. 2023 eq. 7; IPO: Azar et al. 2023 eq. 17 with TRL 1.16's
    per-token normalisation); the gradient pushes the chosen completion's log-probability up and the rejected one's
    down."""
    gen = torch.Generator().manual_seed(3)
    logps = (-20 * torch.rand(6, 2, generator=gen, dtype=torch.float64)).requires_grad_()
    ref = -20 * torch.rand(6, 2, generator=gen, dtype=torch.float64)
    tokens = torch.randint(1, 12, (6, 2), generator=gen).double()
    beta = 0.3
    loss, stats = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta, loss_type, tokens[:, 0], tokens[:, 1])
    terms, chosen, rejected = [], [], []
    for (lw, ll), (rw, rl), (nw, nl) in zip(logps.tolist(), ref.tolist(), tokens.tolist()):
        hw, hl = lw - rw, ll - rl
        if loss_type == "sigmoid":
            terms.append(math.log1p(math.exp(-beta * (hw - hl))))  # -log sigmoid(x)
        else:
            terms.append((hw / nw - hl / nl - 1 / (2 * beta)) ** 2)
        chosen.append(beta * hw)
        rejected.append(beta * hl)
    assert float(loss) == pytest.approx(sum(terms) / 6, rel=1e-12)
    assert float(stats["rewards/chosen"]) == pytest.approx(sum(chosen) / 6, rel=1e-12)
    assert float(stats["rewards/rejected"]) == pytest.approx(sum(rejected) / 6, rel=1e-12)
    assert float(stats["rewards/margins"]) == pytest.approx((sum(chosen) - sum(rejected)) / 6, rel=1e-12)
    assert float(stats["rewards/accuracies"]) == sum(c > r for c, r in zip(chosen, rejected)) / 6
    assert float(stats["logps/chosen"]) == pytest.approx(float(logps[:, 0].mean()), rel=1e-12)
    assert float(stats["logps/rejected"]) == pytest.approx(float(logps[:, 1].mean()), rel=1e-12)
    loss.backward()
    if loss_type == "sigmoid":  # every pair: d/d(logp_w) < 0 (minimising raises it), d/d(logp_l) > 0
        assert (logps.grad[:, 0] < 0).all() and (logps.grad[:, 1] > 0).all()
    with pytest.raises(ValueError, match="dpo.loss_type: 'hinge' is not 'sigmoid' or 'ipo'"):
        dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], beta, "hinge")
