"""The DPO stage (Rafailov et al. 2023) on the actor's ranks, as TRL 1.16's DPOTrainer computes it: the policy and its
frozen reference (the model it starts from: in a pipeline the SFT model; with LoRA the same model, its adapters
disabled) each score the chosen and the rejected completion of every pair, as the sum of its completion tokens'
log-probabilities (the prompt's carry none); the loss is models/losses.dpo_loss of those sums. One forward pass of
the policy and one of the reference per micro-batch, chosen and rejected rows together (TRL concatenates them too).

Held out, the implicit reward beta x (log pi - log pi_ref) of each completion ranks the pair: eval/rewards/accuracies
is the share of held-out pairs whose chosen completion it ranks first, with TRL's other metrics beside it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from models.losses import completion_mask, dpo_loss
from models.policy import Policy
from models.stages.train import StageKind, equal_passes, pair_batch
from models.update import micro_batches


def completion_logps(policy: Policy, batch: dict, rows: Tensor, reference: bool = False) -> tuple[Tensor, Tensor]:
    """(the summed log-probability of each row's completion tokens [n], their count [n]) under the policy or its
    frozen reference, for the rows `rows` of a pair batch."""
    tokens, lengths = batch["tokens"][rows], batch["lengths"][rows]
    mask = completion_mask(batch["prompt_lengths"][rows], lengths, tokens.shape[1])
    logp, _ = policy.logprobs(tokens, lengths, reference=reference)
    return (logp.float().cpu() * mask).sum(1), mask.sum(1)


class DPO(StageKind):
    """The policy against its frozen reference on preference pairs; the loss is the mean over pairs (TRL's)."""

    name, pairs = "dpo", True

    def build(self, cfg, path, device, me, shard):
        train = cfg.train
        return Policy.load(path, train.lora, train.dtype, device, field="model", me=me, shard=shard,
                           reference_device=cfg.deploy.reference_device)

    def step(self, trainee, cfg, mine):
        batch = pair_batch(mine, trainee.pad_id)
        k, train = batch["n"], cfg.train

        def micro_loss(idx: Tensor):
            both = torch.cat([idx, idx + k])  # the chosen rows, then their rejected rows
            logps, tokens = completion_logps(trainee, batch, both)
            ref_logps, _ = completion_logps(trainee, batch, both, reference=True)
            n = len(idx)
            return dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], train.beta, train.loss_type,
                            tokens[:n], tokens[n:])
        return torch.ones(k), micro_loss

    def evaluate(self, trainee, cfg, mine, rows, me):
        """eval/loss and TRL's eval/rewards/* and eval/logps/* over the held-out pairs (float64 from the summed
        log-probabilities); a row per pair with its implicit rewards."""
        batch = pair_batch(mine, trainee.pad_id)
        k, train = batch["n"], cfg.train
        parts: dict[str, list[Tensor]] = {"logps": [], "ref": [], "tokens": []}
        for mb in equal_passes(me, micro_batches(k, train.micro_batch_size)):
            idx = torch.arange(k)[mb]
            both = torch.cat([idx, idx + k])
            logps, tokens = completion_logps(trainee, batch, both)
            ref_logps, _ = completion_logps(trainee, batch, both, reference=True)
            n = len(idx)
            for name, value in (("logps", logps), ("ref", ref_logps), ("tokens", tokens)):
                parts[name].append(torch.stack([value[:n], value[n:]], 1).double())  # [n, 2]: chosen, rejected
        gathered = {name: me.all_gather_cat(torch.cat(values)[:k]) for name, values in parts.items()}
        if not me.is_leader:
            return {}, []
        logps, ref, tokens = gathered["logps"], gathered["ref"], gathered["tokens"]
        loss, stats = dpo_loss(logps[:, 0], logps[:, 1], ref[:, 0], ref[:, 1], train.beta, train.loss_type,
                               tokens[:, 0], tokens[:, 1])
        metrics = {f"eval/{name}": float(value) for name, value in stats.items()}
        metrics["eval/pairs"] = float(len(logps))
        rewards = train.beta * (logps - ref)
        return metrics, [{"chosen_reward": float(c), "rejected_reward": float(r)} for c, r in rewards.tolist()]
