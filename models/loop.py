"""Build the pieces of a run from the config, the commands every actor rank executes, and the plain in-process
training loop (no servers, no Prefect).

The actor runs on one or more ranks. Rank 0 (the flow run, or `rlhf train`) holds a `Leader`: each of its calls
broadcasts a command (step with these prompts, save, restore, stop) that the other ranks (components/launch/ranks.py)
receive and execute in step with it, so every collective is entered by all ranks. With one rank the broadcasts are
no-ops. The Prefect flows call `Leader.step` once per iteration; `train_in_process` is what `rlhf train` and the
learning tests run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from models.actor import ActorState
from models.algorithms import ALGORITHMS, Backends
from models.backends import FunctionReward, LocalCritic, LocalRewardModel
from models.config import RLHFConfig
from models.critic import CriticTrainer
from models.data import Batch, PromptSet, PromptStream, load_prompt_set
from models.eval import evaluate, is_eval_iteration
from models.distributed import SINGLE, Dist, local_device
from models.policy import Policy, load_policy_tokenizer
from models.prepare import prepare_run
from models.reward import load_reward_function, load_reward_model, load_reward_tokenizer
from models.step import train_step


def read_data(cfg: RLHFConfig) -> tuple[PromptSet, PromptSet | None]:
    """The run's training prompts (data.*) and held-out eval prompts (eval.*; None when the run has no eval), read
    with the policy's tokenizer and checked against the reward functions' columns. Raises models/data.DataError
    naming the source and what is wrong, before any model loads (the tokenizer only)."""
    tokenizer = load_policy_tokenizer(cfg.resolve_model_path(cfg.model.policy))
    d, e = cfg.data, cfg.eval
    prompts = checked_prompt_set(cfg, tokenizer, d.prompts, d.split, d.prompt_key, "data.prompts")
    if not e.prompts or not e.every:
        return prompts, None
    evals = checked_prompt_set(cfg, tokenizer, e.prompts, e.split, e.prompt_key, "eval.prompts")
    return prompts, evals.head(e.max_prompts) if e.max_prompts else evals


def checked_prompt_set(cfg: RLHFConfig, tokenizer, source: str, split: str, prompt_key: str, field: str) -> PromptSet:
    found = load_prompt_set(source, split, prompt_key, tokenizer, cfg.data.max_prompt_length, cfg.data.long_prompts,
                            cfg.data.chat_template, field)
    names = sorted({k for row in found.columns for k in row})
    for spec, name in ((cfg.reward.function if cfg.reward.source == "function" else None, "reward.function"),
                       (cfg.reward.gold, "reward.gold")):
        if spec:
            load_reward_function(spec, name, probe=False).check_columns(names, f"{field} '{source}'")
    return found


def load_prompts(cfg: RLHFConfig) -> list[str]:
    """The training prompts alone (data.prompts): what tests and benchmarks feed `Leader.step`."""
    return read_data(cfg)[0].prompts


def prompt_batches(prompts: list[str], batch_size: int, seed: int, start_batch: int = 0) -> Iterator[list[str]]:
    """Seeded epochs of prompt strings (models/data.PromptStream over prompts without columns); `start_batch` skips
    what a resumed run already consumed."""
    stream = PromptStream.resume(PromptSet(list(prompts), [{} for _ in prompts], "prompts"), batch_size, seed, None,
                                 start_batch)
    return (batch.prompts for batch in stream)


def batch_size(cfg: RLHFConfig) -> int:
    """Prompts per iteration."""
    return ALGORITHMS[cfg.algorithm].settings(cfg).rollout_batch_size


def build_actor(cfg: RLHFConfig, me: Dist = SINGLE) -> ActorState:
    """This rank's actor: the policy (FSDP2-sharded over the ranks for a full fine-tune unless actor.fsdp='off'), the
    frozen reference, optimizer and generators."""
    torch.manual_seed(cfg.seed)
    shard = me.active and cfg.actor.fsdp == "auto" and not cfg.model.lora.enabled
    policy = Policy.load(cfg.resolve_model_path(cfg.model.policy), cfg.model.lora, cfg.model.dtype,
                         local_device(cfg.model.device, me), me=me, shard=shard,
                         reference_device=cfg.model.reference_device,
                         mixed_precision=cfg.actor.mixed_precision and torch.cuda.is_available())
    optim = ALGORITHMS[cfg.algorithm].settings(cfg).optim
    return ActorState.create(policy, optim, cfg.kl, cfg.seed, me, rollout=cfg.rollout)


def build_critic_trainer(cfg: RLHFConfig, checkpoint_dir: str | Path | None = None) -> CriticTrainer:
    critic_path = cfg.resolve_model_path(cfg.model.critic) if cfg.model.critic else None
    return CriticTrainer(cfg.critic, critic_path, cfg.resolve_model_path(cfg.model.reward), cfg.critic.combine_reward,
                         cfg.model.dtype, local_device(cfg.model.device, SINGLE), checkpoint_dir,
                         token_rewards=cfg.reward.transport == "tokens")


def critic_text_reward(cfg: RLHFConfig, trainer: CriticTrainer):
    """The reward backend of a PPO run whose combined reward model reads text: the critic's resident reward model
    scoring (prompt, response) with its own tokenizer; None when critic_infer already returns rewards."""
    if trainer.reward_model is None or trainer.token_rewards:
        return None
    return LocalRewardModel(trainer.reward_model, load_reward_tokenizer(cfg.resolve_model_path(cfg.model.reward)),
                            cfg.reward.chat_template)


def build_local_reward(cfg: RLHFConfig):
    if cfg.reward.source == "function":
        return FunctionReward(load_reward_function(cfg.reward.function))
    model = load_reward_model(cfg.resolve_model_path(cfg.model.reward), cfg.model.dtype, local_device(cfg.model.device, SINGLE))
    if cfg.reward.transport == "text":
        return LocalRewardModel(model, load_reward_tokenizer(cfg.resolve_model_path(cfg.model.reward)), cfg.reward.chat_template)
    return LocalRewardModel(model)


def gold_function(cfg: RLHFConfig):
    return load_reward_function(cfg.reward.gold, "reward.gold") if cfg.reward.gold else None


# ---------------------------------------------------------------- what every rank executes

LOG = logging.getLogger("rlhf.actor")


def execute(state: ActorState, cfg: RLHFConfig, command: dict, critic=None, reward=None):
    """Run one command on this rank (rank 0 passes its backends; the others None)."""
    op = command["op"]
    if op == "step":
        out = train_step(state, command["prompts"], cfg, Backends(critic, reward), gold_function(cfg))
        state.data = command.get("data")
        return out
    if op == "evaluate":
        return evaluate(state, command["prompts"], cfg, Backends(critic, reward), gold_function(cfg),
                        command["iteration"])
    if op == "save":
        return save_actor(state, Path(command["dir"]))
    if op == "restore":
        return restore_actor(state, Path(command["dir"]))
    if op == "refit":
        return state.engine.update_weights(state.policy.engine_weights())
    raise ValueError(f"unknown actor command {op!r}")


def save_actor(state: ActorState, directory: Path) -> None:
    """Full HF weights written by rank 0 (gathered from the shards on CPU: loadable anywhere); the optimizer and every
    rank's sampling stream saved sharded with torch.distributed.checkpoint; the rest (schedule, KL controller,
    minibatch stream, counters, world size) in actor_state.pt."""
    import torch.distributed.checkpoint as dcp  # heavy (~1.7 s): only checkpoints need it
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # heavy: as dcp above

    me = state.me
    directory.mkdir(parents=True, exist_ok=True)
    state.policy.save(directory)
    dcp.save({"optimizer": get_optimizer_state_dict(state.policy.model, state.optimizer),
              f"sampling_rank{me.rank}": state.generator.get_state()}, checkpoint_id=str(directory / "sharded"))
    if me.is_leader:
        torch.save({**state.state_dict(), "world_size": me.world_size}, directory / "actor_state.pt")
    me.barrier()


def restore_actor(state: ActorState, directory: Path) -> str | None:
    """Load a `save_actor` directory. With the world size it was saved with: everything. With another: the full
    weights and the schedule/counters, a fresh optimizer and sampling streams; returns that warning."""
    import torch.distributed.checkpoint as dcp  # heavy (~1.7 s): only checkpoints need it
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # heavy

    me = state.me
    state.policy.load_weights(directory)
    saved = torch.load(directory / "actor_state.pt", weights_only=False)
    state.load_state_dict(saved)
    if saved["world_size"] != me.world_size:
        warning = (f"actor checkpoint {directory} was saved by {saved['world_size']} rank(s), resuming on "
                   f"{me.world_size}: weights restored, optimizer states and sampling streams start fresh")
        LOG.warning(warning)
        return warning
    shards = {"optimizer": get_optimizer_state_dict(state.policy.model, state.optimizer),
              f"sampling_rank{me.rank}": state.generator.get_state()}
    dcp.load(shards, checkpoint_id=str(directory / "sharded"))
    set_optimizer_state_dict(state.policy.model, state.optimizer, shards["optimizer"])
    state.generator.set_state(shards[f"sampling_rank{me.rank}"])
    return None


@dataclass
class Leader:
    """The actor as rank 0 drives it: every call is broadcast to the other ranks, then run here too.

    `describe_failure()` (set by the launcher of the other ranks) explains a collective that failed: which rank died,
    its exit code and log tail."""

    cfg: RLHFConfig
    state: ActorState
    describe_failure: Callable[[], str | None] = lambda: None

    @property
    def me(self) -> Dist:
        return self.state.me

    def run(self, command: dict, critic=None, reward=None):
        try:
            self.me.broadcast_object(command)
            return execute(self.state, self.cfg, command, critic, reward)
        except Exception as exc:
            reason = self.describe_failure() if self.me.active else None
            if reason:
                raise RankFailed(reason) from exc
            raise

    def step(self, prompts: list[str] | Batch, critic=None, reward=None, data: dict | None = None) -> tuple[dict, list[dict]]:
        """One training iteration on the global batch `prompts`; `data` (the prompt stream's state after drawing
        it) is kept with the actor's state for its next checkpoint."""
        return self.run({"op": "step", "prompts": prompts, "data": data}, critic, reward)

    def evaluate(self, prompts: Batch, critic, reward, iteration: int) -> tuple[dict, list[dict]]:
        """The held-out eval (models/eval.py) on every rank, scored as training is (`critic` for PPO's combined
        reward model); no trainer state changes."""
        return self.run({"op": "evaluate", "prompts": prompts, "iteration": iteration}, critic, reward)

    def save(self, directory: Path) -> None:
        self.run({"op": "save", "dir": str(directory)})

    def restore(self, directory: Path) -> str | None:
        return self.run({"op": "restore", "dir": str(directory)})

    def refit(self) -> None:
        """The actor's current weights into an engine with its own copy (models/rollout/): before the first rollout
        of a run, new or resumed; the step itself refits after every update."""
        self.run({"op": "refit"})


