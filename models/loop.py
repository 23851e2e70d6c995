"""Build the pieces of a run from the config, the commands every actor rank executes, and the one training loop.

The actor runs on one or more ranks. Rank 0 (the flow run, or `rlhf train`) holds a `Leader`: each of its calls
broadcasts a command (step with these prompts, save, restore, stop) that the other ranks (components/launch/ranks.py)
receive and execute in step with it, so every collective is entered by all ranks. With one rank the broadcasts are
no-ops.

`run_loop` is the one training loop: the iteration, the held-out eval schedule (at 0, every eval.every, at the end;
not repeated at a resume point) and the checkpoint cadence. How each part runs is the caller's `Steps`: directly
(`rlhf train`), or as the flow's Prefect tasks (components/tasks.py); the job builder (components/runs.py) composes
the run around it for both.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Protocol

import torch

from models.actor import ActorState
from models.algorithms import ALGORITHMS, Backends, resolve
from models.backends import FunctionReward, LocalRewardModel, WithTeacher
from models.config import RLHFConfig
from models.critic import CriticTrainer
from models.data import Batch, DataError, PromptSet, PromptStream, builtin_gold, load_prompt_set
from models.environments.episodes import check_environment_run, start_episodes
from models.environments.remote import RemoteEpisodes
from models.eval import evaluate, is_eval_iteration
from models.distributed import SINGLE, Dist, local_device
from models.policy import Policy, load_policy_tokenizer
from models.scoring import load_teacher
from models.reward import load_reward_function, load_reward_functions, load_reward_model, load_reward_tokenizer
from models.safe_io import load_state
from models.step import train_step


def read_data(cfg: RLHFConfig) -> tuple[PromptSet, PromptSet | None]:
    """The run's training prompts (data.*) and held-out eval prompts (eval.*; None when the run has no eval), read
    with the policy's tokenizer and checked against the reward functions' columns. Raises models/data.DataError
    naming the source and what is wrong, before any model loads (the tokenizer only)."""
    tokenizer = load_policy_tokenizer(cfg.resolve_model_path(cfg.model.policy))
    d, e = cfg.data, cfg.eval
    if not d.prompts:
        raise DataError("data.prompts: not set; name the training prompts (a local file or folder, a hub data set id, "
                        "or builtin:<task>: models/data.py)")
    prompts = checked_prompt_set(cfg, tokenizer, d.prompts, d.split, d.prompt_key, "data.prompts", d.subset, d.revision,
                                 d.options)
    evals = None
    if e.prompts and e.every:
        evals = checked_prompt_set(cfg, tokenizer, e.prompts, e.split, e.prompt_key, "eval.prompts", e.subset,
                                   e.revision, e.options)
    if cfg.environment.factory:  # the environments probed, their reward functions' columns checked, in a worker
        check_environment_run(cfg, tokenizer, {f"{field} '{found.source}'": columns_of(found)
                                               for field, found in (("data.prompts", prompts), ("eval.prompts", evals))
                                               if found is not None})
    if evals is None:
        return prompts, None
    evals = evals.head(e.max_prompts) if e.max_prompts else evals
    if len(evals) < cfg.deploy.actor.world_size:  # as training: every rank evaluates its share, none may be empty
        raise DataError(f"eval.prompts: '{e.prompts}' has {len(evals)} prompt(s) (split '{e.split}'"
                        + (f", eval.max_prompts={e.max_prompts}" if e.max_prompts else "")
                        + f") for {cfg.deploy.actor.world_size} actor ranks: every rank needs at least one")
    return prompts, evals


def checked_prompt_set(cfg: RLHFConfig, tokenizer, source: str, split: str, prompt_key: str, field: str,
                       subset: str | None = None, revision: str | None = None, options: dict | None = None) -> PromptSet:
    found = load_prompt_set(source, split, prompt_key, tokenizer, cfg.data.max_prompt_length, cfg.data.long_prompts,
                            cfg.data.chat_template, field, subset, revision, cfg.deploy, options)
    names = columns_of(found)
    if cfg.reward.source == "function" and not cfg.environment.enabled:  # an environment run's: read_data's check
        load_reward_functions(cfg.reward, probe=False, deploy=cfg.deploy).check_columns(names, f"{field} '{source}'")
    if spec := gold_spec(cfg):
        gold_loader(cfg, spec, probe=False).check_columns(names, f"{field} '{source}'")
    return found


def columns_of(found: PromptSet) -> list[str]:
    """The columns besides the prompt that the rows of a prompt set carry."""
    return sorted({k for row in found.columns for k in row})


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
    """This rank's actor: the policy (FSDP2-sharded over the ranks for a full fine-tune unless deploy.actor.fsdp='off'), the
    frozen reference, optimizer and generators."""
    torch.manual_seed(cfg.seed)
    shard = me.active and cfg.deploy.actor.fsdp == "auto" and not cfg.model.lora.enabled
    policy = Policy.load(cfg.resolve_model_path(cfg.model.policy), cfg.model.lora, cfg.model.dtype,
                         local_device(cfg.deploy.device, me), me=me, shard=shard,
                         reference_device=cfg.deploy.reference_device,
                         gradient_checkpointing=cfg.model.gradient_checkpointing)
    optim = ALGORITHMS[cfg.algorithm].settings(cfg).optim
    kl = cfg.kl.model_copy(update={"beta": resolve(cfg).kl_beta})
    state = ActorState.create(policy, optim, kl, cfg.seed, me, rollout=cfg.rollout)
    if cfg.environment.factory:  # this rank's environment workers, started and probed
        state.episodes = start_episodes(cfg, policy.tokenizer, policy.model.config, me)
    elif cfg.environment.verifiers:  # played on rank 0 by verifiers' code once the rollout server is connected
        state.episodes = RemoteEpisodes(cfg.environment.verifiers.id, policy.tokenizer, me)
    return state


def build_critic_trainer(cfg: RLHFConfig, checkpoint_dir: str | Path | None = None) -> CriticTrainer:
    critic_path = cfg.resolve_model_path(cfg.model.critic) if cfg.model.critic else None
    reward_path = cfg.resolve_model_path(cfg.model.reward) if cfg.model.reward else None
    return CriticTrainer(cfg.critic, critic_path, reward_path, cfg.critic_carries_reward,
                         cfg.model.dtype, local_device(cfg.deploy.device, SINGLE), checkpoint_dir,
                         token_rewards=cfg.reward.transport == "tokens",
                         gradient_checkpointing=cfg.model.gradient_checkpointing, normalize_reward=cfg.reward.normalize)


def critic_text_reward(cfg: RLHFConfig, trainer: CriticTrainer):
    """The reward backend of a PPO run whose combined reward model reads text: the critic's resident reward model
    scoring (prompt, response) with its own tokenizer; None when critic_infer already returns rewards."""
    if trainer.reward_model is None or trainer.token_rewards:
        return None
    return LocalRewardModel(trainer.reward_model, load_reward_tokenizer(cfg.resolve_model_path(cfg.model.reward)),
                            cfg.reward.chat_template)


def build_local_reward(cfg: RLHFConfig):
    """The run's reward backend in this process (with on-policy distillation's teacher beside it)."""
    reward = _local_reward(cfg)
    if not ALGORITHMS[cfg.algorithm].needs_teacher:
        return reward
    teacher = load_teacher(cfg.resolve_model_path(cfg.model.teacher), cfg.model.dtype,
                           local_device(cfg.deploy.device, SINGLE))
    return WithTeacher(reward, teacher, cfg.generation.temperature, cfg.generation.micro_batch_size)


def _local_reward(cfg: RLHFConfig):
    if cfg.reward.source == "function":
        return FunctionReward(load_reward_functions(cfg.reward, deploy=cfg.deploy))
    model = load_reward_model(cfg.resolve_model_path(cfg.model.reward), cfg.model.dtype, local_device(cfg.deploy.device, SINGLE),
                              normalize=cfg.reward.normalize)
    if cfg.reward.transport == "text":
        return LocalRewardModel(model, load_reward_tokenizer(cfg.resolve_model_path(cfg.model.reward)), cfg.reward.chat_template)
    return LocalRewardModel(model)


def gold_spec(cfg: RLHFConfig) -> str | None:
    """The gold reward of the run: reward.gold, else the shipped task's own when the data is a builtin task (a
    user's data set has none unless given; a verifiers run's prompts are its environment's)."""
    return cfg.reward.gold or (None if cfg.environment.verifiers else builtin_gold(cfg.data.prompts))


