"""The critic: a transformer backbone with a per-token value head, plus (optionally) a resident frozen reward model.

The value model is an `AutoModelForTokenClassification` with one label, so any architecture transformers supports
loads through the same `from_pretrained` path. It can be initialised from a reward-model checkpoint (backbone and the
reward head copied into the value head), as NeMo-Aligner does. `CriticTrainer` owns model, optimizer, schedule and
step; the in-process backend and the PyTriton server are thin adapters around it. All inputs use the wire layout of
the critic server: right-padded `tokens` [B, L] with `sequence_lengths` [B]; `returns`/`prev_values`/`mask` [B, L]
where position t holds the value of the prefix tokens[:t+1]. `critic_train` also takes them per action, [B, L-1]
(NeMo-Aligner's layout: position t is the value of tokens[:t+1], the state before action t+1), which is the same
thing without the last position; `train_arrays` turns it into [B, L] with a zero (masked) last column.

Bounds: `returns` and `prev_values` are finite and at most VALUE_BOUND (1e6) in magnitude, or the request is refused
naming the tensor: a finite 3e38 squares past float32's range in the value loss, and no return of a run is that
large (rewards of a reward model are logits, a reward function's are checked against the same bound). A step whose
loss or gradient norm is still not finite is skipped and counted (models/update.py: critic/skipped_steps).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from models.advantages import last_token_index
from models.config import CriticConfig
from models.distributed import SINGLE, Dist, full_state_dict, shard_model
from models.loading import DTYPES, autocast, checkpoint_activations, disable_dropout, from_pretrained, make_optimizer
from models.losses import explained_variance, value_loss
from models.reward import _head, check_loaded, load_reward_model, reward_model_scores
from models.safe_io import dcp_load, load_state
from models.update import micro_batches, minibatch_update


VALUE_BOUND = 1e6  # |returns|, |prev_values| a critic_train accepts (and |reward| a reward function may return)


class CriticInputError(ValueError):
    """A request that breaks the critic/reward wire contract; the message names the tensor and the expectation."""


def init_critic(critic_path: str | None, reward_path: str | None, dtype: str = "float32", field: str = "model.critic"):
    """Load a saved critic, or build one from a reward model (backbone + reward head copied into the value head).

    `dtype` is the dtype of the weights as loaded; the trainer keeps trainable weights in float32 (see CriticTrainer).
    """
    if critic_path:
        model = from_pretrained(AutoModelForTokenClassification, critic_path, field, dtype=DTYPES[dtype], num_labels=1)
    elif reward_path:
        rm, info = from_pretrained(AutoModelForSequenceClassification, reward_path, "model.reward", dtype=DTYPES[dtype],
                                   output_loading_info=True)
        check_loaded(info, reward_path, "model.reward")  # a critic copied from a random score head would be noise
        model = from_pretrained(AutoModelForTokenClassification, reward_path, "model.reward", dtype=DTYPES[dtype],
                                num_labels=1)
        value_head, reward_head = _head(model), _head(rm)
        with torch.no_grad():
            value_head.weight.copy_(reward_head.weight)
            if getattr(value_head, "bias", None) is not None:
                value_head.bias.copy_(reward_head.bias if getattr(reward_head, "bias", None) is not None else 0.0)
        del rm
    else:
        raise ValueError(f"{field}: give a critic checkpoint or a reward model to initialise the critic from")
    return disable_dropout(model)


def token_values(model, tokens: Tensor, lengths: Tensor) -> Tensor:
    """Per-position values [B, L] (float32); positions at or beyond the length are 0."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    attention_mask = (positions < lengths.unsqueeze(1)).long()
    values = model(input_ids=tokens, attention_mask=attention_mask).logits.squeeze(-1).float()
    return values * attention_mask


