"""The stages that train on the actor's ranks: what each rank builds, its optimizer step and its held-out eval (the
work of a stage's `step` and `evaluate` commands: models/loop.execute, on the ranks of an RL run:
components/launch/ranks.py). A stage is a `StageKind`: what it trains, its loss on a batch of rows and its held-out
metrics; the rest (optimizer, steps, evals, checkpoints, export) is one code path for every stage, and the loop,
the commands and the checkpoints are an RL run's (models/loop.py).

    sft            the policy (models/policy.Policy, no reference copy), loss on completion tokens
    (models/losses.sft_loss)
    reward_model   an AutoModelForSequenceClassification with one label (`Scorer`), Bradley-Terry on pairs
                   (models/losses.bradley_terry_loss), each sequence scored at its last real token
    dpo            the policy and its frozen reference on pairs (models/stages/dpo.py, models/losses.dpo_loss)
    kto            the policy and its frozen reference on labelled completions (models/stages/kto.py)

One optimizer step per `step` command, through the one update loop of the actor and the critic (models/update.py):
rank 0 sends the step's global batch, every rank trains on its block of it, micro-batches weighted by their share of
the batch's completion tokens (SFT: TRL's token mean over the batch) or pairs (reward model: the mean over pairs), so
the step is the single-process step whatever the world size. FSDP2 shards a full fine-tune over the ranks; LoRA
replicates the frozen base. Checkpoints are the RL actor's (models/loop.save_actor / restore_actor): full HF weights
(or the adapter) written by rank 0, the optimizer sharded, the schedule and counters beside. The stage's output is
exported from its last checkpoint as every job's is (models/export.py, components/export.py).

Padding: every batch is right-padded and a sequence is scored at index length-1: the padding (and only the padding)
holds an id the config names as the pad id for that forward, so a pad id equal to EOS cannot move the scored
position onto the token before the EOS (the reward collator pitfall of TRL #937).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification

from models.distributed import SINGLE, Dist, shard_model
from models.loading import adapters_in_float32, autocast, base_dtype, disable_dropout, from_pretrained
from models.losses import bradley_terry_loss, completion_mask, sft_loss
from models.policy import Policy, load_policy_tokenizer, load_trained, save_trained
from models.resolve import Resolved
from models.stages.config import StageRun
from models.stages.data import load_pairs, load_sequences, right_padded
from models.update import MicroLoss, micro_batches, minibatch_update


class Scorer:
    """A sequence-classification model with one label being trained (the reward model stage): the backbone of the
    model it starts from with a new score head, full fine-tune (FSDP2 over the ranks) or LoRA (the score head trains
    in full: peft's modules_to_save for SEQ_CLS)."""

    def __init__(self, model, tokenizer, lora: bool, dtype: str, me: Dist, device: torch.device, sharded: bool):
        self.model, self.tokenizer, self.lora, self.dtype, self.me = model, tokenizer, lora, dtype, me
        self.device, self.sharded = device, sharded

    @classmethod
    def load(cls, path: str, lora, dtype: str, device: torch.device, me: Dist = SINGLE, shard: bool = False,
             field: str = "model") -> "Scorer":
        tokenizer = load_policy_tokenizer(path, field)
        # one precision policy with the actor's (models/loading.base_dtype): float32 master weights for a full
        # fine-tune, sharded with the same MixedPrecisionPolicy; with LoRA the frozen base in the compute dtype
        model = from_pretrained(AutoModelForSequenceClassification, path, field, num_labels=1,
                                dtype=base_dtype(dtype, lora))
        if model.config.pad_token_id is None:  # HF's own pooling refuses batches without one (we score by length)
            model.config.pad_token_id = tokenizer.pad_token_id
        model = disable_dropout(model).to(device)
        if lora is not None and lora.enabled:
            from peft import LoraConfig as PeftLoraConfig, get_peft_model  # heavy: peft is needed only with LoRA

            model = adapters_in_float32(get_peft_model(model, PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                task_type="SEQ_CLS")))
            return cls(model, tokenizer, True, dtype, me, device, sharded=False)
        if shard:
            model = shard_model(model, dtype)
        return cls(model, tokenizer, False, dtype, me, device, sharded=shard)

    def scores(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Scores [B] of right-padded tokens [B, L] at index lengths-1, with gradients (unless under no_grad).

        The model's own forward scores them (so FSDP2 sees its output in the backward pass), and HF pools at the
        last token that differs from config.pad_token_id: for this forward the padding, and only the padding, holds
        an id no real token of the batch has, and the config names it (a pad id equal to EOS would otherwise move
        the scored position onto the token before the EOS: TRL #937)."""
        tokens, lengths = tokens.to(self.device), lengths.to(self.device)
        real = torch.arange(tokens.shape[1], device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        present = torch.zeros(self.model.get_input_embeddings().num_embeddings, dtype=torch.bool, device=self.device)
        present[tokens[real]] = True
        pad = int((~present).nonzero()[0])  # a batch holds fewer distinct ids than the vocabulary
        config = (self.model.get_base_model() if self.lora else self.model).config.get_text_config()
        saved, config.pad_token_id = config.pad_token_id, pad
        try:
            with autocast(self.device, self.dtype):
                logits = self.model(input_ids=torch.where(real, tokens, pad), attention_mask=real.long()).logits
        finally:
            config.pad_token_id = saved
        return logits.squeeze(-1).float().cpu()

    def trainable_parameters(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, directory) -> None:
        """HF save_pretrained (LoRA: the adapter and the score head) plus the tokenizer, by rank 0 from the full state
        dict; a collective call on every rank."""
        save_trained(self.model, self.tokenizer, self.me, directory)

    def load_weights(self, directory) -> None:
        load_trained(self.model, AutoModelForSequenceClassification, directory, self.lora, self.me)


@dataclass
class StageState:
    """Everything about this rank's trainee that a checkpoint restores; shaped as models/actor.ActorState is where
    models/loop.save_actor / restore_actor read it (`policy` is the model being trained, either kind)."""

    policy: Policy | Scorer
    kind: "StageKind"
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    generator: torch.Generator  # unused by the update (no sampling); kept per rank as the actor's is
    shuffle: torch.Generator  # micro-batch order inside a step: the same stream on every rank
    me: Dist = SINGLE
    iteration: int = 0  # optimizer steps taken
    episode: int = 0  # rows (pairs) consumed, all ranks
    data: dict | None = None  # where the row stream stands after the last step (RowStream.state)

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "shuffle": self.shuffle.get_state(),
                "iteration": self.iteration, "episode": self.episode, "data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle.set_state(state["shuffle"])
        self.iteration, self.episode, self.data = int(state["iteration"]), int(state["episode"]), state.get("data")


class StageKind:
    """What a stage trains and measures: its trainee, the loss of a batch of its rows, its held-out metrics."""

    name: str
    pairs: bool  # trains on preference pairs (models/stages/data.load_pairs), else on SFT rows (load_sequences)
    task = "causal-lm"  # how its trained model exports (models/export.py): a policy
    held_out_in_model = False  # whether its model carries what its last held-out eval measured (`model_config`)

    def model_config(self, trainee, data, evaluations: list[dict]) -> dict | None:
        """What its model's config.json carries beside its weights (None: nothing), from its trainee on its ranks,
        its training rows and its held-out evals."""
        return None

    def load_rows(self, source: Resolved, split: str, tokenizer, max_length: int | None):
        """Its rows of a pinned `source` tokenized (models/stages/data.py): preference pairs, or SFT rows."""
        load = load_pairs if self.pairs else load_sequences
        return load(source, split, tokenizer, max_length)

    def build(self, cfg: StageRun, path: str, device: torch.device, me: Dist, shard: bool):
        """This rank's trainee, from the model at `path`."""
        raise NotImplementedError

    def step(self, trainee, cfg: StageRun, mine: dict) -> tuple[Tensor, MicroLoss]:
        """(the weight of each of this rank's rows in the step's loss, the loss of a micro-batch of them)."""
        raise NotImplementedError

    def evaluate(self, trainee, cfg: StageRun, mine: dict, rows: dict, me: Dist) -> tuple[dict[str, float], list[dict]]:
        """The held-out metrics of the global `rows` (`mine`: this rank's block): rank 0's, ({}, []) elsewhere."""
        raise NotImplementedError


class SFT(StageKind):
    """Completion-only SFT: the mean -log p of the completion tokens over the batch (TRL's token mean)."""

    name, pairs = "sft", False

    def build(self, cfg, path, device, me, shard):
        train = cfg.train
        return Policy.load(path, train.lora, train.dtype, device, field="model", me=me, shard=shard, reference=False)

    def step(self, trainee, cfg, mine):
        batch = sft_batch(mine, trainee.pad_id)

        def micro_loss(idx: Tensor):
            logp, _ = trainee.logprobs(batch["tokens"][idx], batch["lengths"][idx])
            return sft_loss(logp.cpu(), batch["mask"][idx])
        return batch["mask"].sum(1), micro_loss  # completion tokens per row: the loss is their mean over the batch

    def evaluate(self, trainee, cfg, mine, rows, me):
        """eval/loss (the mean -log p over completion tokens), eval/num_tokens."""
        batch = sft_batch(mine, trainee.pad_id)
        sums, tokens = [], []
        for mb in equal_passes(me, micro_batches(len(batch["tokens"]), cfg.train.micro_batch_size)):
            logp, _ = trainee.logprobs(batch["tokens"][mb], batch["lengths"][mb])
            mask = batch["mask"][mb]
            sums.append((-logp.cpu().double() * mask).sum(1))
            tokens.append(mask.sum(1).double())
        n = len(batch["tokens"])
        nll, count = me.all_gather_cat(torch.cat(sums)[:n]), me.all_gather_cat(torch.cat(tokens)[:n])
        if not me.is_leader:
            return {}, []
        return {"eval/loss": float(nll.sum() / count.sum().clamp(min=1)), "eval/num_tokens": float(count.sum())}, []


class RewardModel(StageKind):
    """Bradley-Terry on pairs, the mean over pairs (TRL's RewardTrainer)."""

    name, pairs = "reward_model", True
    task = "sequence-classification"  # one label
    held_out_in_model = True  # its reward statistics: which held-out rows it reads changes its output
    stats_rows = 1000  # pairs whose rewards give its reward statistics when it has no held-out split

    def model_config(self, trainee, data, evaluations: list[dict]) -> dict:
        """reward_mean and reward_std (what `reward.normalize` reads) of its last held-out eval, else of up to
        `stats_rows` training pairs scored now (all ranks take part)."""
        last = evaluations[-1] if evaluations else \
            trainee.evaluate(data.rows(list(range(min(len(data), self.stats_rows)))))[0]
        return {"reward_mean": last["reward_mean"], "reward_std": last["reward_std"]}

    def build(self, cfg, path, device, me, shard):
        return Scorer.load(path, cfg.train.lora, cfg.train.dtype, device, me, shard)

    def step(self, trainee, cfg, mine):
        batch = pair_batch(mine, trainee.tokenizer.pad_token_id)
        k = batch["n"]

        def micro_loss(idx: Tensor):
            both = torch.cat([idx, idx + k])
            scores = trainee.scores(batch["tokens"][both], batch["lengths"][both])
            margin = batch["margin"][idx] if "margin" in batch else None
            return bradley_terry_loss(scores[:len(idx)], scores[len(idx):], margin,
                                      cfg.train.center_rewards_coefficient)
        return torch.ones(k), micro_loss  # the loss is the mean over pairs

    def evaluate(self, trainee, cfg, mine, rows, me):
        """TRL's metrics (eval/accuracy, eval/margin, eval/min|mean|max_reward), eval/loss and the reward statistics
        of all held-out rewards (reward_mean, reward_std: what is stored with the model); a row per pair."""
        batch = pair_batch(mine, trainee.tokenizer.pad_token_id)
        k = batch["n"]
        chosen, rejected = [], []
        for mb in equal_passes(me, micro_batches(k, cfg.train.micro_batch_size)):
            idx = torch.arange(k)[mb]
            scores = trainee.scores(batch["tokens"][torch.cat([idx, idx + k])],
                                    batch["lengths"][torch.cat([idx, idx + k])])
            chosen.append(scores[:len(idx)].double())
            rejected.append(scores[len(idx):].double())
        chosen, rejected = me.all_gather_cat(torch.cat(chosen)[:k]), me.all_gather_cat(torch.cat(rejected)[:k])
        if not me.is_leader:
            return {}, []
        margin = torch.tensor(rows["margin"], dtype=torch.float64) if "margin" in rows else None
        loss, stats = bradley_terry_loss(chosen, rejected, margin, cfg.train.center_rewards_coefficient)
        both = torch.cat([chosen, rejected])
        metrics = {f"eval/{name}": float(value) for name, value in {**stats, "loss": loss}.items()}
        metrics.update({"eval/pairs": float(len(chosen)), "reward_mean": float(both.mean()),
                        "reward_std": float(both.std()) if len(both) > 1 else 1.0})
        return metrics, [{"chosen_score": float(c), "rejected_score": float(r)} for c, r in zip(chosen, rejected)]


# ---------------------------------------------------------------- the batch of a command, on this rank

def sft_batch(rows: dict, pad_id: int) -> dict[str, Tensor]:
    tokens, lengths = right_padded(rows["ids"], pad_id)
    prompt_lengths = torch.tensor(rows["prompt_lengths"])
    mask = completion_mask(prompt_lengths, lengths, tokens.shape[1])
    for i, own in enumerate(rows.get("masks") or []):  # a tool-calling conversation: its assistant turns only
        if own is not None:
            mask[i] = 0
            mask[i, :len(own) - 1] = torch.tensor(own[1:], dtype=mask.dtype)
    return {"tokens": tokens, "lengths": lengths, "mask": mask}


def pair_batch(rows: dict, pad_id: int) -> dict[str, Tensor]:
    """Chosen rows 0..n-1 then rejected rows n..2n-1, right-padded to one width; each row's prompt length."""
    tokens, lengths = right_padded(rows["chosen"] + rows["rejected"], pad_id)
    out = {"tokens": tokens, "lengths": lengths, "n": len(rows["chosen"])}
    if "prompt_lengths" in rows:
        out["prompt_lengths"] = torch.tensor([c for c, _ in rows["prompt_lengths"]]
                                             + [r for _, r in rows["prompt_lengths"]],
                                             dtype=torch.long)
    if "margin" in rows:
        out["margin"] = torch.tensor(rows["margin"], dtype=torch.float32)
    return out


def my_rows(rows: dict, me: Dist) -> tuple[dict, Tensor, int]:
    """This rank's block of a command's global rows, their global numbers and the global count."""
    n = len(next(iter(rows.values())))
    block = me.shard(n)
    return {k: v[block] for k, v in rows.items()}, torch.arange(block.start, block.stop), n


# ---------------------------------------------------------------- one optimizer step

def train_step(state: StageState, cfg: StageRun, rows: dict) -> dict[str, float]:
    """One optimizer step on the global batch `rows` (this rank trains on its block); returns the step's stats
    (token- or pair-weighted over the batch, the same on every rank)."""
    train, trainee = cfg.train, state.policy
    mine, global_rows, n = my_rows(rows, state.me)
    trainee.model.train()
    weights, micro_loss = state.kind.step(trainee, cfg, mine)
    stats = minibatch_update(trainee.trainable_parameters(), state.optimizer, state.scheduler, micro_loss, weights,
                             global_rows, n, n, 1, train.micro_batch_size, train.optim.grad_clip, state.shuffle,
                             state.me, sharded=trainee.sharded)
    state.iteration += 1
    state.episode += n
    out = {f"train/{k}": v for k, v in stats.items() if k not in ("steps",)}
    out.update({"learning_rate": float(state.scheduler.get_last_lr()[0]), "step": float(state.iteration),
                "rows": float(state.episode)})
    return out


# ---------------------------------------------------------------- held-out eval

@torch.no_grad()
def evaluate(state: StageState, cfg: StageRun, rows: dict) -> tuple[dict[str, float], list[dict]]:
    """The held-out metrics of the global rows `rows` (every rank scores its block; rank 0 returns them, the others
    ({}, [])): the stage kind's (SFT: eval/loss; reward model: TRL's accuracy and margin, the reward statistics; DPO:
    the implicit rewards' accuracy and margins)."""
    trainee = state.policy
    mine, _, _ = my_rows(rows, state.me)
    was_training = trainee.model.training
    trainee.model.eval()
    try:
        return state.kind.evaluate(trainee, cfg, mine, rows, state.me)
    finally:
        trainee.model.train(was_training)


def equal_passes(me: Dist, chunks: list[slice]) -> list[slice]:
    """`chunks`, then empty passes until every rank has run as many forward passes as the one with the most (with
    FSDP each pass is a collective); an empty pass reads row 0 and is cut off by the caller."""
    count = int(me.all_reduce(torch.tensor(len(chunks)), op="max"))
    return chunks + [slice(0, 1)] * (count - len(chunks))


def total_steps(train, rows: int) -> int:
    """Optimizer steps of a stage: max_steps, else epochs x rows / batch_size rounded up."""
    return train.max_steps or math.ceil(train.epochs * rows / train.batch_size)