def gold_function(cfg: RLHFConfig):
    return gold_loader(cfg, spec) if (spec := gold_spec(cfg)) else None


def gold_loader(cfg: RLHFConfig, spec: str, probe: bool = True):
    """The gold reward function `spec` of the run (a file the run stored: loaded by its digest)."""
    return load_reward_function(spec, "reward.gold", probe, files=cfg.reward.files, deploy=cfg.deploy)


# ---------------------------------------------------------------- what every rank executes

LOG = logging.getLogger("rlhf.actor")


def execute(state: ActorState, cfg: RLHFConfig, command: dict, critic=None, reward=None):
    """Run one command on this rank (rank 0 passes its backends; the others None)."""
    op = command["op"]
    if op == "step":
        reserve = command.get("reserve") or []
        out = train_step(state, command["prompts"], cfg, Backends(critic, reward), gold_function(cfg),
                         command.get("ahead"), [batch for batch, _ in reserve])
        used = int(out[0].get("dynamic_sampling/rounds", 1))  # batches of the stream the step consumed
        state.data = command.get("data") if used == 1 else reserve[used - 2][1]
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
    """Everything a resume needs, written by rank 0 alone into `directory` (the ranks may be on machines that share no
    directory: the run's store is all they share): the full HF weights and the full optimizer state, each gathered
    from the shards on CPU (loadable by any number of ranks: optimizer.pt), and actor_state.pt: schedule, KL
    controller, minibatch stream, counters, the world size and every rank's sampling stream."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # heavy (~1.7 s)

    me = state.me
    if me.is_leader:
        directory.mkdir(parents=True, exist_ok=True)
    state.policy.save(directory)
    optimizer = get_optimizer_state_dict(state.policy.model, state.optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sampling = me.gather_object(state.generator.get_state())
    if me.is_leader:
        torch.save(optimizer, directory / "optimizer.pt")
        torch.save({**state.state_dict(), "world_size": me.world_size, "sampling": sampling},
                   directory / "actor_state.pt")
    me.barrier()


def restore_actor(state: ActorState, directory: Path) -> str | None:
    """Load a `save_actor` directory, which rank 0 alone reads (it exists on rank 0's machine only) and broadcasts:
    the weights, the optimizer state, the schedule and counters, whatever the world size it was saved with; every
    rank's sampling stream when that world size is this one, else fresh streams (returns that warning)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict  # heavy (~1.7 s)

    me = state.me
    state.policy.load_weights(directory)
    saved = me.broadcast_object(load_state(directory / "actor_state.pt") if me.is_leader else None)  # no pickle
    state.load_state_dict(saved)
    optimizer = load_state(directory / "optimizer.pt") if me.is_leader else {}
    set_optimizer_state_dict(state.policy.model, state.optimizer, optimizer,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=me.active))
    if saved["world_size"] != me.world_size:
        warning = (f"actor checkpoint {directory} was saved by {saved['world_size']} rank(s), resuming on "
                   f"{me.world_size}: weights and optimizer states restored, sampling streams start fresh")
        LOG.warning(warning)
        return warning
    state.generator.set_state(saved["sampling"][me.rank])
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
            return self.execute(command, critic, reward)
        except Exception as exc:
            reason = self.describe_failure() if self.me.active else None
            if reason:
                raise RankFailed(reason) from exc
            raise

    def execute(self, command: dict, critic=None, reward=None):
        """Run a command here, on rank 0 (the other ranks run it as they receive it: components/launch/ranks.py)."""
        return execute(self.state, self.cfg, command, critic, reward)

    def step(self, prompts: list[str] | Batch, critic=None, reward=None, data: dict | None = None,
             ahead: list[Batch] | None = None,
             reserve: list[tuple[Batch, dict]] | None = None) -> tuple[dict, list[dict]]:
        """One training iteration on the global batch `prompts`; `data` (the prompt stream's state after drawing
        it) is kept with the actor's state for its next checkpoint; `ahead`: the next iterations' batches, asked for
        now (asynchronous rollouts); `reserve`: the stream's next batches, each with the stream's state after it, for
        dynamic sampling (the state kept is the one after the last batch it used)."""
        return self.run({"op": "step", "prompts": prompts, "data": data, "ahead": ahead, "reserve": reserve},
                        critic, reward)

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