def validate_tokens(tokens: np.ndarray, sequence_lengths: np.ndarray, vocab_size: int | None = None) -> None:
    """Check `tokens` int64 [B,L] and `sequence_lengths` int64 [B,1] (or [B]) against the wire contract."""
    if tokens.dtype != np.int64:
        raise CriticInputError(f"tokens: expected dtype int64, got {tokens.dtype}")
    if tokens.ndim != 2:
        raise CriticInputError(f"tokens: expected rank 2 [B, L], got shape {list(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise CriticInputError(f"tokens: expected a non-empty batch [B>0, L>0], got shape {list(tokens.shape)}")
    if sequence_lengths.dtype != np.int64:
        raise CriticInputError(f"sequence_lengths: expected dtype int64, got {sequence_lengths.dtype}")
    column = sequence_lengths.ndim == 2 and sequence_lengths.shape[1] == 1
    lengths = sequence_lengths.reshape(-1) if column else sequence_lengths
    if lengths.ndim != 1:
        raise CriticInputError(f"sequence_lengths: expected shape [B, 1], got {list(sequence_lengths.shape)}")
    if lengths.shape[0] != tokens.shape[0]:
        raise CriticInputError(f"sequence_lengths: batch size {lengths.shape[0]} does not match tokens batch size "
                               f"{tokens.shape[0]}")
    if (lengths < 1).any() or (lengths > tokens.shape[1]).any():
        raise CriticInputError(f"sequence_lengths: every length must be in [1, L={tokens.shape[1]}], got min "
                               f"{lengths.min()} max {lengths.max()}")
    if vocab_size is not None and ((tokens < 0).any() or (tokens >= vocab_size).any()):
        raise CriticInputError(f"tokens: ids must be in [0, {vocab_size}), got min {tokens.min()} max {tokens.max()}")


def validate_train(tokens: np.ndarray, returns: np.ndarray, prev_values: np.ndarray, mask: np.ndarray) -> None:
    """Check the `critic_train` inputs: float32, finite, mask in {0, 1}, and all three [B, L] like tokens or all three
    [B, L-1] (per action, as NeMo-Aligner's RemoteGPTRMCriticClient sends them)."""
    if tokens.dtype != np.int64 or tokens.ndim != 2 or tokens.size == 0:
        raise CriticInputError(f"tokens: expected non-empty int64 [B, L], got {tokens.dtype} {list(tokens.shape)}")
    B, L = tokens.shape
    arrays = {"returns": returns, "prev_values": prev_values, "mask": mask}
    for name, array in arrays.items():
        if array.dtype != np.float32:
            raise CriticInputError(f"{name}: expected dtype float32, got {array.dtype}")
        if array.ndim != 2 or array.shape[0] != B or array.shape[1] not in (L, L - 1):
            raise CriticInputError(f"{name}: expected shape [{B}, {L}] (same as tokens) or [{B}, {L - 1}] (per "
                                   f"action, NeMo-Aligner's layout), got {list(array.shape)}")
        if not np.isfinite(array).all():
            raise CriticInputError(f"{name}: contains NaN or Inf")
        if name != "mask" and array.size and np.abs(array).max() > VALUE_BOUND:
            raise CriticInputError(f"{name}: |values| must be at most {VALUE_BOUND:g}, got {np.abs(array).max():.3g} "
                                   f"(it would overflow the value loss)")
    widths = [a.shape[1] for a in arrays.values()]
    if len(set(widths)) > 1:  # three tensors, two widths: name the odd one out
        odd = next(n for n, w in zip(arrays, widths) if widths.count(w) == 1)
        others = [n for n in arrays if n != odd]
        raise CriticInputError(f"{odd}: shape {list(arrays[odd].shape)} but {others[0]} and {others[1]} are "
                               f"{list(arrays[others[0]].shape)}: returns, prev_values and mask must share one "
                               f"layout, [{B}, {L}] (same as tokens) or [{B}, {L - 1}] (per action)")
    if not np.isin(mask, (0.0, 1.0)).all():
        raise CriticInputError("mask: values must be 0 or 1")
    if mask.sum() == 0:
        raise CriticInputError("mask: no position is 1, nothing to train on")


def train_arrays(tokens: np.ndarray, returns: np.ndarray, prev_values: np.ndarray,
                 mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate the `critic_train` inputs and return them in the [B, L] layout the trainer uses.

    Per-action inputs [B, L-1] (NeMo-Aligner: position t = value of tokens[:t+1], for action t+1; its critic
    trains values[:, :-1] against them) are the [B, L] layout without its last position, which holds the value of
    the whole sequence and has no action after it: append a zero column, masked out, so both layouts train alike.
    """
    validate_train(tokens, returns, prev_values, mask)
    if mask.shape[1] == tokens.shape[1] - 1:
        returns, prev_values, mask = (np.pad(a, ((0, 0), (0, 1))) for a in (returns, prev_values, mask))
    return tokens, returns, prev_values, mask


class CriticTrainer:
    """Critic weights + optimizer + schedule + step, and (optionally) the resident frozen reward model.

    On several ranks (`me`) every method runs on every rank at once (rank 0 of the critic server tells the others
    what to run): the critic is sharded with FSDP2, each rank computes its block of the batch's rows, rank 0 gets
    the results, and the update loop gives what one rank computes on the whole batch. The reward model is frozen and
    replicated. One (re-entrant) lock serialises infer/train/save, so a request never sees half-updated weights.
    """

    def __init__(self, cfg: CriticConfig, critic_path: str | None, reward_path: str | None, combine_reward: bool,
                 dtype: str = "float32", device: str | torch.device = "cpu", checkpoint_dir: str | Path | None = None,
                 token_rewards: bool = True, me: Dist = SINGLE, gradient_checkpointing: bool = False,
                 normalize_reward: bool = False):
        self.cfg, self.device, self.me = cfg, torch.device(device), me
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.lock = threading.RLock()
        self.step = 0
        self.warning: str | None = None
        resume = self.checkpoint_dir is not None and (self.checkpoint_dir / "critic_state.pt").exists()
        source = str(self.checkpoint_dir / "model") if resume else critic_path
        self.dtype = dtype  # compute dtype (autocast); the trainable weights and AdamW states stay float32
        self.model = init_critic(source, reward_path, "float32").to(self.device)
        if gradient_checkpointing:
            checkpoint_activations(self.model, "model.critic")
        self.model.train()
        self.sharded = me.active
        if self.sharded:
            self.model = shard_model(self.model, dtype)
        self.reward_model = (load_reward_model(reward_path, dtype, self.device, normalize=normalize_reward)
                             if combine_reward else None)
        # the resident reward model also scores the critic's (= the policy's) tokens only if it shares their tokenizer;
        # otherwise it scores text (reward_text) with its own
        self.token_rewards = self.reward_model is not None and token_rewards
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg.optim)
        if resume:
            self._restore(self.checkpoint_dir)

    @property
    def vocab_size(self) -> int:
        """The critic's vocabulary: the servers refuse token ids outside it (components/serving/triton)."""
        return int(self.model.config.vocab_size)

    def _rows(self, n: int) -> tuple[slice, list[slice | None]]:
        """This rank's rows of a batch of n, and its micro-batches: as many on every rank (None: a pass whose
        result is dropped, so FSDP's collectives line up)."""
        mine = self.me.shard(n)
        chunks = micro_batches(mine.stop - mine.start, self.cfg.micro_batch_size)
        count = int(self.me.all_reduce(torch.tensor(len(chunks)), op="max"))
        return mine, chunks + [None] * (count - len(chunks))

    @torch.no_grad()
    def infer(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor | None]:
        """values [B, L] and, when the reward model scores these tokens, rewards [B] (on rank 0; None elsewhere)."""
        with self.lock:
            tokens, lengths = tokens.to(self.device), lengths.to(self.device)
            mine, chunks = self._rows(len(tokens))
            tok, ln = tokens[mine], lengths[mine]
            values = self._values_no_grad(tok, ln, chunks)
            rewards = None
            if self.token_rewards:
                with autocast(self.device, self.dtype):
                    rewards = torch.cat([reward_model_scores(self.reward_model, tok[mb], ln[mb])
                                         for mb in chunks if mb is not None] or [torch.zeros(0)])
            values = self.me.all_gather_cat(values.cpu())
            rewards = self.me.all_gather_cat(rewards.cpu()) if rewards is not None else None
        return values, rewards

    @torch.no_grad()
    def _values_no_grad(self, tokens: Tensor, lengths: Tensor, chunks: list[slice | None]) -> Tensor:
        """Values of this rank's rows in micro-batches (a 1B critic does not take a whole batch in one forward)."""
        self.model.eval()
        out = []
        with autocast(self.device, self.dtype):
            for mb in chunks:
                values = token_values(self.model, tokens[mb or slice(0, 1)], lengths[mb or slice(0, 1)])
                if mb is not None:
                    out.append(values.float())
        self.model.train()
        return torch.cat(out) if out else torch.zeros((0, tokens.shape[1]), device=tokens.device)

    def train(self, tokens: Tensor, returns: Tensor, prev_values: Tensor, mask: Tensor) -> dict[str, float]:
        """The shared update loop (models/update.py): epochs over shuffled batches of `train_batch_size`, micro-batched,
        clipped value loss, grad clipping, optimizer + schedule; each rank holds its block of the rows."""
        B = tokens.shape[0]
        # causal model: the values up to the last masked position do not depend on later tokens
        lengths = last_token_index(mask) + 1
        with self.lock:
            mine, chunks = self._rows(B)
            tok, ret, old, m, ln = (t[mine].to(self.device) for t in (tokens, returns, prev_values, mask, lengths))

            def micro_loss(idx: Tensor):
                idx = idx.to(self.device)
                with autocast(self.device, self.dtype):
                    values = token_values(self.model, tok[idx], ln[idx])
                loss, stats = value_loss(values, old[idx], ret[idx], m[idx], self.cfg.loss_clip_val)
                return loss, {"loss_mean": loss.detach(), "clipfrac": stats["clipfrac"]}

            self.model.train()
            out = minibatch_update(list(self.model.parameters()), self.optimizer, self.scheduler, micro_loss,
                                   m.sum(1).cpu(), torch.arange(mine.start, mine.stop), B, self.cfg.train_batch_size,
                                   self.cfg.epochs, self.cfg.micro_batch_size, self.cfg.optim.grad_clip,
                                   torch.Generator().manual_seed(self.step), self.me, sharded=self.sharded)
            self.step += out["steps"]
            values = self.me.all_gather_cat(self._values_no_grad(tok, ln, chunks).cpu())
            ev = float(explained_variance(values, returns, mask))
        return {"loss_mean": out["loss_mean"], "grad_norm": out["grad_norm"], "clipfrac": out["clipfrac"],
                "explained_variance": ev, "step": self.step, "lr": self.scheduler.get_last_lr()[0],
                "skipped_steps": out["skipped_steps"]}

    def save(self, directory: str | Path | None = None, staging: str | Path | None = None) -> Path:
        """Write full weights (rank 0, loadable by a 1-rank server) + the optimizer sharded through
        torch.distributed.checkpoint + scheduler, step and world size, atomically: into `staging` (rank 0 chooses it
        and hands it to the others), then renamed over the target."""
        import torch.distributed.checkpoint as dcp  # heavy (~1.7 s): only sharded saves need it
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # heavy: as dcp above

        target = Path(directory) if directory else self.checkpoint_dir
        if target is None:
            raise ValueError("critic_save: no checkpoint directory configured (--checkpoint-dir)")
        with self.lock:
            if staging is None:
                target.parent.mkdir(parents=True, exist_ok=True)
                staging = tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent)
            tmp = Path(staging)
            weights = full_state_dict(self.model)
            if self.me.is_leader:
                self.model.save_pretrained(tmp / "model", state_dict=weights)
            # a critic of its own (one rank) in a process whose actor has a group (`rlhf train` on N ranks, the critic
            # in process) saves alone: the actor's other ranks take no part
            dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)},
                     checkpoint_id=str(tmp / "optimizer"), no_dist=not self.me.active)
            self.me.barrier()
            if self.me.is_leader:
                torch.save({"scheduler": self.scheduler.state_dict(), "step": self.step,
                            "world_size": self.me.world_size}, tmp / "critic_state.pt")
                (tmp / "critic.json").write_text(json.dumps({"step": self.step, "world_size": self.me.world_size}))
                old = None
                if target.exists():
                    old = target.with_name(f".{target.name}.old-{os.getpid()}")
                    os.replace(target, old)
                os.replace(tmp, target)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
            self.me.barrier()
        return target

    def _restore(self, directory: Path) -> None:
        """Scheduler and step from a save; the optimizer too when it was saved by as many ranks (else it starts
        fresh, with a warning: the weights are the full ones either way)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # heavy

        state = load_state(directory / "critic_state.pt")
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        saved = int(state.get("world_size", 1))
        if saved != self.me.world_size:
            self.warning = (f"critic checkpoint {directory} was saved by {saved} rank(s), serving on "
                            f"{self.me.world_size}: weights restored, optimizer states start fresh")
            return
        shards = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        dcp_load(shards, directory / "optimizer", no_dist=not self.me.active)
        set_optimizer_state_dict(self.model, self.optimizer, shards["optimizer"])
