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

A kind is what plugs in: `prepare(cfg) -> (cfg, data)`, `tags(cfg)`, `restore_parts(cfg)`, `opened(session)`,
`run(session, data, steps) -> result`, `publish(session, result, steps) -> model` (none for an eval). How each named
step executes is the caller's `Steps` (models/loop.py): directly (the CLI), as Prefect tasks of a flow run
(components/tasks.py), or nested in a pipeline's stage. Where the ranks and servers run is the config's `deploy`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from components.jobs.evaluation import Eval
from components.jobs.rl import RL
from components.jobs.stages import Stage
from components.tracking.provenance import provenance as provenance_of
from components.tracking.run import RunSession, closed_when_done
from models.loop import DIRECT, Steps

JOBS = {"rl": RL(), "sft": Stage("sft"), "reward_model": Stage("reward_model"), "dpo": Stage("dpo"), "eval": Eval()}


def train(cfg, steps: Steps = DIRECT, provenance: dict | None = None) -> dict:
    """Run (or resume, by run name) the job of `cfg` (its `job`: models/config.RLHFConfig, or a stage's or an eval's
    config from models/stages/config.py) to its end; returns its summary: job, run name, MLflow run id, checkpoint
    store, steps (RL: iterations), the metrics of each step this attempt ran (`history`), its held-out evals, its
    last metrics, its provenance record (components/tracking/provenance.py; `provenance`: already computed, a
    pipeline's stage), its model (URI in the store, local directory, every file's sha256) and what its kind adds."""
    kind = JOBS[cfg.job]
    cfg, data = kind.prepare(cfg)  # bad input fails here, before any model loads
    record = provenance or provenance_of(cfg)  # a pipeline's stage: its key's, of its config as given
    with recorded(kind, cfg, steps, record) as session:
        result = kind.run(session, data, steps)
        model = steps("publish-model", kind.publish, session, result, steps, retries=1) \
            if getattr(kind, "publishes", True) else {}
        return {"job": cfg.job, "run_name": session.name, "mlflow_run_id": session.tracker.run_id,
                "checkpoint": session.store.uri, "provenance": record, **result, **model}


@contextmanager
def recorded(kind, cfg, steps: Steps = DIRECT, provenance: dict | None = None) -> Iterator[RunSession]:
    """The job's session (opened or resumed) for the block; closed on the way out as FINISHED or FAILED."""
    with closed_when_done(steps("open-run", open_session, kind, cfg, steps, provenance, retries=2)) as session:
        yield session


def open_session(kind, cfg, steps: Steps = DIRECT, provenance: dict | None = None) -> RunSession:
    """Resolve the run name, take its lease, download the last complete checkpoint if there is one, start or continue
    the MLflow run tagged with the job's provenance; said in the job's log (a lease taken over, a checkpoint passed
    over too)."""
    session = RunSession.open(cfg, {**kind.tags(cfg), **steps.tags()}, log=steps.log, parts=kind.restore_parts(cfg),
                              provenance=provenance)
    kind.opened(session)
    what = f"{cfg.job} run {session.name}"
    if session.resumed_from is not None:
        steps.log(f"{what}: resuming from checkpoint {session.resumed_from} ({session.store.uri})")
    else:
        steps.log(f"{what}: new run, checkpoints in {session.store.uri}")
    steps.log(f"MLflow run {session.tracker.run_id} at {session.tracker.tracking_uri}")
    return session
