"""RL math against float64 reference loops written here, on fresh random inputs with ragged masks."""

import math

import zlib

import pytest
import torch

from models.advantages import (AdaptiveKLController, gae, kl_penalty, masked_mean, masked_var, masked_whiten,
                               rloo_baseline, shape_rewards)

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`


def ragged_mask(B, T, gen, with_empty=False):
    """Each row: a prompt part (0), a response part (1), then padding (0)."""
    mask = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(0, T // 2, (1,), generator=gen))
        length = int(torch.randint(1, T - start + 1, (1,), generator=gen))
        if with_empty and b == 0:
            continue
        mask[b, start:start + length] = 1
    return mask


@pytest.fixture
def gen(request):
    """A generator seeded from the test's own id: random data, the same on every run (a failure reproduces)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def ref_gae(rewards, values, mask, gamma, lam):
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t] == 1]
        last = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            next_v = values[b, idx[j + 1]].item() if j + 1 < len(idx) else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b][t] = last
    adv = torch.tensor(adv, dtype=torch.float64)
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.7, 0.0)])
def test_gae_matches_loop(gen, gamma, lam):
    B, T = 7, 13
    mask = ragged_mask(B, T, gen)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv, ret = gae(rewards, values * mask, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards, values * mask, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_ignores_values_off_mask(gen):
    """Garbage values on prompt/pad positions must not leak into advantages (terminal value after the response is 0)."""
    B, T = 5, 10
    mask = ragged_mask(B, T, gen)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    noisy = values + 100.0 * (1 - mask)
    torch.testing.assert_close(gae(rewards, noisy, mask, 0.95, 0.9)[0], gae(rewards, values, mask, 0.95, 0.9)[0])


def test_masked_stats_and_whiten(gen):
    x = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = ragged_mask(6, 9, gen)
    vals = [x[b, t].item() for b in range(6) for t in range(9) if mask[b, t] == 1]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)
    assert masked_mean(x, mask).item() == pytest.approx(mean, rel=1e-12)
    assert masked_var(x, mask).item() == pytest.approx(var, rel=1e-10)
    w = masked_whiten(x, mask, eps=0.0)
    for b in range(6):
        for t in range(9):
            expected = (x[b, t].item() - mean) / math.sqrt(var) if mask[b, t] == 1 else 0.0
            assert w[b, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # row means along dim
    row = masked_mean(x, mask, dim=1)
    for b in range(6):
        r = [x[b, t].item() for t in range(9) if mask[b, t] == 1]
        assert row[b].item() == pytest.approx(sum(r) / len(r), rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3"])
def test_kl_estimators(gen, estimator):
    logp = -torch.rand(4, 8, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(4, 8, generator=gen, dtype=torch.float64) * 5
    out = kl_penalty(logp, ref, estimator)
    for b in range(4):
        for t in range(8):
            d = logp[b, t].item() - ref[b, t].item()
            expected = {"k1": d, "abs": abs(d), "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator]
            assert out[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if estimator != "k1":
        assert (out >= 0).all()


def test_kl_estimator_unknown():
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k9")


def ref_rloo(rewards, groups, valid):
    out = []
    for i in range(len(rewards)):
        group_valid = [j for j in range(len(rewards)) if groups[j] == groups[i] and valid[j]]
        others = [j for j in group_valid if j != i]
        if len(group_valid) < 2 or not others:
            out.append(rewards[i])
        else:
            out.append(sum(rewards[j] for j in others) / len(others))
    return out


def test_rloo_baseline_with_invalid_and_singletons(gen):
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4])
    rewards = torch.randn(len(groups), generator=gen, dtype=torch.float64)
    valid = torch.tensor([1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    out = rloo_baseline(rewards, groups, valid)
    expected = ref_rloo(rewards.tolist(), groups.tolist(), valid.tolist())
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # singleton group (2) and group 1 with one valid sample have zero advantage
    assert out[7] == rewards[7] and out[4] == rewards[4]
    # all valid, random groups
    groups = torch.randint(0, 5, (20,), generator=gen)
    rewards = torch.randn(20, generator=gen, dtype=torch.float64)
    expected = ref_rloo(rewards.tolist(), groups.tolist(), [True] * 20)
    torch.testing.assert_close(rloo_baseline(rewards, groups), torch.tensor(expected, dtype=torch.float64))


def test_shape_rewards(gen):
    B, T = 6, 11
    mask = ragged_mask(B, T, gen)
    kl = torch.randn(B, T, generator=gen, dtype=torch.float64)
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    out = shape_rewards(scores, kl, mask, beta=0.3)
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t] == 1]
        for t in range(T):
            expected = -0.3 * kl[b, t].item() if mask[b, t] == 1 else 0.0
            if t == idx[-1]:
                expected += scores[b].item()
            assert out[b, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_adaptive_kl_controller():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, n_steps=100)  # error clipped at +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl.update(5.4, n_steps=1000)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 0.01) * (1 - 0.1 * 0.1))
    state = ctl.state_dict()
    other = AdaptiveKLController(1.0, 6.0, 10000)
    other.load_state_dict(state)
    assert other.value == ctl.value
