"""The one update loop of the actor and the critic: epochs x shuffled minibatches x token-weighted micro-batches.

Rows are numbered globally across ranks; every rank draws the same permutation (a generator seeded alike on all
ranks), so minibatch m holds the same rows whether one rank has them all or N ranks hold B/N each. Each micro-batch's
loss, an aggregate over its rows with per-row weights (a token mean: each row's loss tokens; a mean over sequences:
1 each; models/losses.AGGREGATIONS), is weighted by its rows' share of the minibatch's weight over all ranks, so the
minibatch's loss is the aggregate over all its rows, and gradients summed over ranks (`sum_gradients` for replicated
weights; FSDP2's reduce-scatter averages, so there the loss is also scaled by the world size) are the single-process
gradient, whatever the split. Ranks with fewer micro-batches run zero-weight ones: with FSDP every forward is a
collective, so all ranks must run the same number.

A step whose loss or gradient norm is not finite never lands: its gradients are dropped and the optimizer does not
step (the schedule does, so it stays where the run's length put it); it is counted (`skipped_steps`: the actor's
policy/skipped_steps, the critic's critic/skipped_steps) and its stats are left out of the averages. The gradient
norm is the global one on every rank, and a non-finite loss on any rank skips the step on all of them, so the ranks
stay in step. (clip_grad_norm_ would otherwise scale every gradient by NaN, and AdamW would write it into every
weight and moment: every later value NaN, and a save would keep it.)
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from models.distributed import SINGLE, Dist, sum_gradients

MicroLoss = Callable[[Tensor], tuple[Tensor, dict]]  # local row indices -> (their aggregated loss, detached stats)


def micro_batches(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def minibatch_update(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler,
                     micro_loss: MicroLoss,
                     row_weights: Tensor, global_rows: Tensor, n_global: int, minibatch_size: int, epochs: int,
                     micro_batch_size: int, grad_clip: float, generator: torch.Generator, me: Dist = SINGLE,
                     sharded: bool = False) -> dict[str, float]:
    """Optimizer steps over this rank's rows (`global_rows`: their global numbers; `row_weights`: each row's weight in
    the aggregate `micro_loss` computes, e.g. its loss tokens for a token mean).

    Returns the stats of `micro_loss` (token-weighted over each minibatch, then averaged over steps), `grad_norm`
    (mean) and `steps`; the same on every rank.
    """
    position = torch.full((n_global,), -1, dtype=torch.long)
    position[global_rows] = torch.arange(len(global_rows))
    scale = me.world_size if sharded else 1  # FSDP2 averages over ranks; we want the sum
    names: list[str] = []
    sums: Tensor | None = None
    norms: list[float] = []
    steps = skipped = 0
    for _ in range(epochs):
        order = torch.randperm(n_global, generator=generator)
        for start in range(0, n_global, minibatch_size):
            local = position[order[start:start + minibatch_size]]
            local = local[local >= 0]
            total_weight = me.all_reduce(row_weights[local].sum().double()).clamp(min=1e-12)
            count = me.all_reduce(torch.tensor(math.ceil(len(local) / micro_batch_size)), op="max")
            optimizer.zero_grad(set_to_none=True)
            step_sums, finite_loss = None, True
            for m in range(int(count)):
                idx = local[m * micro_batch_size:(m + 1) * micro_batch_size]
                dummy = len(idx) == 0
                loss, stats = micro_loss(idx if not dummy else torch.zeros(1, dtype=torch.long))
                share = 0.0 if dummy else float(row_weights[idx].sum() / total_weight)
                (loss * (share * scale)).backward()
                if not names:
                    names = sorted(stats)
                if step_sums is None:
                    step_sums = torch.zeros(len(names), dtype=torch.float64)
                if not dummy:
                    finite_loss &= bool(torch.isfinite(loss.detach()).all())
                    step_sums += torch.tensor([float(stats[k]) for k in names], dtype=torch.float64) * share
            if not sharded:
                sum_gradients(params, me)
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            bad = not math.isfinite(norm) or not finite_loss
            if me.active:  # the norm is global already; a loss is not
                bad = bool(me.all_reduce(torch.tensor(float(bad)), op="max"))
            steps += 1
            if bad:
                optimizer.zero_grad(set_to_none=True)  # nothing of this step lands
                skipped += 1
            else:
                optimizer.step()
                norms.append(norm)
                if step_sums is not None:
                    sums = step_sums if sums is None else sums + step_sums
            scheduler.step()
    landed = steps - skipped
    totals = me.all_reduce(sums if sums is not None else torch.zeros(len(names), dtype=torch.float64))
    out = {k: float(v) / landed if landed else float("nan") for k, v in zip(names, totals)}
    out.update(grad_norm=sum(norms) / landed if landed else float("nan"), steps=steps, skipped_steps=skipped)
    return out