class Steps:
    """How the named steps of a run execute and where its messages go: here, directly (`rlhf train`: printed). A
    flow passes components.tasks.FlowSteps: each step a Prefect task of the flow run (named as the UI shows it),
    each message in the run's log, each table a Prefect artifact. The one seam between a run and what executes it:
    the job builder (components/runs.py), the training loop and the servers' start-up all go through it."""

    def __call__(self, name: str, fn: Callable, *args, retries: int = 0, **kwargs):
        return fn(*args, **kwargs)

    def log(self, message: str) -> None:
        print(message, flush=True)

    def table(self, key: str, rows: list[dict], description: str) -> None:
        """A table worth showing beside the run (a flow: a Prefect table artifact); nothing here."""

    def progress(self, done: int, total: int, what: str) -> None:
        """How far the run is (a flow: a Prefect progress artifact); nothing here."""

    def tags(self) -> dict[str, str]:
        """What the run's record should say about who runs it (a flow: its flow run and deployment)."""
        return {}


DIRECT = Steps()


class Record(Protocol):
    """Where the loop's results go and how it checkpoints (components/jobs/rl.RunRecord: MLflow and the run's
    checkpoint store), and what it scores with: the run's `critic` and `reward` backends, each call made through
    `guard` (a failure while a server of the run is gone names that server)."""

    critic: object
    reward: object

    def guard(self, fn: Callable, *args, **kwargs): ...

    def log(self, iteration: int, metrics: dict, samples: list[dict]) -> None: ...

    def log_eval(self, iteration: int, metrics: dict, rows: list[dict]) -> None: ...

    def checkpoint(self, actor: Leader) -> str: ...


