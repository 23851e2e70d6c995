"""The critic server's models as PyTriton callables (critic_infer, critic_train, critic_save, around models/critic.py),
how rank 0 loads them, and the critic's other ranks (deploy.critic.nproc_per_node > 1): rank 0 starts them, hands them
the ServerSpec and tells them what to run; `CriticTrainer.lock` serialises infer/train/save on every rank. The ranks
admit each other by the run's secret (the server's own, else one rank 0 makes and hands to them in their
environment) and send each other JSON and tensors (models/distributed.py)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from components.launch.processes import exit_with_parent
from components.launch.followers import BACKEND_ENV, TIMEOUT_ENV, Followers
from components.serving.auth import ranks_secret, read_secret
from components.serving.triton.contract import (PENDING_PREFIX, TRAIN_STATS, ModelSpec, ServerSpec, check_positions,
                                                check_vocab, critic_specs, refuse_infer_inputs, request_array,
                                                reward_text_spec, stack_requests)
from components.serving.triton.reward import RewardCallables
from components.storage.store import CheckpointStore
from models import distributed
from models.critic import CriticInputError, CriticTrainer, train_arrays, validate_tokens
from models.prepare import reward_transport
from models.reward import load_reward_tokenizer

LOG = logging.getLogger("rlhf.server")


class CriticCallables:
    """The three critic models as PyTriton callables (lists of requests in, list of responses out)."""

    def __init__(self, trainer: CriticTrainer, store=None, max_train_rows: int = 4096):
        self.trainer, self.store, self.max_train_rows = trainer, store, max_train_rows
        self._save_lock = threading.Lock()

    def _all(self, op: str, *args):
        """Run a trainer method on every rank: tell the other ranks (what, with which batch), then run it here; the
        trainer's lock keeps the order of operations the same on all ranks."""
        with self.trainer.lock:
            self.trainer.me.broadcast_object((op, args))
            return getattr(self.trainer, op)(*args)

    def infer(self, requests):
        parts = []
        for request in requests:
            refuse_infer_inputs(request)
            tokens, lengths = request_array(request, "tokens"), request_array(request, "sequence_lengths")
            validate_tokens(tokens, lengths, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            parts.append((tokens, lengths.reshape(-1)))
        tokens, lengths, sizes = stack_requests(parts)
        values, rewards = self._all("infer", tokens, lengths)
        responses, start = [], 0
        for (t, _), size in zip(parts, sizes):
            response = {"values": values[start:start + size, :t.shape[1]].numpy().astype(np.float32)}
            if rewards is not None:
                response["rewards"] = rewards[start:start + size].numpy().astype(np.float32).reshape(-1, 1)
            responses.append(response)
            start += size
        return responses

    def train(self, requests):
        responses = []
        for request in requests:  # batching is off: one request per call
            arrays = (request_array(request, n) for n in ("tokens", "returns", "prev_values", "mask"))
            tokens, returns, prev_values, mask = train_arrays(*arrays)  # [B,L-1] per action -> [B,L]
            if tokens.shape[0] > self.max_train_rows:
                raise CriticInputError(f"tokens: batch of {tokens.shape[0]} rows exceeds this server's "
                                       f"max_train_rows={self.max_train_rows} (deploy.critic.max_train_rows): send it "
                                       f"in parts")
            check_vocab(tokens, self.trainer.vocab_size)
            check_positions(tokens, self.trainer.model)
            stats = self._all("train", *(torch.as_tensor(np.array(a)) for a in (tokens, returns, prev_values, mask)))
            if stats["skipped_steps"]:
                LOG.warning("critic_train: %d optimizer step(s) skipped: loss or gradient norm not finite (the "
                            "weights are as before those steps)", stats["skipped_steps"])
            response = {name: np.array([stats[name]], dtype=np.float32) for name in TRAIN_STATS}
            response["step"] = np.array([stats["step"]], dtype=np.int64)
            responses.append(response)
        return responses

    def save(self, requests):
        with self._save_lock:
            target = self.trainer.checkpoint_dir
            if target is None:
                raise ValueError("critic_save: no checkpoint directory configured (--checkpoint-dir)")
            target.parent.mkdir(parents=True, exist_ok=True)
            path = self._all("save", None, tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            step = self.trainer.step
            # with a store (a server that may sit on another node than the flow): upload the save where the flow's
            # next checkpoint adopts it into iter_<N>/critic; the local path otherwise
            location = (self.store.put_dir(path, f"{PENDING_PREFIX}/step-{step}") if self.store is not None
                        else str(path))
        LOG.info("critic_save: step %d -> %s", step, location)
        return [{"status": np.array([0], dtype=np.int64), "step": np.array([step], dtype=np.int64),
                 "path": np.array([location.encode()], dtype=np.bytes_)} for _ in requests]

    def bindings(self, max_batch_size: int, max_queue_delay_us: int) -> list[tuple[ModelSpec, Callable]]:
        specs = critic_specs(self.trainer.token_rewards, max_batch_size, max_queue_delay_us)
        return list(zip(specs, (self.infer, self.train, self.save)))


def load_critic(spec: ServerSpec) -> tuple[list[tuple[ModelSpec, Callable]], object]:
    """Rank 0 of the critic server: restore from the run's store if asked, start the other ranks (critic.nproc_per_node
    > 1), build the critic on every rank, and bind the callables (which tell the other ranks what to run)."""
    cfg = spec.config
    if cfg.critic_carries_reward and not cfg.model.reward:
        raise ValueError("critic server: combining rewards needs a reward model (model.reward) or "
                         "critic.combine_reward=false")
    store = None
    if spec.checkpoint_uri:
        store = CheckpointStore.from_uri(spec.checkpoint_uri, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
        if spec.restore_iteration is not None:
            if not spec.checkpoint_dir:
                raise ValueError("critic server: restore_iteration needs a checkpoint_dir to restore into")
            store.load_part(spec.restore_iteration, "critic", Path(spec.checkpoint_dir))
            LOG.info("critic: restored iter_%d/critic from %s", spec.restore_iteration, store.uri)
    group = None
    me = None
    if cfg.deploy.critic.nproc_per_node > 1:
        group, me = _start_critic_ranks(spec)
    trainer, reward_tokenizer = _critic_trainer(spec, me)
    LOG.info("critic: %d rank(s), step %d, checkpoint dir %s, reward model %s", trainer.me.world_size, trainer.step,
             spec.checkpoint_dir, ("combined (tokens and text)" if trainer.token_rewards else "combined (text only)")
             if trainer.reward_model is not None else "not loaded")
    if trainer.warning:
        LOG.warning(trainer.warning)
    callables = CriticCallables(trainer, store, cfg.deploy.critic.max_train_rows)
    bindings = callables.bindings(spec.max_batch_size, cfg.deploy.critic.max_queue_delay_us)
    if trainer.reward_model is not None:
        text = RewardCallables(model=trainer.reward_model, reward_tokenizer=reward_tokenizer,
                               chat_template=cfg.reward.chat_template, lock=trainer.lock)
        bindings.append((reward_text_spec(spec.max_batch_size, cfg.deploy.critic.max_queue_delay_us), text.text))
    return bindings, group


def _critic_trainer(spec: ServerSpec, me=None):
    """The critic of a spec on this rank (every rank builds it alike), and the reward model's tokenizer."""
    me = me or distributed.SINGLE
    cfg = spec.config
    critic_path = cfg.local_path("model.critic") if cfg.model.critic else None
    reward_path = cfg.local_path("model.reward") if cfg.model.reward else None
    reward_tokenizer = load_reward_tokenizer(reward_path) if cfg.critic_carries_reward else None
    # critic_infer scores the critic's (= the policy's) tokens with the reward model only when the run's reward
    # transport is tokens (a flow's config carries it decided; a server started on its own decides it for its critic)
    token_rewards = reward_transport(cfg, reader="model.critic" if cfg.model.critic else "model.reward") == "tokens"
    trainer = CriticTrainer(cfg.critic, critic_path, reward_path, cfg.critic_carries_reward, cfg.model.dtype,
                            distributed.local_device(cfg.deploy.device, me), spec.checkpoint_dir,
                            token_rewards=token_rewards, me=me, gradient_checkpointing=cfg.model.gradient_checkpointing,
                            normalize_reward=cfg.reward.normalize)
    return trainer, reward_tokenizer


def _start_critic_ranks(spec: ServerSpec):
    """Start ranks 1..N-1 of the critic server (in this server's process group), join them, hand them the spec."""
    cfg = spec.config
    world = cfg.deploy.critic.nproc_per_node
    log_dir = Path(spec.checkpoint_dir).parent if spec.checkpoint_dir else cfg.resolved_state_dir() / "servers"
    secret = ranks_secret()
    group = Followers("critic", world, "127.0.0.1", spec.port + 3,
                      [sys.executable, "-m", "components.serving.triton.main", "--follow"],
                      {BACKEND_ENV: cfg.deploy.actor.backend, TIMEOUT_ENV: str(cfg.deploy.actor.collective_timeout_s)},
                      log_dir / "logs", secret, own_group=False)
    me = distributed.Dist(0, world, 0, world)
    device = distributed.local_device(cfg.deploy.device, me)
    distributed.init(me, distributed.resolve_backend(cfg.deploy.actor.backend, device),
                     cfg.deploy.actor.collective_timeout_s, device, secret, group.address, name="critic")
    me.broadcast_object(spec.model_dump_json())
    return group, me


def follow_critic() -> int:
    """Rank r > 0 of a critic server: join, receive the spec, build the critic shard, run what rank 0 says."""
    exit_with_parent()
    me = distributed.from_env()
    device = distributed.local_device("auto", me)
    distributed.init(me, distributed.resolve_backend(os.environ.get(BACKEND_ENV, "auto"), device),
                     float(os.environ.get(TIMEOUT_ENV, "300")), device, read_secret(), name="critic")
    try:
        spec = ServerSpec.model_validate_json(me.broadcast_object(None))
        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        trainer, _ = _critic_trainer(spec, me)
        while (command := me.broadcast_object(None))[0] != "stop":
            op, args = command
            getattr(trainer, op)(*args)
        distributed.shutdown(me, graceful=True)
    finally:
        distributed.shutdown()
    return 0
