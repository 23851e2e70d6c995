"""Build the pieces of a run from the config, the commands every rank of a job executes, and the one training loop.

A job that trains (an RL run's actor, a stage's trainee: SFT, reward model, DPO, KTO) runs on one or more ranks.
Rank 0 (the flow run, or `rlhf train`) holds a `Leader`: each of its calls broadcasts a command (step on this batch,
evaluate, save, restore, stop) that the other ranks (components/launch/ranks.py) receive and `execute` in step with
it, so every collective is entered by all ranks. With one rank the broadcasts are no-ops. Only what a step and an
eval compute differs between jobs; saving and restoring are the same for every job (`save_actor`, `restore_actor`).

`run_loop` is the one training loop, of an RL run and of every stage: the steps, the held-out eval schedule (at 0,
every N, at the end; not repeated at a resume point) and the checkpoint cadence (`Schedule`). What plugs in is the
`Trainee`: an RL run's `Iterations` (one iteration per step on the prompt stream) or a stage's `StageSteps`
(optimizer steps on its row stream), and the job's `Record` (components/jobs/: MLflow and the checkpoint store).
How each part runs is the caller's `Steps`: directly (`rlhf train`), or as the flow's Prefect tasks
(components/tasks.py); the job builder (components/runs.py) composes the job around it for both.
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
from models.data import Batch, DataError, PromptSet, PromptStream, RowStream, builtin_gold, load_prompt_set
from models.environments.episodes import check_environment_run, start_episodes
from models.environments.remote import RemoteEpisodes
from models.eval import evaluate
from models.distributed import SINGLE, Dist, local_device
from models.policy import Policy, load_policy_tokenizer
from models.scoring import load_teacher
from models.resolve import Resolved
from models.reward import load_reward_function, load_reward_functions, load_reward_model, load_reward_tokenizer
from models.safe_io import load_state
from models.stages import train as stage_train
from models.stages.config import StageRun
from models.stages.data import Pairs
from models.stages.kinds import build_stage
from models.stages.train import StageState
from models.step import train_step


def read_data(cfg: RLHFConfig) -> tuple[PromptSet, PromptSet | None]:
    """The run's training prompts (data.*) and held-out eval prompts (eval.*; None when the run has no eval), read
    with the policy's tokenizer and checked against the reward functions' columns. Raises models/data.DataError
    naming the source and what is wrong, before any model loads (the tokenizer only)."""
    tokenizer = load_policy_tokenizer(cfg.local_path("model.policy"))
    d, e = cfg.data, cfg.eval
    if not d.prompts:
        raise DataError("data.prompts: not set; name the training prompts (a local file or folder, a hub data set id, "
                        "or builtin:<task>: models/data.py)")
    prompts = checked_prompt_set(cfg, tokenizer, cfg.source("data.prompts"), d.split, d.prompt_key)
    evals = None
    if e.prompts and e.every:
        evals = checked_prompt_set(cfg, tokenizer, cfg.source("eval.prompts"), e.split, e.prompt_key)
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


def checked_prompt_set(cfg: RLHFConfig, tokenizer, pinned: Resolved, split: str, prompt_key: str) -> PromptSet:
    """The prompts of a pinned source read for the run (its length policy), checked against the columns its reward
    functions and gold reward read."""
    found = load_prompt_set(pinned, split, prompt_key, tokenizer, cfg.data.max_prompt_length, cfg.data.long_prompts,
                            cfg.data.chat_template)
    field, source = pinned.field, pinned.value
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
    """This rank's actor: the policy (FSDP2-sharded over the ranks for a full fine-tune unless deploy.actor.fsdp='off'),
    the frozen reference, optimizer and generators."""
    torch.manual_seed(cfg.seed)
    shard = me.active and cfg.deploy.actor.fsdp == "auto" and not cfg.model.lora.enabled
    policy = Policy.load(cfg.local_path("model.policy"), cfg.model.lora, cfg.model.dtype,
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
    critic_path = cfg.local_path("model.critic") if cfg.model.critic else None
    reward_path = cfg.local_path("model.reward") if cfg.model.reward else None
    return CriticTrainer(cfg.critic, critic_path, reward_path, cfg.critic_carries_reward,
                         cfg.model.dtype, local_device(cfg.deploy.device, SINGLE), checkpoint_dir,
                         token_rewards=cfg.reward.transport == "tokens",
                         gradient_checkpointing=cfg.model.gradient_checkpointing, normalize_reward=cfg.reward.normalize)


def critic_text_reward(cfg: RLHFConfig, trainer: CriticTrainer):
    """The reward backend of a PPO run whose combined reward model reads text: the critic's resident reward model
    scoring (prompt, response) with its own tokenizer; None when critic_infer already returns rewards."""
    if trainer.reward_model is None or trainer.token_rewards:
        return None
    return LocalRewardModel(trainer.reward_model, load_reward_tokenizer(cfg.local_path("model.reward")),
                            cfg.reward.chat_template)


def build_local_reward(cfg: RLHFConfig):
    """The run's reward backend in this process (with on-policy distillation's teacher beside it)."""
    reward = _local_reward(cfg)
    if not ALGORITHMS[cfg.algorithm].needs_teacher:
        return reward
    teacher = load_teacher(cfg.local_path("model.teacher"), cfg.model.dtype,
                           local_device(cfg.deploy.device, SINGLE))
    return WithTeacher(reward, teacher, cfg.generation.temperature, cfg.generation.micro_batch_size)


def _local_reward(cfg: RLHFConfig):
    if cfg.reward.source == "function":
        return FunctionReward(load_reward_functions(cfg.reward, deploy=cfg.deploy))
    model = load_reward_model(cfg.local_path("model.reward"), cfg.model.dtype, local_device(cfg.deploy.device, SINGLE),
                              normalize=cfg.reward.normalize)
    if cfg.reward.transport == "text":
        return LocalRewardModel(model, load_reward_tokenizer(cfg.local_path("model.reward")), cfg.reward.chat_template)
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


def build(cfg: RLHFConfig | StageRun, me: Dist = SINGLE) -> ActorState | StageState:
    """This rank's state of the job of `cfg`: an RL run's actor, or a stage's trainee (models/stages/kinds.py)."""
    return build_actor(cfg, me) if isinstance(cfg, RLHFConfig) else build_stage(cfg, me)


