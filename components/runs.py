"""The one run builder: a training run composed from its config, for `rlhf train` and the Prefect flows alike.

    prepare the run (models/prepare.py) and read its data (models/data.py): bad input fails before any model loads
    open or resume its record: the MLflow run and the checkpoint store, its reward files stored there and the
        provenance of its models recorded (components/tracking/run.py)
    start the rollout server when the engine holds its own weights (it loads beside the actor)
    start the actor on its ranks, restored from the run's last checkpoint
    the run's services: the rollout server given the actor's weights, and what the algorithm scores with (a critic
        server, a reward server unless the critic carries the reward model), each ready
    the one training loop (models/loop.py): iterations, held-out evals, metrics, checkpoints
    the trained model out (components/export.py): the last checkpoint's policy as a Hugging Face model in the run's
        store and as the MLflow run's model
    the summary; everything torn down on success, failure and cancellation

How each named step executes is the caller's `Steps` (models/loop.py): directly here (`rlhf train`), as Prefect tasks
in a flow (components/tasks.py). Where the servers run is the config's `deploy` section.

With the actor on several nodes, the process that calls `train` is the run's controller (components/controller.py)
and node group 0's rank 0 runs the run: every rank of a node group runs this module (`main`), rank 0 the run the
controller handed over, the others follow it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from components.controller import RelaySteps, control, controls, handoff, report
from components.environment import first_line
from components.export import publish_model
from components.launch.nodes import NO_RESTART_EXIT_CODE
from components.launch.processes import exit_with_parent
from components.launch.ranks import actor_ranks, follow
from components.serving.services import RunServices, rollout_server, run_services
from components.storage.store import CheckpointStore
from components.storage.lease import LeaseLost, RunLocked
from components.tracking.run import RunSession, closed_when_done
from models.config import RLHFConfig
from models.data import PromptSet
from models.loop import DIRECT, Leader, Steps, read_data, run_loop
from models.prepare import prepare_run


def train(cfg: RLHFConfig, steps: Steps = DIRECT, lease_holder: Optional[str] = None) -> dict:
    """Run (or resume, by run name) the training run of `cfg` to its last iteration; returns its summary: run name,
    MLflow run id, iterations, the metrics of each iteration this attempt ran (`history`), its evals and the last
    checkpoint. With the actor on several nodes this process controls the run instead (components/controller.py);
    `lease_holder`: node group 0's rank 0 writes under its controller's lease."""
    cfg = prepare_run(cfg)
    prompts, evals = read_data(cfg)  # bad data fails here, before any model loads
    if controls(cfg):
        return control(cfg, steps)
    with recorded_run(cfg, steps, lease_holder) as session:
        cfg = session.cfg  # with its reward files stored (reward.files): what every process of the run receives
        with rollout_server(cfg, session.place, steps) as rollout, actor_on_ranks(cfg, session, steps) as actor, \
                run_services(cfg, session.place, actor, steps, rollout) as services:
            log_data(session, prompts, evals, steps)
            history, evaluations = run_loop(cfg, actor, prompts, evals, RunRecord(session, services, steps), steps)
            model = steps("export-model", publish_model, session, retries=1)  # the trained model out: store + MLflow
            steps.log(f"model of iteration {model['iteration']}: {model['model']} (MLflow logged model "
                      f"{model['mlflow_model_id']})")
            return {**summary(session, actor, history, evaluations, steps), **model}


@contextmanager
def recorded_run(cfg: RLHFConfig, steps: Steps = DIRECT, lease_holder: Optional[str] = None) -> Iterator[RunSession]:
    """Open (or resume) the run of a prepared config; on the way out close its MLflow run as FINISHED or FAILED."""
    with closed_when_done(steps("open-run", open_session, cfg, steps, lease_holder, retries=2)) as session:
        yield session


def open_session(cfg: RLHFConfig, steps: Steps, lease_holder: Optional[str] = None) -> RunSession:
    """Resolve the run name, download the last complete checkpoint if there is one, start or continue the MLflow run."""
    # said through steps.log: a lease taken over, a checkpoint passed over
    session = RunSession.open(cfg, steps.tags(), log=steps.log, lease_holder=lease_holder)
    if session.resumed_from is not None:
        steps.log(f"run {session.name}: resuming from checkpoint iteration {session.resumed_from} ({session.store.uri})")
    else:
        steps.log(f"run {session.name}: new run, checkpoints in {session.store.uri}")
    steps.log(f"MLflow run {session.tracker.run_id} at {session.tracker.tracking_uri}")
    return session


@contextmanager
def actor_on_ranks(cfg: RLHFConfig, session: RunSession, steps: Steps = DIRECT) -> Iterator[Leader]:
    """The actor on all its ranks, restored from the run's checkpoint; every rank stopped on the way out."""
    with actor_ranks(cfg, session.local_dir / "logs") as actor:
        if warning := steps("restore-actor", session.restore_actor, actor):
            steps.log(f"warning: {warning}")
        yield actor


