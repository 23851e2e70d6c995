"""Prefect tasks the flows are made of, and how a flow hands them to the one training loop (models/loop.run_loop) and
to the run's services (components/serving/services.py). Retries only where I/O can fail transiently (tracking,
checkpoint upload)."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE
from prefect.runtime import deployment, flow_run

from components.environment import first_line
from components.launch.ranks import actor_ranks
from components.serving.services import RunPlace, RunServices, Steps
from components.tracking.run import RunSession
from models.config import RLHFConfig
from models.data import Batch, PromptSet
from models.loop import Hooks, Leader


class FlowSteps(Steps):
    """The steps of starting a run's servers as Prefect tasks of the flow run (named as the UI shows them), their
    messages in the run's log."""

    def __call__(self, name: str, fn, *args, **kwargs):
        return task(fn, name=name, cache_policy=NONE)(*args, **kwargs)

    def log(self, message: str) -> None:
        get_run_logger().info(message)


STEPS = FlowSteps()


@contextmanager
def training_run(cfg: RLHFConfig) -> Iterator[tuple[RunSession, RunPlace]]:
    """Open (or resume) the run of a prepared config; on the way out close the MLflow run as FINISHED or FAILED."""
    session = open_run(cfg, run_tags())
    status = "FAILED"
    try:
        yield session, RunPlace(session.name, session.local_dir / "logs", session.critic_dir, session.store.uri,
                                session.critic_restore_iteration)
        status = "FINISHED"
    finally:
        session.close(status)


@contextmanager
def actor_on_ranks(cfg: RLHFConfig, session: RunSession) -> Iterator[Leader]:
    """The actor on all its ranks, restored from the run's checkpoint; every rank stopped on the way out."""
    with actor_ranks(cfg, session.local_dir / "logs") as actor:
        restore_actor(session, actor)
        yield actor


def flow_hooks(cfg: RLHFConfig, session: RunSession, services: RunServices) -> Hooks:
    """The training loop's parts as this flow run's tasks: an iteration, the held-out eval, metrics, checkpoints; a
    failure while a server of the run is gone names that server."""
    step, guard, critic, reward = iteration_task(cfg), services.guard, services.critic, services.reward
    return Hooks(step=lambda actor, batch, data, ahead: guard(step, actor, batch, data, critic, reward, ahead),
                 evaluate=lambda actor, batch, i: guard(held_out_eval, actor, batch, critic, reward, i),
                 log=lambda i, metrics, samples: log_metrics(session, i, metrics, samples),
                 logged_eval=lambda i, metrics, rows: log_eval(session, i, metrics, rows),
                 checkpoint=lambda actor: guard(save_checkpoint, session, actor, critic))


def run_tags() -> dict[str, str]:
    return {"prefect.flow_run_id": str(flow_run.get_id() or ""), "prefect.deployment": str(deployment.get_name() or "")}


@task(name="open-run", cache_policy=NONE, retries=2, retry_delay_seconds=5)
def open_run(cfg: RLHFConfig, tags: dict[str, str]) -> RunSession:
    """Resolve the run name, download the last complete checkpoint if there is one, start/continue the MLflow run."""
    session = RunSession.open(cfg, tags)
    logger = get_run_logger()
    if session.resumed_from is not None:
        logger.info(f"run {session.name}: resuming from checkpoint iteration {session.resumed_from} ({session.store.uri})")
    else:
        logger.info(f"run {session.name}: new run, checkpoints in {session.store.uri}")
    logger.info(f"MLflow run {session.tracker.run_id} at {session.tracker.tracking_uri}")
    return session


@task(name="restore-actor", cache_policy=NONE)
def restore_actor(session: RunSession, actor: Leader) -> None:
    """Weights, optimizer and RNGs of the last checkpoint into the actor on all its ranks (a new run: nothing)."""
    warning = session.restore_actor(actor)
    if warning:
        get_run_logger().warning(warning)


@task(name="iteration", cache_policy=NONE)
def iteration(actor: Leader, prompts: Batch, data: dict, critic, reward, ahead: list[Batch]):
    """One training iteration (models/step.py) on every actor rank, each with its share of the prompts: rollout ->
    logprobs + reference, scores (and values) requested meanwhile -> advantages -> actor (and critic) update.
    `data`: the prompt stream's state after this batch, saved with the actor's next checkpoint; `ahead`: the next
    batches, asked for now (asynchronous rollouts)."""
    return actor.step(prompts, critic, reward, data, ahead)


