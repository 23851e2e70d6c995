"""The losses of the stages before RL (models/losses.py) against float64 reference code written here, one pair or one
token at a time: Bradley-Terry with and without a margin and reward centring, TRL's reward metrics, and the
completion-only SFT loss with its prompt and padding masked."""

import math

import pytest
import torch

from models.losses import bradley_terry_loss, completion_mask, reward_metrics, sft_loss


def _pairs(seed: int, n: int = 7):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randn(n, generator=gen, dtype=torch.float64)
    rejected = torch.randn(n, generator=gen, dtype=torch.float64)
    margin = torch.rand(n, generator=gen, dtype=torch.float64)
    return chosen, rejected, margin


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_loss_matches_reference(with_margin, center):
    chosen, rejected, margin = _pairs(3)
    loss, stats = bradley_terry_loss(chosen, rejected, margin if with_margin else None, center)
    terms = []
    for i in range(len(chosen)):
        d = chosen[i].item() - rejected[i].item() - (margin[i].item() if with_margin else 0.0)
        terms.append(-math.log(1.0 / (1.0 + math.exp(-d))))
    expected = sum(terms) / len(terms)
    if center is not None:
        expected += center * sum((c + r) ** 2 for c, r in zip(chosen.tolist(), rejected.tolist())) / len(chosen)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["loss"].item() == pytest.approx(expected, rel=1e-12)


def test_bradley_terry_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([0.3, -1.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    bradley_terry_loss(chosen, rejected)[0].backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises r_chosen, lowers r_rejected
    # d/dc of -log sigmoid(c - r) / n = -(1 - sigmoid(c - r)) / n
    d = (chosen - rejected).detach()
    assert torch.allclose(chosen.grad, -(1 - torch.sigmoid(d)) / 2, rtol=1e-12, atol=0)


def test_center_rewards_pulls_a_shifted_pair_back_to_zero():
    """A shift of both rewards leaves the Bradley-Terry term unchanged; the centring term alone moves it."""
    chosen, rejected, _ = _pairs(5)
    plain = bradley_terry_loss(chosen + 3.0, rejected + 3.0)[0]
    assert plain.item() == pytest.approx(bradley_terry_loss(chosen, rejected)[0].item(), rel=1e-12)
    shifted = (chosen + 3.0).requires_grad_(True)
    bradley_terry_loss(shifted, rejected + 3.0, center_rewards_coefficient=0.1)[0].backward()
    free = (chosen + 3.0).requires_grad_(True)
    bradley_terry_loss(free, rejected + 3.0)[0].backward()
    assert (shifted.grad > free.grad).all()  # the centring term pushes every (positive) reward down


def test_reward_metrics_are_trls():
    chosen = torch.tensor([1.0, 0.0, 2.0, -1.0], dtype=torch.float64)
    rejected = torch.tensor([0.0, 0.5, 2.0, -3.0], dtype=torch.float64)
    m = reward_metrics(chosen, rejected)
    assert m["accuracy"].item() == pytest.approx(2 / 4)  # a tie is not a win (TRL: chosen > rejected)
    assert m["margin"].item() == pytest.approx((1.0 - 0.5 + 0.0 + 2.0) / 4)
    assert m["min_reward"].item() == -3.0 and m["max_reward"].item() == 2.0
    assert m["mean_reward"].item() == pytest.approx(sum([1.0, 0.0, 2.0, -1.0, 0.0, 0.5, 2.0, -3.0]) / 8)


def test_sft_loss_masks_the_prompt_and_the_padding():
    """Rows of lengths 5 and 3 in a batch 6 wide, prompts of 2 and 1 tokens: the loss is the mean of -logp over the
    completion tokens only, i.e. tokens[2:5] of row 0 and tokens[1:3] of row 1."""
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 5, generator=gen, dtype=torch.float64)  # entry t scores tokens[:, t+1]
    prompt_lengths, lengths = torch.tensor([2, 1]), torch.tensor([5, 3])
    mask = completion_mask(prompt_lengths, lengths, width=6)
    assert mask.tolist() == [[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    terms = [-logp[0, t].item() for t in range(1, 4)] + [-logp[1, t].item() for t in range(0, 2)]
    loss, _ = sft_loss(logp, mask)
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