@dataclass
class RunRecord:
    """What the training loop records into (models/loop.Record): the run's MLflow run and checkpoint store, scored by
    the run's services."""

    session: RunSession
    services: RunServices
    steps: Steps

    @property
    def critic(self):
        return self.services.critic

    @property
    def reward(self):
        return self.services.reward

    def guard(self, fn, *args, **kwargs):
        return self.services.guard(fn, *args, **kwargs)

    def log(self, iteration: int, metrics: dict, samples: list[dict]) -> None:
        self.session.log(iteration, metrics, samples)
        m = metrics
        stale = ""  # an engine with its own weights: how far its sampling is from the trainer's logprobs, and why
        if "rollout/staleness_max" in m:
            stale = (f" sampler logp diff {m['sampling/sampling_logp_difference/max']:.1e} "
                     f"staleness {m['rollout/staleness_max']:g}")
        gold = f"gold {m['objective/gold_reward']:+.3f} " if "objective/gold_reward" in m else ""
        self.steps.log(f"iteration {iteration}/{self.session.cfg.iterations}: {gold}reward {m['reward']:+.3f} "
                       f"KL {m['objective/kl']:.3f} step {m['step_time']:.2f}s{stale}")

    def log_eval(self, iteration: int, metrics: dict, rows: list[dict]) -> None:
        """An eval's metrics at step=iteration, its samples as an MLflow table and a table beside the run."""
        self.session.log_eval(iteration, metrics, rows)
        text = f"eval at iteration {iteration}: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        key = re.sub(r"[^a-z0-9-]+", "-", f"eval-{self.session.name}".lower()).strip("-")
        self.steps.table(key[:128], rows, f"Held-out {text} (run {self.session.name})")
        self.steps.log(text)

    def checkpoint(self, actor: Leader) -> str:
        """critic_save on the critic, then actor (all ranks) + critic + manifest into the store; `latest` last."""
        critic_info = self.critic.save() if self.critic is not None else None
        uri = self.session.save(actor, critic_info)
        self.steps.log(f"checkpoint iteration {actor.state.iteration}: {uri}")
        return uri


def log_data(session: RunSession, prompts: PromptSet, evals: PromptSet | None, steps: Steps = DIRECT) -> None:
    """What the run reads: counts in the log and in MLflow (data/rows, data/filtered_rows, eval/rows at step 0)."""
    counts = {"data/rows": len(prompts), "data/filtered_rows": prompts.filtered, "data/truncated_rows": prompts.truncated}
    note = f"data: {len(prompts)} prompts from {prompts.source}"
    if prompts.filtered or prompts.truncated:
        note += (f" ({prompts.filtered} filtered, {prompts.truncated} truncated: longer than "
                 f"data.max_prompt_length={session.cfg.data.max_prompt_length})")
    if evals is not None:
        counts.update({"eval/rows": len(evals), "eval/filtered_rows": evals.filtered})
        note += f"; eval: {len(evals)} prompts from {evals.source}"
    session.tracker.log_side_metrics(counts, step=0)
    steps.log(note)


HEADLINE = ("reward", "reward_std", "kl")  # with objective/* and rewards/*: the last iteration's, in a summary


def summary(session: RunSession, actor: Leader, history: list[dict], evaluations: list[dict],
            steps: Steps = DIRECT) -> dict:
    """What a run returns (a flow run's result; `rlhf train --summary-out`)."""
    steps.log(f"run {session.name} finished: {actor.state.iteration} iterations on {actor.me.world_size} actor rank(s)")
    final = history[-1] if history else {}
    return {"run_name": session.name, "mlflow_run_id": session.tracker.run_id, "iterations": actor.state.iteration,
            "checkpoint": session.store.uri, "models": session.models, "data": session.data,
            "reward_files": session.reward_files,
            "final": {k: v for k, v in final.items() if k in HEADLINE or k.startswith(("objective/", "rewards/"))},
            "history": history, "evals": evaluations}


# ---------------------------------------------------------------- a rank of a node group

def attempt(store: CheckpointStore) -> int:
    """Node group 0's rank 0: the run its controller handed over through the run's store, run under the controller's
    lease with its messages relayed to it; the summary (or the error) written back to the store. Exits with
    NO_RESTART_EXIT_CODE for a failure no restart mends (the run's name held by another run, its lease lost)."""
    handed = handoff(store)
    steps = RelaySteps(handed["relay"], handed.get("tags"))
    report(store, "running", attempt=steps.source)
    try:
        summary = train(RLHFConfig.model_validate(handed["config"]), steps, lease_holder=handed["lease_holder"])
    except BaseException as exc:
        traceback.print_exc()
        why = "stopped: SIGTERM (its node groups are being stopped)" if isinstance(exc, Stopped) else first_line(exc)
        steps.log(f"run {why}" if isinstance(exc, Stopped) else f"run failed: {why}")
        try:
            report(store, "failed", attempt=steps.source, error=why)
        except Exception:  # noqa: BLE001 - the store is unreachable: the controller names the exit instead
            pass
        return NO_RESTART_EXIT_CODE if isinstance(exc, (RunLocked, LeaseLost)) else 1
    report(store, "succeeded", attempt=steps.source, summary=summary)
    return 0


class Stopped(SystemExit):
    """SIGTERM to a rank of a node group: its groups are being stopped (a failed group, a cancelled run)."""


def _terminated(signum, frame) -> None:
    raise Stopped(128 + signum)  # the run's `finally` blocks stop its servers, as a cancelled flow run's do


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m components.runs --store URI [--s3-endpoint-url URL]`: every rank of a node group (its NodeSpec's
    command, under torchrun): rank 0 runs the attempt, every other rank follows it."""
    parser = argparse.ArgumentParser(description="a rank of the actor's node groups")
    parser.add_argument("--store", required=True, help="The run's checkpoint store (the controller's hand-off).")
    parser.add_argument("--s3-endpoint-url", default=None, help="Endpoint of an S3-compatible store.")
    args = parser.parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:
        code = follow()
    else:
        signal.signal(signal.SIGTERM, _terminated)
        exit_with_parent()
        code = attempt(CheckpointStore.from_uri(args.store, s3_endpoint_url=args.s3_endpoint_url))
    # done: the run's record is closed and every rank left the process group. Leave without the interpreter's
    # teardown, where gloo's threads occasionally abort a process (pytorch PR 179291): a group that ended well must
    # not read as failed, or every group would be restarted
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