@task(name="eval", cache_policy=NONE)
def held_out_eval(actor: Leader, prompts: Batch, critic, reward, iteration: int) -> tuple[dict, list[dict]]:
    """The held-out eval (models/eval.py) before iteration + 1 (or at the end) on every actor rank."""
    return actor.evaluate(prompts, critic, reward, iteration)


@task(name="log-eval", cache_policy=NONE, retries=2, retry_delay_seconds=2)
def log_eval(session: RunSession, iteration: int, metrics: dict, rows: list[dict]) -> None:
    """An eval's metrics to MLflow at step=iteration, its samples as an MLflow table and as the Prefect table
    artifact 'eval-<run name>'."""
    session.log_eval(iteration, metrics, rows)
    key = re.sub(r"[^a-z0-9-]+", "-", f"eval-{session.name}".lower()).strip("-")
    summary = f"eval at iteration {iteration}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
    create_table_artifact(table=rows, key=key[:128], description=f"Held-out {summary} (run {session.name})")
    get_run_logger().info(summary)


def log_data(session: RunSession, prompts: PromptSet, evals: PromptSet | None) -> None:
    """What the run reads: counts in the log and in MLflow (data/rows, data/filtered_rows, eval/rows at step 0)."""
    counts = {"data/rows": len(prompts), "data/filtered_rows": prompts.filtered,
              "data/truncated_rows": prompts.truncated}
    note = f"data: {len(prompts)} prompts from {prompts.source}"
    if prompts.filtered or prompts.truncated:
        note += (f" ({prompts.filtered} filtered, {prompts.truncated} truncated: longer than "
                 f"data.max_prompt_length={session.cfg.data.max_prompt_length})")
    if evals is not None:
        counts.update({"eval/rows": len(evals), "eval/filtered_rows": evals.filtered})
        note += f"; eval: {len(evals)} prompts from {evals.source}"
    session.tracker.log_side_metrics(counts, step=0)
    get_run_logger().info(note)


def iteration_task(cfg: RLHFConfig):
    """The iteration task as the run shows it in Prefect: '<algorithm>-iteration'."""
    return iteration.with_options(name=f"{cfg.algorithm}-iteration")


@task(name="log-metrics", cache_policy=NONE, retries=2, retry_delay_seconds=2)
def log_metrics(session: RunSession, iteration: int, metrics: dict, samples: list[dict]) -> None:
    session.log(iteration, metrics, samples)
    m = metrics
    stale = f" staleness {m['rollout/staleness_max']:g}" if "rollout/staleness_max" in m else ""
    get_run_logger().info(
        f"iteration {iteration}/{session.cfg.iterations}: gold {m.get('objective/gold_reward', float('nan')):+.3f} "
        f"score {m['objective/scores']:+.3f} KL {m['objective/kl']:.3f} step {m['time/step']:.2f}s{stale}")


@task(name="checkpoint", cache_policy=NONE)
def save_checkpoint(session: RunSession, actor: Leader, critic=None) -> str:
    """critic_save on the critic server, then actor (all ranks) + critic + manifest into the store; `latest` last."""
    critic_info = critic.save() if critic is not None else None
    uri = session.save(actor, critic_info)
    get_run_logger().info(f"checkpoint iteration {actor.state.iteration}: {uri}")
    return uri


def run_summary(session: RunSession, actor: Leader, history: list[dict]) -> dict:
    """What a training flow returns (shown as the flow run's result)."""
    metrics = history[-1] if history else {}
    get_run_logger().info(f"run {session.name} finished: {actor.state.iteration} iterations on "
                          f"{actor.me.world_size} actor rank(s)")
    return {"run_name": session.name, "mlflow_run_id": session.tracker.run_id, "iterations": actor.state.iteration,
            "final": {k: v for k, v in metrics.items() if k.startswith("objective/")}}


class RunFailed(RuntimeError):
    """A training run failed; the message is the first line of the cause (chained, with its whole text)."""


@contextmanager
def reported_failure():
    """Let a failing flow end with the cause's first line as its state message (what `prefect deployment run --watch`,
    the UI's run list and `rlhf` show); the whole cause stays chained in the logged traceback."""
    try:
        yield
    except Exception as exc:
        reason = first_line(exc)
        get_run_logger().error(f"run failed: {reason}")
        raise RunFailed(reason) from exc