def execute(state: ActorState | StageState, cfg: RLHFConfig | StageRun, command: dict, critic=None, reward=None):
    """Run one command of rank 0's on this rank (rank 0 passes its backends; the others None). A step and an eval
    work on the command's global `batch` (an RL run's prompts, a stage's rows) and move the state's counters and
    `data` (where its stream stands) as a checkpoint records them."""
    op, rl = command["op"], isinstance(state, ActorState)
    if op == "step" and rl:  # an iteration (models/step.py); `ahead`: the next iterations' batches (asynchronous
        # rollouts); `reserve`: the stream's next batches, each with the stream's state after it (dynamic sampling)
        reserve = command.get("reserve") or []
        out = train_step(state, command["batch"], cfg, Backends(critic, reward), gold_function(cfg),
                         command.get("ahead"), [batch for batch, _ in reserve])
        used = int(out[0].get("dynamic_sampling/rounds", 1))  # batches of the stream the step consumed
        state.data = command.get("data") if used == 1 else reserve[used - 2][1]
        return out
    if op == "step":  # a stage's optimizer step (models/stages/train.py)
        out = stage_train.train_step(state, cfg, command["batch"])
        state.data = command.get("data")
        return out
    if op == "evaluate" and rl:  # models/eval.py, sampled with a seed of its iteration
        return evaluate(state, command["batch"], cfg, Backends(critic, reward), gold_function(cfg),
                        command["iteration"])
    if op == "evaluate":  # the stage kind's held-out metrics
        return stage_train.evaluate(state, cfg, command["batch"])
    if op == "save":
        return save_actor(state, Path(command["dir"]))
    if op == "restore":
        return restore_actor(state, Path(command["dir"]))
    if op == "refit":
        return state.engine.update_weights(state.policy.engine_weights())
    raise ValueError(f"unknown command {op!r}")


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
    """A job's state as rank 0 drives it (an RL run's actor, a stage's trainee): every call is broadcast to the other
    ranks, then run here too.

    `describe_failure()` (set by the launcher of the other ranks) explains a collective that failed: which rank died,
    its exit code and log tail."""

    cfg: RLHFConfig | StageRun
    state: ActorState | StageState
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

    def step(self, batch: Batch | list[str] | dict, critic=None, reward=None, data: dict | None = None,
             ahead: list[Batch] | None = None, reserve: list[tuple[Batch, dict]] | None = None):
        """One training step on the global `batch` (an RL iteration's prompts, a stage's rows); `data` (the stream's
        state after drawing it) is kept with the state for its next checkpoint. An RL iteration only: `ahead`, the
        next iterations' batches, asked for now (asynchronous rollouts); `reserve`, the stream's next batches, each
        with the stream's state after it, for dynamic sampling (the state kept is the one after the last it used)."""
        return self.run({"op": "step", "batch": batch, "data": data, "ahead": ahead, "reserve": reserve}, critic,
                        reward)

    def evaluate(self, batch: Batch | dict, critic=None, reward=None, iteration: int = 0) -> tuple[dict, list[dict]]:
        """The held-out eval of `batch` on every rank, (metrics, rows) here; no trainer state changes. An RL run's
        (models/eval.py) is scored as training is (`critic` for PPO's combined reward model) and samples with a
        seed of `iteration`."""
        return self.run({"op": "evaluate", "batch": batch, "iteration": iteration}, critic, reward)

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


