"""The KTO stage (Ethayarajh et al. 2024) on the actor's ranks, as TRL 1.16's KTOTrainer computes it: unpaired
completions, each labelled desirable or undesirable, scored by the policy and by its frozen reference (the model it
starts from: in a pipeline the SFT model; with LoRA the same model, its adapters disabled) as the sum of the
completion tokens' log-probabilities. Everything KTO is lives here: its section, its run configs, its rows, its loss
and its trainer (models/kinds.py declares it; docs/contributing.md walks through how it was added).

Rows: TRL's unpaired form (prompt, completion, label: a bool), or preference pairs (prompt, chosen, rejected),
unpaired as TRL's `unpair_preference_dataset` does: the chosen completion desirable, the rejected one not.

The KL term z0 is TRL's: the policy's KL to its reference estimated on mismatched pairs, each row's prompt with the
completion of the row before it in the batch (cyclic), mean(log pi(y'|x) - log pi_ref(y'|x)) over the batch, clamped
at 0 and without gradient. Here it is the mean over the step's global batch (every rank's rows, one no-grad pass
before the update), so a step is the same on any number of ranks and micro-batches; TRL takes it per device batch
(the same when a step is one batch on one device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, PositiveInt
from torch import Tensor

from models.data import DataError, read_rows
from models.resolve import Resolved
from models.stages.config import StageTraining, stage_run_configs
from models.stages.data import load_pairs, right_padded, sequence_ids
from models.stages.dpo import DPO, completion_logps
from models.stages.train import equal_passes
from models.update import micro_batches


class KTOConfig(StageTraining):
    """KTO on desirable and undesirable completions against the frozen model it starts from (TRL's KTOTrainer)."""

    data: str = Field(
        "builtin:sentiment_preference",
        description="Rows (prompt, completion, label), or preference pairs taken unpaired (docs/data.md).")
    beta: float = Field(0.1, gt=0, description="The KL strength beta (TRL's default 0.1): the implicit reward's scale.")
    loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        "kto",
        description="kto: KTO's loss against its KL term; apo_zero_unpaired: APO-zero's unpaired loss, no KL term.")
    desirable_weight: float = Field(
        1.0, gt=0, description="Weight of a desirable row's loss (TRL's; raise it when desirable rows are fewer).")
    undesirable_weight: float = Field(1.0, gt=0, description="Weight of an undesirable row's loss.")
    batch_size: PositiveInt = Field(
        64, description="Rows (completions) per optimizer step, over all ranks (two per preference pair).")
    micro_batch_size: PositiveInt = Field(64, description="Rows per forward pass on a rank.")
    epochs: PositiveInt = Field(1, description="Passes over the training rows (seeded order per epoch).")


KTORunConfig, KTORun = stage_run_configs("kto", KTOConfig, "What a KTO run trains (`rlhf kto`, kto/default): `model` "
                                         "is the policy it starts from and its frozen reference.")


# ---------------------------------------------------------------- the loss

def kto_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor, kl: Tensor, beta: float, loss_type: str = "kto",
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, dict]:
    """KTO over rows [B] (TRL 1.16's KTOTrainer), from each completion's summed log-probability under the policy and
    the reference, its label, and the KL term z0 (a scalar, no gradient):

        h = log pi(y) - log pi_ref(y)
        'kto'                desirable: 1 - sigmoid(beta (h - z0))   undesirable: 1 - sigmoid(beta (z0 - h))
        'apo_zero_unpaired'  desirable: 1 - sigmoid(beta h)          undesirable: sigmoid(beta h)

    the mean over rows of each row's loss times desirable_weight or undesirable_weight. Stats with TRL's names:
    rewards/chosen and rewards/rejected (the mean implicit reward beta h of the desirable and of the undesirable
    rows), rewards/margins (their difference), logps/chosen and logps/rejected, kl."""
    ratio = logps - ref_logps
    if loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":
        good, bad = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    else:
        raise ValueError(f"kto.loss_type: {loss_type!r} is not 'kto' or 'apo_zero_unpaired'")
    desirable = desirable.bool()
    loss = torch.where(desirable, desirable_weight * good, undesirable_weight * bad).mean()
    with torch.no_grad():
        rewards = beta * ratio.detach()
        stats = {"loss": loss.detach(), "kl": torch.as_tensor(kl, dtype=rewards.dtype)}
        for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
            if rows.any():
                stats[f"rewards/{name}"] = rewards[rows].mean()
                stats[f"logps/{name}"] = logps.detach()[rows].mean()
        if desirable.any() and (~desirable).any():
            stats["rewards/margins"] = stats["rewards/chosen"] - stats["rewards/rejected"]
    return loss, stats


# ---------------------------------------------------------------- the rows

@dataclass
class Labeled:
    """Tokenized completions, each after its prompt (EOS included), each desirable or not."""

    ids: list[list[int]]
    prompt_lengths: list[int]
    labels: list[bool]
    source: str
    dropped: int = 0  # rows longer than max_length
    mismatched: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: int) -> "Labeled":
        return Labeled(self.ids[:n], self.prompt_lengths[:n], self.labels[:n], self.source, self.dropped,
                       self.mismatched)

    def rows(self, indices: list[int]) -> dict:
        """The rows `indices` as a command carries them to every rank, each with its KL sequence: its prompt and the
        completion of the row before it among `indices` (cyclic)."""
        ids = [self.ids[i] for i in indices]
        cut = [self.prompt_lengths[i] for i in indices]
        kl = [ids[j][:cut[j]] + ids[j - 1][cut[j - 1]:] for j in range(len(ids))]
        return {"ids": ids, "prompt_lengths": cut, "labels": [self.labels[i] for i in indices], "kl_ids": kl,
                "kl_prompt_lengths": cut}