class RankFailed(RuntimeError):
    """An actor rank died or stopped answering; the message names it, its exit code and the end of its log."""


def train_in_process(cfg: RLHFConfig, on_iteration: Callable[[int, dict], None] | None = None,
                     actor: Leader | None = None,
                     on_eval: Callable[[int, dict], None] = lambda iteration, metrics: None,
                     data: tuple[PromptSet, PromptSet | None] | None = None) -> list[dict]:
    """The whole run driven from this process (critic/reward in process, no checkpoints): on one rank, or on the
    ranks of `actor` (components/launch/ranks.actor_ranks). With `actor`, `cfg` is its prepared config (models/prepare.py).
    `data`: the training and eval prompts when already read (else read here, before the actor loads). Returns the
    metrics per iteration; the held-out evals (eval.*) go to `on_eval(iteration, metrics)`."""
    if actor is None:  # this is the entry point
        cfg = prepare_run(cfg)
    prompts, evals = data or read_data(cfg)  # bad data fails before the models load
    if actor is None:
        actor = Leader(cfg, build_actor(cfg))
    critic = reward = None
    if ALGORITHMS[cfg.algorithm].needs_critic:
        critic = LocalCritic(build_critic_trainer(cfg))
        reward = build_local_reward(cfg) if not cfg.critic.combine_reward else critic_text_reward(cfg, critic.trainer)
    else:
        reward = build_local_reward(cfg)
    history = []
    stream = PromptStream(prompts, batch_size(cfg), cfg.seed)
    try:
        for i in range(cfg.iterations):
            if evals is not None and is_eval_iteration(cfg, i):
                on_eval(i, actor.evaluate(evals.all(), critic, reward, i)[0])
            batch = next(stream)
            metrics, _ = actor.step(batch, critic, reward, stream.state())
            history.append(metrics)
            if on_iteration:
                on_iteration(i, metrics)
        if evals is not None:
            on_eval(cfg.iterations, actor.evaluate(evals.all(), critic, reward, cfg.iterations)[0])
    finally:
        for backend in (critic, reward):
            if backend is not None:
                backend.close()
    return history