def run_loop(cfg: RLHFConfig, actor: Leader, prompts: PromptSet, evals: PromptSet | None, record: Record,
             steps: Steps = DIRECT) -> tuple[list[dict], list[dict]]:
    """Train `actor` from where its state stands (a resumed run: its checkpoint's iteration and prompt position) to
    cfg.iterations: one step per iteration on the next batch of the prompt stream; a held-out eval before the first
    update, every eval.every iterations and at the end (not again at the iteration a run resumes from, which the run
    it resumes evaluated); a checkpoint every checkpoint.every iterations and at the end. Each part is a named step
    (`steps`). Returns the metrics of the iterations it ran, and its evals ({iteration, metrics...}).

    With asynchronous rollouts (rollout.max_off_policy_steps = k) the stream is drawn up to k batches ahead, in order,
    and each step is told them (the engine asks for them while the actor trains); each batch keeps the stream's
    position after it, so a checkpoint records the last *trained* batch and a resumed run asks again for the ones
    that were in flight: no prompt skipped, none trained twice. With dynamic sampling the step is handed the next
    loss.dynamic_sampling_extra_rounds batches too: those it sampled are consumed, the others stay queued in order for
    the next iteration, and the checkpoint records the stream after the last one it used."""
    stream = PromptStream.resume(prompts, batch_size(cfg), cfg.seed, actor.state.data, actor.state.iteration)
    start, history, evaluations = actor.state.iteration, [], []
    queued: deque[tuple[Batch, dict]] = deque()  # the next batches, each with the stream's position after it
    settings = resolve(cfg)
    extra = settings.dynamic_sampling_extra_rounds if settings.dynamic_sampling else 0  # batches dynamic sampling may use
    critic, reward = record.critic, record.reward

    def evaluate(iteration: int) -> None:
        metrics, rows = steps("eval", record.guard, actor.evaluate, evals.all(), critic, reward, iteration)
        steps("log-eval", record.log_eval, iteration, metrics, rows, retries=2)
        evaluations.append({"iteration": iteration, **metrics})

    while actor.state.iteration < cfg.iterations:
        i = actor.state.iteration
        steps.progress(i, cfg.iterations, "iterations")
        if evals is not None and is_eval_iteration(cfg, i) and (i == 0 or i != start):
            evaluate(i)
        while len(queued) < min(1 + cfg.rollout.max_off_policy_steps, cfg.iterations - i) + extra:
            queued.append((next(stream), stream.state()))
        batch, data = queued.popleft()
        reserve = [queued.popleft() for _ in range(extra)]
        metrics, samples = steps(f"{cfg.algorithm}-iteration", record.guard, actor.step, batch, critic, reward, data,
                                 [b for b, _ in queued], reserve)
        queued.extendleft(reversed(reserve[int(metrics.get("dynamic_sampling/rounds", 1)) - 1:]))  # unused: next
        history.append(metrics)
        steps("log-metrics", record.log, actor.state.iteration, metrics, samples, retries=2)
        if actor.state.iteration % cfg.checkpoint.every == 0 or actor.state.iteration == cfg.iterations:
            steps("checkpoint", record.guard, record.checkpoint, actor)
    if evals is not None and start < cfg.iterations:
        evaluate(cfg.iterations)
    steps.progress(cfg.iterations, cfg.iterations, "iterations")
    return history, evaluations
