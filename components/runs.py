"""The one job builder: every kind of job (an RL run, SFT, a reward model, DPO, an eval) composed from its config, for
the CLI (`rlhf train | sft | reward-model | dpo | eval`), the Prefect flows and the pipeline's stages alike.

    prepare the job (its kind's: derived config values, its data read): bad input fails before any model loads
    open or resume its record (components/tracking/run.py, the one session): the run's lease taken and its store
        fenced, the newest checkpoint that passes its checks downloaded (an older one when the newest fails them),
        its MLflow run started or continued, tagged with what the job is made of
    run what the job's kind trains (components/jobs/: rl.py, stages.py, evaluation.py), checkpointing through the
        session (committed only under the run's lease)
    its model out (the kind's `publish`: stored beside the checkpoints with every file's sha256; an RL run's also
        logged to MLflow as the run's model)
    the summary; the session closed (MLflow FINISHED or FAILED, the lease released) on success, failure and
        cancellation

A kind is what plugs in (components/jobs/: a `Job`): `prepare(cfg) -> (cfg, data)` (what it reads pinned once,
models/resolve.py: its ranks and servers receive the pins in its config and resolve nothing), `tags(cfg)`,
`provenance(cfg)` (its record, from its pinned sources), `stored(cfg, store)` (what travels with the job),
`logged_config(cfg)`, `restore_parts(cfg)`, `opened(session)`, `run(session, data, steps) -> result`,
`publish(session, result, steps) -> model` (a kind that `publishes`), `controls(cfg)` / `control(cfg, steps)` (an RL
run on several nodes). The builder asks no config which kind it is. How each named step executes is the caller's
`Steps` (models/loop.py): directly (the CLI), as Prefect tasks of a flow run (components/tasks.py), or nested in a
pipeline's stage. Where the ranks and servers run is the config's `deploy`.

With the actor on several nodes, the process that calls `train` for an RL run is the run's controller
(components/controller.py) and node group 0's rank 0 runs the run: every rank of a node group runs this module
(`main`), rank 0 the run the controller handed over (under the controller's lease: `lease_holder`), the others follow
it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Iterator, Optional

from components.controller import RelaySteps, handoff, report
from components.environment import first_line
from components.jobs.evaluation import Eval
from components.jobs.rl import RL
from components.jobs.stages import Stage
from components.launch.nodes import NO_RESTART_EXIT_CODE
from components.launch.processes import exit_with_parent
from components.launch.ranks import follow
from components.serving.auth import read_secret
from components.storage.lease import LeaseLost, RunLocked
from components.storage.signing import StoreKeyError
from components.storage.store import CheckpointStore, ForeignCheckpoint
from components.jobs import Job
from components.tracking.run import RunSession, closed_when_done
from models.config import RLHFConfig
from models.kinds import STAGES
from models.loop import DIRECT, Steps
from models.reproducible import reproducibility, reproducibility_tags

# what each kind of job (models/kinds.py) plugs into the builder: RL's, a stage's on the ranks, the eval's
JOBS = {"rl": RL(), "eval": Eval(), **{job: Stage(job) for job in STAGES}}


def train(cfg, steps: Steps = DIRECT, provenance: dict | None = None, lease_holder: Optional[str] = None) -> dict:
    """Run (or resume, by run name) the job of `cfg` (its `job`: models/config.RLHFConfig, or a stage's or an eval's
    config from models/stages/config.py) to its end; returns its summary: job, run name, MLflow run id, checkpoint
    store, steps (RL: iterations), the metrics of each step this attempt ran (`history`), its held-out evals, its
    last metrics, its provenance record (components/tracking/provenance.py; `provenance`: already computed, a
    pipeline's stage), what it read (models, data, reward files), its model (URI in the store, local directory, every
    file's sha256) and what its kind adds. An RL run on several nodes: this process controls it
    (components/controller.py); `lease_holder`: node group 0's rank 0 writes under its controller's lease."""
    kind = JOBS[cfg.job]
    cfg, data = kind.prepare(cfg)  # what it reads pinned; bad input fails here, before any model loads
    if kind.controls(cfg):
        return kind.control(cfg, steps)
    record = provenance or kind.provenance(cfg)  # a pipeline's stage: its key's, of its config as given
    with recorded(kind, cfg, steps, record, lease_holder) as session:
        result = kind.run(session, data, steps)
        model = steps("export-model", kind.publish, session, result, steps, retries=1) if kind.publishes else {}
        return {"job": cfg.job, "run_name": session.name, "mlflow_run_id": session.tracker.run_id,
                "checkpoint": session.store.uri, "provenance": record, "models": session.models,
                "data": session.data, "reward_files": session.reward_files, "reproducible": reproducibility(cfg),
                **result, **model}


def provenance(cfg) -> dict:
    """The provenance record of a job's pinned config, as its kind makes it (components/tracking/provenance.py)."""
    return JOBS[cfg.job].provenance(cfg)


@contextmanager
def recorded(kind: Job, cfg, steps: Steps = DIRECT, provenance: dict | None = None,
             lease_holder: Optional[str] = None) -> Iterator[RunSession]:
    """The job's session (opened or resumed) for the block; closed on the way out as FINISHED or FAILED."""
    with closed_when_done(steps("open-run", open_session, kind, cfg, steps, provenance, lease_holder,
                                retries=2)) as session:
        yield session


def open_session(kind: Job, cfg, steps: Steps = DIRECT, provenance: dict | None = None,
                 lease_holder: Optional[str] = None) -> RunSession:
    """Resolve the run name, take its lease (or write under its controller's), download the last complete
    checkpoint if there is one, start or continue the MLflow run tagged with the job's provenance; said in the job's
    log (a lease taken over, a checkpoint passed over too)."""
    session = RunSession.open(cfg, kind, {**kind.tags(cfg), **reproducibility_tags(cfg), **steps.tags()},
                              log=steps.log, provenance=provenance, lease_holder=lease_holder)
    kind.opened(session)
    what = kind.title(session.name)
    if session.resumed_from is not None:
        steps.log(f"{what}: resuming from checkpoint {kind.unit} {session.resumed_from} ({session.store.uri})")
    else:
        steps.log(f"{what}: new run, checkpoints in {session.store.uri}")
    steps.log(f"MLflow run {session.tracker.run_id} at {session.tracker.tracking_uri}")
    return session


# ---------------------------------------------------------------- a rank of a node group

def attempt(store: CheckpointStore) -> int:
    """Node group 0's rank 0: the run its controller handed over through the run's store, run under the controller's
    lease with its messages relayed to it; the summary (or the error) written back to the store. Exits with
    NO_RESTART_EXIT_CODE for a failure no restart mends (the run's name held by another run, its lease lost, its store
    holding records it did not sign, no store key)."""
    handed = handoff(store)
    steps = RelaySteps(handed["relay"], handed.get("tags"))
    report(store, "running", attempt=steps.source)
    try:
        summary = train(RLHFConfig.model_validate(handed["config"]), steps, lease_holder=handed["lease_holder"])
    except BaseException as exc:  # noqa: BLE001 - a SIGTERM (Stopped) too: reported to the controller, then exit
        traceback.print_exc()
        why = "stopped: SIGTERM (its node groups are being stopped)" if isinstance(exc, Stopped) else first_line(exc)
        steps.log(f"run {why}" if isinstance(exc, Stopped) else f"run failed: {why}")
        try:
            report(store, "failed", attempt=steps.source, error=why)
        except Exception:  # noqa: BLE001 - the store is unreachable: the controller names the exit instead
            pass
        return NO_RESTART_EXIT_CODE if isinstance(exc, (RunLocked, LeaseLost, ForeignCheckpoint, StoreKeyError)) else 1
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
        code = follow(read_secret())  # the controller's, given to every node group
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