# ---------------------------------------------------------------- the one training loop

@dataclass(frozen=True)
class Schedule:
    """When the loop does what: steps up to `total`; a checkpoint every `checkpoint_every` steps and after the last;
    with a held-out eval (`evaluates`), one before the first step, every `eval_every` steps (0: none between) and
    one after the last, never again at the step a run resumes from (the run it resumes evaluated there)."""

    name: str  # the named step that trains: '<algorithm>-iteration', '<stage>-steps'
    unit: str  # what a step is: 'iteration' (an RL run's), 'step' (a stage's optimizer step)
    total: int
    checkpoint_every: int
    evaluates: bool
    eval_every: int = 0
    chunk: int = 0  # the most steps one named step runs (0: all up to the next checkpoint, eval or the end)

    def stop(self, step: int) -> int:
        """Where the named step that starts at `step` ends."""
        marks = [self.total, (step // self.checkpoint_every + 1) * self.checkpoint_every]
        if self.evaluates and self.eval_every:
            marks.append((step // self.eval_every + 1) * self.eval_every)
        if self.chunk:
            marks.append(step + self.chunk)
        return min(marks)


class Trainee(Protocol):
    """What the loop trains, the part that differs between an RL run (`Iterations`) and a stage (`StageSteps`): the
    job's state on its ranks (`leader`), its schedule, its steps and its held-out eval."""

    leader: Leader
    schedule: Schedule

    def train(self, stop: int) -> list[tuple[dict, list[dict]]]:
        """Steps until the state is at step `stop`: each one's (metrics, sample rows)."""

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """The held-out eval at step `step`: (metrics, rows)."""


class Record(Protocol):
    """Where the loop's results go and how it checkpoints: the job's MLflow run and checkpoint store
    (components/jobs/rl.RunRecord, components/jobs/stages.StageRecord); `guard` makes a call that may fail while
    a server of the run is gone name that server."""

    def guard(self, fn: Callable, *args, **kwargs): ...

    def log(self, done: list[tuple[int, dict, list[dict]]]) -> None:
        """Each step's number, metrics and sample rows."""

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None: ...

    def checkpoint(self, leader: Leader) -> str: ...


def run_loop(trainee: Trainee, record: Record, steps: Steps = DIRECT) -> tuple[list[dict], list[dict]]:
    """The one training loop, of an RL run and of every stage: train from where the trainee's state stands (a
    resumed run: its checkpoint's step and data position) to the end of its schedule, evaluating and checkpointing
    as it says. Each part is a named step (`steps`): the training steps (`schedule.name`: one per RL iteration, a
    stage's between its checkpoints and evals), their metrics' record, the checkpoint, the eval and its record.
    Returns the metrics of the steps it ran, and its evals ({<unit>: step, metrics...})."""
    s, state = trainee.schedule, trainee.leader.state
    start, history, evaluations = state.iteration, [], []

    def evaluate(step: int) -> None:
        metrics, rows = steps("eval", record.guard, trainee.evaluate, step)
        steps("log-eval", record.log_eval, step, metrics, rows, retries=2)
        evaluations.append({s.unit: step, **metrics})

    if s.evaluates and start == 0:
        evaluate(0)
    while (i := state.iteration) < s.total:
        steps.progress(i, s.total, f"{s.unit}s")
        stop = s.stop(i)
        done = steps(s.name, record.guard, trainee.train, stop)
        history += [metrics for metrics, _ in done]
        steps("log-metrics", record.log, [(i + 1 + k, m, rows) for k, (m, rows) in enumerate(done)], retries=2)
        if stop % s.checkpoint_every == 0 or stop == s.total:
            steps("checkpoint", record.guard, record.checkpoint, trainee.leader)
        if s.evaluates and s.eval_every and stop % s.eval_every == 0 and stop != s.total:
            evaluate(stop)
    if s.evaluates and start < s.total:
        evaluate(s.total)
    steps.progress(s.total, s.total, f"{s.unit}s")
    return history, evaluations


class Iterations:
    """An RL run as the loop trains it: one iteration per named step, on the next batch of the prompt stream, scored
    by the run's `critic` and `reward` backends; the held-out eval of `evals` (none: no eval) every eval.every
    iterations; a checkpoint every checkpoint.every.

    With asynchronous rollouts (rollout.max_off_policy_steps = k) the stream is drawn up to k batches ahead, in order,
    and each step is told them (the engine asks for them while the actor trains); each batch keeps the stream's
    position after it, so a checkpoint records the last *trained* batch and a resumed run asks again for the ones
    that were in flight: no prompt skipped, none trained twice. With dynamic sampling the step is handed the next
    loss.dynamic_sampling_extra_rounds batches too: those it sampled are consumed, the others stay queued in order for
    the next iteration, and the checkpoint records the stream after the last one it used."""

    def __init__(self, cfg: RLHFConfig, leader: Leader, prompts: PromptSet, evals: PromptSet | None, critic=None,
                 reward=None):
        self.cfg, self.leader, self.evals, self.critic, self.reward = cfg, leader, evals, critic, reward
        self.schedule = Schedule(f"{cfg.algorithm}-iteration", "iteration", cfg.iterations, cfg.checkpoint.every,
                                 evals is not None, cfg.eval.every, chunk=1)
        self.stream = PromptStream.resume(prompts, batch_size(cfg), cfg.seed, leader.state.data, leader.state.iteration)
        self.queued: deque[tuple[Batch, dict]] = deque()  # the next batches, each with the stream's position after it
        settings = resolve(cfg)
        self.extra = settings.dynamic_sampling_extra_rounds if settings.dynamic_sampling else 0  # batches it may use

    def train(self, stop: int) -> list[tuple[dict, list[dict]]]:
        done, cfg = [], self.cfg
        while (i := self.leader.state.iteration) < stop:
            while len(self.queued) < min(1 + cfg.rollout.max_off_policy_steps, cfg.iterations - i) + self.extra:
                self.queued.append((next(self.stream), self.stream.state()))
            batch, data = self.queued.popleft()
            reserve = [self.queued.popleft() for _ in range(self.extra)]
            metrics, samples = self.leader.step(batch, self.critic, self.reward, data, [b for b, _ in self.queued],
                                                reserve)
            self.queued.extendleft(reversed(reserve[int(metrics.get("dynamic_sampling/rounds", 1)) - 1:]))  # unused
            done.append((metrics, samples))
        return done

    def evaluate(self, iteration: int) -> tuple[dict, list[dict]]:
        return self.leader.evaluate(self.evals.all(), self.critic, self.reward, iteration)


TABLE_ROWS = 32  # held-out pairs of a stage's eval shown with their scores (a reward model's, DPO's implicit rewards)


class StageSteps:
    """A stage as the loop trains it: optimizer steps on the next batch of its row stream (those between a checkpoint
    and an eval as one named step) up to max_steps, else its epochs; the held-out eval of `held_out` (none: no eval)
    every eval_every steps, its rows the held-out pairs with their scores; a checkpoint every checkpoint.every. The
    rows are the stage kind's (models/stages/data.py, kto.py)."""

    def __init__(self, cfg: StageRun, leader: Leader, data, held_out):
        train = cfg.train
        self.leader, self.data, self.held_out = leader, data, held_out
        self.schedule = Schedule(f"{cfg.stage}-steps", "step", stage_train.total_steps(train, len(data)),
                                 cfg.checkpoint.every, held_out is not None, train.eval_every)
        self.stream = RowStream(len(data), train.batch_size, cfg.seed).restored(leader.state.data, f"{cfg.stage}.data")
        self.held = held_out.rows(list(range(len(held_out)))) if held_out is not None else None

    def train(self, stop: int) -> list[tuple[dict, list[dict]]]:
        done = []
        while self.leader.state.iteration < stop:
            done.append((self.leader.step(self.data.rows(next(self.stream)), data=self.stream.state()), []))
        return done

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        metrics, scores = self.leader.evaluate(self.held)
        if not isinstance(self.held_out, Pairs):  # SFT's rows have no scores
            return metrics, []
        return metrics, [{"prompt": p, "chosen": c, "rejected": r, **row}
                         for (p, c, r), row in zip(self.held_out.texts[:TABLE_ROWS], scores[:TABLE_ROWS])]

