"""KTO (models/stages/kto.py): its loss against a float64 reference written row by row, and against TRL 1.16's own
`KTOTrainer._compute_loss` on the same batch (float64, both loss types, unequal weights): the same loss, the same
gradient with respect to the completions' per-token log-probabilities, TRL's metrics; the rows' KL sequences are
TRL's mismatched pairs (each prompt with the previous row's completion, cyclic).

TRL's trainer is built without its __init__ (the attributes its __init__ sets that _compute_loss reads), its
reference log-probabilities precomputed (TRL's precompute_ref_log_probs), and a stand-in model that returns the
float64 per-token log-probabilities we control for each input (what TRL's fused LM head returns: 0 off the
completion).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from models.stages.kto import Labeled, kto_loss

pytestmark = pytest.mark.fast

trl = pytest.importorskip("trl")
F64 = torch.float64
LABELS = [True, False, True, True, False, False, True]
B, L = len(LABELS), 6


def sig(x):
    return 1 / (1 + math.exp(-x))


def reference(logps, refs, labels, kl, beta, loss_type, wd, wu):
    terms = []
    for lp, rp, good in zip(logps, refs, labels):
        h = lp - rp
        if loss_type == "kto":
            term = 1 - sig(beta * (h - kl)) if good else 1 - sig(beta * (kl - h))
        else:
            term = 1 - sig(beta * h) if good else sig(beta * h)
        terms.append((wd if good else wu) * term)
    return sum(terms) / len(terms)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_matches_a_float64_reference(loss_type):
    gen = torch.Generator().manual_seed(5)
    logps = (-20 * torch.rand(B, generator=gen, dtype=F64)).requires_grad_()
    refs = -20 * torch.rand(B, generator=gen, dtype=F64)
    labels = torch.tensor(LABELS)
    loss, stats = kto_loss(logps, refs, labels, torch.tensor(0.7, dtype=F64), 0.3, loss_type, 1.5, 0.8)
    assert float(loss.detach()) == pytest.approx(reference(logps.tolist(), refs.tolist(), LABELS, 0.7, 0.3, loss_type,
                                                           1.5, 0.8),
                                        rel=1e-12)
    good = [0.3 * (a - b) for a, b, g in zip(logps.tolist(), refs.tolist(), LABELS) if g]
    bad = [0.3 * (a - b) for a, b, g in zip(logps.tolist(), refs.tolist(), LABELS) if not g]
    assert float(stats["rewards/chosen"]) == pytest.approx(sum(good) / len(good), rel=1e-12)
    assert float(stats["rewards/margins"]) == pytest.approx(sum(good) / len(good) - sum(bad) / len(bad), rel=1e-12)
    loss.backward()  # minimising raises a desirable completion's log-probability and lowers an undesirable one's
    assert (logps.grad[labels] < 0).all() and (logps.grad[~labels] > 0).all()
    with pytest.raises(ValueError, match="kto.loss_type: 'bco' is not"):
        kto_loss(logps, refs, labels, torch.tensor(0.0), 0.3, "bco")


def test_kl_sequences_pair_each_prompt_with_the_previous_rows_completion():
    rows = Labeled([[1, 2, 3, 9], [4, 5, 8, 8, 9], [6, 7, 9]], [2, 2, 1], [True, False, True], "x")
    out = rows.rows([2, 0, 1])
    assert out["ids"] == [[6, 7, 9], [1, 2, 3, 9], [4, 5, 8, 8, 9]]
    assert out["kl_ids"] == [[6, 8, 8, 9], [1, 2, 7, 9], [4, 5, 3, 9]]  # row j: its prompt, row j-1's completion


class StandIn(torch.nn.Module):
    """What TRL's forward with fused_lm_head returns, for the inputs it was given: per-token log-probabilities we
    control (float64 leaves), no entropy or logits worth comparing."""

    def __init__(self, by_input: dict[int, torch.Tensor]):
        super().__init__()
        self.by_input = by_input

    def forward(self, input_ids, labels=None, **_):
        log_probs = self.by_input[id(input_ids)]
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros)


def bare_trainer(loss_type: str, beta: float, wd: float, wu: float):
    from accelerate import Accelerator

    t = object.__new__(trl.KTOTrainer)
    t.accelerator = Accelerator(cpu=True)
    t.model = torch.nn.Linear(1, 1).train()  # _compute_loss reads .training only
    t.loss_type, t.beta, t.desirable_weight, t.undesirable_weight = loss_type, beta, wd, wu
    t.calculate_KL = loss_type != "apo_zero_unpaired"  # as its __init__ sets it
    t.precompute_ref_logps, t.aux_loss_enabled, t._tp_size, t._total_train_tokens = True, False, 1, 0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return t


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_matches_trls_ktotrainer_on_the_same_batch(loss_type):
    gen = torch.Generator().manual_seed(11)
    prompt = torch.tensor([1, 2, 2, 1, 3, 2, 1])  # each row's prompt tokens
    length = prompt + torch.tensor([4, 3, 2, 3, 3, 4, 2])  # completion tokens after them
    positions = torch.arange(L).unsqueeze(0)
    completion = ((positions >= prompt.unsqueeze(1)) & (positions < length.unsqueeze(1))).long()
    per_token = torch.where(completion[:, 1:].bool(), -3 * torch.rand(B, L - 1, generator=gen, dtype=F64), 0.0)
    per_token = per_token.requires_grad_()
    kl_token = torch.where(completion[:, 1:].bool(), -3 * torch.rand(B, L - 1, generator=gen, dtype=F64), 0.0)
    ref_logps = -8 * torch.rand(B, generator=gen, dtype=F64)
    ref_kl = -8 - 8 * torch.rand(B, generator=gen, dtype=F64)  # below the policy's: a KL term > 0, not clamped
    ids, kl_ids = torch.randint(5, 50, (B, L), generator=gen), torch.randint(5, 50, (B, L), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.long), "completion_mask": completion,
             "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones(B, L, dtype=torch.long),
             "KL_completion_mask": completion, "label": torch.tensor(LABELS), "ref_logps": ref_logps,
             "ref_KL_logps": ref_kl}
    beta, wd, wu = 0.4, 1.3, 0.7
    t = bare_trainer(loss_type, beta, wd, wu)
    theirs = t._compute_loss(StandIn({id(ids): per_token, id(kl_ids): kl_token}), batch, return_outputs=False)
    (their_grad,) = torch.autograd.grad(theirs, per_token)

    # ours: the same summed log-probabilities, the KL term over the batch as models/stages/kto.kl_term takes it
    kl = ((kl_token.sum(1) - ref_kl).mean().clamp(min=0) if loss_type == "kto" else torch.zeros((), dtype=F64))
    assert loss_type != "kto" or float(kl) > 0.5
    ours, stats = kto_loss(per_token.sum(1), ref_logps, torch.tensor(LABELS), kl, beta, loss_type, wd, wu)
    (our_grad,) = torch.autograd.grad(ours, per_token)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-9)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-9, atol=1e-12)
    logged = t._metrics["train"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl"):
        assert float(stats[name]) == pytest.approx(logged[name][-1], rel=1e-6, abs=1e-9), name