def load_labeled(pinned: Resolved, split: str, tokenizer, max_length: int | None = None) -> Labeled:
    """KTO's rows of a pinned source: (prompt, completion, label) as they are, or (prompt, chosen, rejected)
    unpaired; a DataError naming the source and the problem otherwise."""
    rows = read_rows(pinned, split)
    field, source = pinned.field, pinned.value
    names = rows.column_names
    if not {"prompt", "completion", "label"} <= set(names):
        if not {"prompt", "chosen", "rejected"} <= set(names):
            raise DataError(f"{field}: '{source}' needs the columns prompt, completion and label (TRL's unpaired "
                            f"preference form) or prompt, chosen and rejected (pairs); its columns: {names}")
        pairs = load_pairs(pinned, split, tokenizer, max_length)
        out = Labeled([], [], [], source, pairs.dropped, pairs.mismatched)
        for chosen, rejected, (c_len, r_len) in zip(pairs.chosen, pairs.rejected, pairs.prompt_lengths):
            out.ids += [chosen, rejected]
            out.prompt_lengths += [c_len, r_len]
            out.labels += [True, False]
        return out
    out = Labeled([], [], [], source)
    for i, row in enumerate(rows):
        where = f"{field}: row {i} of '{source}' (split '{split}')"
        if not isinstance(row["label"], bool):
            raise DataError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {row['label']!r}")
        ids, prompt_length, mismatched = sequence_ids(tokenizer, row["prompt"], row["completion"], where)
        out.mismatched += mismatched
        if max_length is not None and len(ids) > max_length:
            out.dropped += 1
            continue
        out.ids.append(ids)
        out.prompt_lengths.append(prompt_length)
        out.labels.append(row["label"])
    if not out.ids:
        raise DataError(f"{field}: no row of '{source}' (split '{split}') fits max_length={max_length} tokens")
    return out


# ---------------------------------------------------------------- the trainer

def labeled_batch(rows: dict, pad_id: int, kl: bool = False) -> dict[str, Tensor]:
    """This rank's rows (or their KL sequences) right-padded, in the layout models/stages/dpo.completion_logps reads."""
    prefix = "kl_" if kl else ""
    tokens, lengths = right_padded(rows[f"{prefix}ids"], pad_id)
    return {"tokens": tokens, "lengths": lengths, "prompt_lengths": torch.tensor(rows[f"{prefix}prompt_lengths"]),
            "labels": torch.tensor(rows["labels"], dtype=torch.bool), "n": len(rows["ids"])}


def all_logps(trainee, batch: dict, size: int, me, reference_too: bool = True) -> tuple[Tensor, Tensor | None]:
    """The summed completion log-probabilities of every row of `batch` under the policy (no gradient) and its
    reference, in forward passes of `size` rows that every rank runs as many of."""
    n, logps, refs = batch["n"], [], []
    for mb in equal_passes(me, micro_batches(n, size)):
        rows = torch.arange(n)[mb]
        logps.append(completion_logps(trainee, batch, rows)[0].double())
        if reference_too:
            refs.append(completion_logps(trainee, batch, rows, reference=True)[0].double())
    return torch.cat(logps)[:n], (torch.cat(refs)[:n] if reference_too else None)


def kl_term(trainee, rows: dict, train: KTOConfig, me) -> Tensor:
    """z0: the mean KL estimate on the mismatched KL sequences of the global batch, clamped at 0 (TRL's); 0 for
    apo_zero_unpaired, whose loss has none."""
    if train.loss_type != "kto":
        return torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        logps, refs = all_logps(trainee, labeled_batch(rows, trainee.pad_id, kl=True), train.micro_batch_size, me)
        total = me.all_reduce(torch.stack([(logps - refs).sum(), torch.tensor(float(len(logps)), dtype=torch.float64)]))
    return (total[0] / total[1].clamp(min=1)).clamp(min=0)


class KTO(DPO):
    """The policy against its frozen reference on labelled completions (built as DPO's); the loss is the mean over
    rows (TRL's)."""

    name, pairs = "kto", False

    def load_rows(self, source: Resolved, split: str, tokenizer, max_length: int | None) -> Labeled:
        return load_labeled(source, split, tokenizer, max_length)

    def step(self, trainee, cfg, mine):
        train = cfg.train
        batch = labeled_batch(mine, trainee.pad_id)
        kl = kl_term(trainee, mine, train, trainee.me)

        def micro_loss(idx: Tensor):
            logps, _ = completion_logps(trainee, batch, idx)
            ref_logps, _ = completion_logps(trainee, batch, idx, reference=True)
            loss, stats = kto_loss(logps, ref_logps, batch["labels"][idx], kl.float(), train.beta, train.loss_type,
                                   train.desirable_weight, train.undesirable_weight)
            return loss, {"loss": stats["loss"], "kl": stats["kl"]}  # per-label means are the held-out eval's
        return torch.ones(batch["n"]), micro_loss

    def evaluate(self, trainee, cfg, mine, rows, me):
        """eval/loss, eval/kl and TRL's eval/rewards/* and eval/logps/* over the held-out rows (float64), the KL
        term over all of them."""
        train = cfg.train
        kl = kl_term(trainee, mine, train, me)
        batch = labeled_batch(mine, trainee.pad_id)
        logps, refs = all_logps(trainee, batch, train.micro_batch_size, me)
        logps, refs = me.all_gather_cat(logps), me.all_gather_cat(refs)
        labels = me.all_gather_cat(batch["labels"].long())
        if not me.is_leader:
            return {}, []
        _, stats = kto_loss(logps, refs, labels, kl, train.beta, train.loss_type, train.desirable_weight,
                            train.undesirable_weight)
        return {f"eval/{name}": float(value) for name, value in stats.items()}, []
