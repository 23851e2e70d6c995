"""A step whose loss or gradient norm is not finite never lands (models/update.py): the weights and optimizer states
are exactly those before it, the schedule still moves, the step is counted; the critic refuses returns beyond its
bound naming the tensor, and a critic whose outputs overflow skips its steps instead of writing NaN into itself."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models.config import CriticConfig, CriticOptim, OptimConfig
from models.critic import VALUE_BOUND, CriticInputError, CriticTrainer, validate_train
from models.loading import make_optimizer
from models.update import minibatch_update


def test_a_poisoned_step_leaves_weights_and_optimizer_exactly_as_before_it(tiny_models):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optimizer, scheduler = make_optimizer(model.parameters(), OptimConfig(lr=1e-2, total_steps=8, warmup_steps=0))
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    calls, before = {"n": 0}, {}
    micro_per_step = 2  # minibatch 8, micro-batch 4: steps 1..4 over 2 epochs; the last one is poisoned

    def micro_loss(idx):
        calls["n"] += 1
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        if calls["n"] == 3 * micro_per_step + 1:  # the first micro-batch of the 4th (last) step
            before.update(weights=copy.deepcopy(model.state_dict()), optim=copy.deepcopy(optimizer.state_dict()))
            loss = loss * float("inf")
        return loss, {"loss": loss.detach()}

    out = minibatch_update(list(model.parameters()), optimizer, scheduler, micro_loss, torch.ones(16), torch.arange(16),
                           16, 8, 2, 4, 1.0, torch.Generator().manual_seed(0))
    assert out["steps"] == 4 and out["skipped_steps"] == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, before["weights"][name]), name  # nothing of the poisoned step landed
    saved = before["optim"]["state"]
    for key, state in optimizer.state_dict()["state"].items():
        assert all(torch.equal(state[k], saved[key][k]) for k in ("exp_avg", "exp_avg_sq")) and state["step"] == 3
    assert scheduler.last_epoch == 4  # the schedule moved on: the run's length decides it, not its failures
    assert np.isfinite(out["loss"]) and np.isfinite(out["grad_norm"])  # averaged over the 3 steps that landed


def test_returns_beyond_the_bound_are_refused_naming_the_tensor():
    tokens = np.ones((2, 4), np.int64)
    mask = np.ones((2, 4), np.float32)
    good = np.zeros((2, 4), np.float32)
    validate_train(tokens, good + VALUE_BOUND, good, mask)  # the bound itself is accepted
    for name, args in (("returns", (good + 3e38, good, mask)), ("prev_values", (good, good - 2e6, mask))):
        with pytest.raises(CriticInputError, match=rf"{name}: \|values\| must be at most 1e\+06, got 3e\+38|"
                                                   rf"{name}: \|values\| must be at most 1e\+06, got 2e\+06"):
            validate_train(tokens, *args)


def test_a_critic_whose_values_overflow_skips_its_steps_and_stays_finite(tiny_models):
    trainer = CriticTrainer(CriticConfig(train_batch_size=4, micro_batch_size=4, epochs=1,
                                         optim=CriticOptim(lr=1e-3)), tiny_models["critic"], None, False)
    head = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        head.bias.fill_(3e38)  # values at the edge of float32: their squares overflow
    weights = copy.deepcopy(trainer.model.state_dict())
    tokens = torch.randint(4, 40, (8, 6))
    mask = torch.ones(8, 6)
    stats = trainer.train(tokens, torch.zeros(8, 6), torch.zeros(8, 6), mask)
    assert stats["skipped_steps"] == 2  # 8 rows / 4 per step: both skipped
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, weights[name]) and torch.isfinite(value).all(), name
    assert all(torch.isfinite(t).all() for s in trainer.optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))
