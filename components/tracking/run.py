"""The one session of every job (an RL run, SFT, a reward model, DPO, an eval): its name, local directory, checkpoint
store, lease, MLflow run and resume manifest, opened by the one job builder (components/runs.py).

A checkpoint holds the parts the job saves (an RL run: `actor/` and `critic/`; a stage: `trainee/`; every rank's part
written as models/loop.save_actor does) and state.json, the manifest: iteration, episode, world size, the MLflow run
id, the config, the provenance of what the job is made of, and what the job adds (an RL run: its critic step and RNG
states). Re-running with the same run name resumes from the newest committed checkpoint that passes its checks: one
that fails them (a corrupt or missing file) is said and passed over for the previous committed one; when none passes,
the job fails naming each checkpoint and the cause; only "no checkpoint yet" starts a new run. A store whose
latest.json or manifest the deployment did not sign is refused when the job opens it, naming the object
(components/storage/store.py, signing.py).

What a job is made of travels with it: opening an RL run stores the bytes of every reward file it names (a local
'path/to/rewards.py:fn') in its store, `rewards/<sha256>.py`, and sets reward.files, so every process that scores
loads those bytes by their digest (models/reward.py); the session holds them with the provenance of every model and
data set the job reads, made from the pins its config carries (`cfg.sources`, pinned once where the job starts:
models/resolve.py; its source, hub commit, s3 ETags, the digest of its files), as MLflow tags
(`reward.function.sha256`, `model.policy.digest`, ...), in the summary and in every checkpoint's manifest (what `rlhf
export` checks a LoRA adapter's base against), and the job's provenance record (components/tracking/provenance.py:
what a pipeline stage's key is the digest of) as `provenance.*` tags.

One writer per run name: opening a job takes the lease of its store (components/storage/lease.py) before anything of
it is touched, and fences the store with it (latest.json names the lease from then on); another live job of the name
is refused naming its holder; every checkpoint is committed only while the store still names this lease (a holder
that stalled and was taken over commits nothing), and the lease is released at close. An attempt of a run on several
nodes opens it under the lease its controller holds (`lease_holder`: the holder id, also the fencing token), checked
before every checkpoint.
RunPlace has a slot for the run's secret, which the run's servers are started with (components/serving/services.py
makes it, once per attempt); what is logged to MLflow has the passwords of URLs taken out (tracker.redact).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from components.launch.stack import running_mlflow_uri
from components.storage.lease import HeldLease, acquire as acquire_lease
from components.storage.store import CheckpointStore
from components.tracking.provenance import digest
from components.tracking.tracker import Tracker, resolve_tracking_uri
from models.config import RLHFConfig, merge, run_name_for
from models.resolve import Sources
from models.reward import reward_file
from models.specs import is_file_spec

if TYPE_CHECKING:  # only annotations here: what reads a run's record (a sweep, rlhf compare) loads no model code
    from models.loop import Leader


LOG = logging.getLogger("rlhf.run")


def _flow_run_id() -> str | None:
    """The Prefect flow run this process runs, if any (named in the run's lease). A process that has not imported
    Prefect holds no flow or task run context, so Prefect would answer what the environment says (a process a flow
    run started inherits PREFECT__FLOW_RUN_ID): read it there, without Prefect's import (~0.7 s)."""
    if "prefect" not in sys.modules:
        return os.environ.get("PREFECT__FLOW_RUN_ID") or None
    try:
        from prefect.runtime import flow_run  # heavy: Prefect, only to name the holder of the run's lease

        return str(flow_run.get_id()) if flow_run.get_id() else None
    except Exception:  # noqa: BLE001 - no Prefect context: a plain process
        return None


def checkpoint_uri(cfg, run_name: str) -> str:
    """Where a job's checkpoints go: deploy.checkpoint.uri, else <state_dir>/checkpoints, then the run's name."""
    base = cfg.deploy.checkpoint.uri or (cfg.resolved_state_dir() / "checkpoints").as_uri()
    return f"{base.rstrip('/')}/{run_name}"


def default_tracking_uri(cfg) -> str:
    """Config > $MLFLOW_TRACKING_URI > the local stack's MLflow server (if `rlhf up` runs) > sqlite in state_dir."""
    if cfg.deploy.tracking.uri:
        return cfg.deploy.tracking.uri
    local = running_mlflow_uri(cfg.resolved_state_dir())
    if not os.environ.get("MLFLOW_TRACKING_URI") and local:
        return local
    return resolve_tracking_uri(None, cfg.resolved_state_dir())


@dataclass
class RunPlace:
    """What a run's servers need of the run: its name, where logs go, where a local critic saves, the run's
    checkpoint store (a Kubernetes critic uploads there), the checkpoint iteration a resumed critic starts from, and
    the run's secret (every server of the run takes requests carrying it only: components/serving/auth.py)."""

    run_name: str
    log_dir: Path
    critic_dir: Optional[Path] = None
    store_uri: Optional[str] = None
    critic_restore_iteration: Optional[int] = None
    secret: Optional[str] = field(default=None, repr=False)  # made where the servers start (services.run_secret)


@contextmanager
def closed_when_done(session):
    """A job's session for the block, closed on the way out: its MLflow run FINISHED, or FAILED when the block
    raised (a failure, a cancellation); its lease released either way."""
    status = "FAILED"
    try:
        yield session
        status = "FINISHED"
    finally:
        session.close(status)


@dataclass
class RunSession:
    """A job's durable state (the module docstring)."""

    cfg: object  # the job's config: models/config.RLHFConfig, or a stage's / an eval's (models/stages/config.py)
    name: str
    local_dir: Path
    store: CheckpointStore
    tracker: Tracker
    resumed_from: int | None = None
    manifest: dict = field(default_factory=dict)
    lease: object = None  # one writer per run name (components/storage/lease.py), released at close
    provenance: dict = field(default_factory=dict)  # what the job is made of (components/tracking/provenance.py)
    models: dict = field(default_factory=dict)  # model field -> its provenance (models/resolve.py)
    data: dict = field(default_factory=dict)  # data field -> its provenance (data.prompts, eval.prompts)
    reward_files: dict = field(default_factory=dict)  # reward field -> {path, sha256, uri} (store_reward_files)

    @classmethod
    def open(cls, cfg, kind, tags: dict[str, str] | None = None, log: Callable[[str], None] = LOG.warning,
             provenance: dict | None = None, lease_holder: str | None = None) -> "RunSession":
        """Resolve the job's run name; take its lease (one writer per run name: another live job of this name is
        refused, naming it, before anything of it is touched), or with `lease_holder` write under the lease of that
        holder (a multi-node run's controller), and fence its store with it; store what must travel with the job
        (its `kind`'s `stored`: an RL run's reward files); if the store has a checkpoint, download the newest that
        passes its checks (the kind's `restore_parts`; an older one when the newest fails them, said through `log`)
        into `restore_dir` and remember its manifest; start or continue its MLflow run, tagged with `tags`, the
        digests of its pinned sources (`cfg.sources`) and the `provenance` record, its config (as its kind logs it)
        as the run's parameters."""
        name = run_name_for(cfg)
        store = CheckpointStore.from_uri(checkpoint_uri(cfg, name),
                                         s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
        lease = (HeldLease(store, name, lease_holder) if lease_holder else
                 acquire_lease(store, name, timeout_s=cfg.deploy.checkpoint.lease_timeout_s, log=log,
                               flow_run_id=_flow_run_id(), what=f"run_name={name!r}"))
        try:
            store.fence(lease.token)  # from now on latest.json moves only for this lease
            cfg, reward_files = kind.stored(cfg, store)
            models, data = sources_record(cfg.sources)
            local_dir = cfg.resolved_state_dir() / "runs" / name
            local_dir.mkdir(parents=True, exist_ok=True)
            manifest, resumed_from = {}, None
            restored = store.restore(local_dir / "restore", parts=kind.restore_parts(cfg), log=log)
            if restored is not None:
                resumed_from, manifest = restored[0], from_jsonable(restored[1])
            parent = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
            record = provenance or {}
            tracker = Tracker(default_tracking_uri(cfg), cfg.tracking.experiment, name,
                              run_id=manifest.get("tracking_run_id"),
                              tags={"job": cfg.job, **record_tags(record),
                                    **provenance_tags({**models, **data}, reward_files), **parent, **(tags or {})},
                              system_metrics=cfg.deploy.tracking.system_metrics)
            tracker.start(kind.logged_config(cfg))  # URL passwords redacted by the tracker
        except BaseException:
            lease.release()
            raise
        return cls(cfg, name, local_dir, store, tracker, resumed_from, manifest, lease=lease, provenance=record,
                   models=models, data=data, reward_files=reward_files)

    @property
    def restore_dir(self) -> Path:
        """Where the checkpoint the job resumes from was downloaded (one directory per part)."""
        return self.local_dir / "restore"

    # -- an RL run's servers
    @property
    def critic_restore_iteration(self) -> int | None:
        """The checkpoint iteration whose critic a Kubernetes critic server must start from; None for a new critic."""
        return self.resumed_from if self.manifest.get("critic_step") is not None else None

    @property
    def critic_dir(self) -> Path:
        return self.local_dir / "critic"

    @functools.cached_property
    def place(self) -> RunPlace:
        """One RunPlace per session: the servers of the run share it (and the secret made for them)."""
        return RunPlace(self.name, self.local_dir / "logs", self.critic_dir, self.store.uri,
                        self.critic_restore_iteration)

    # -- checkpoints
    def restore(self, leader: Leader, part: str) -> str | None:
        """Load part `part` of the downloaded checkpoint into the freshly built job on all its ranks (models/loop
        Leader.restore); returns its warning (another world size: the optimizer starts fresh), None for a new run."""
        return leader.restore(self.restore_dir / part) if self.resumed_from is not None else None

    def checkpoint(self, leader: Leader, part: str, state: dict | None = None, parts: dict[str, Path] | None = None,
                   stored: dict[str, str] | None = None) -> str:
        """Save the job on all its ranks as part `part` (with `parts`, directories saved beside it, and `stored`, parts
        already in the store: a Kubernetes critic's upload, adopted and then deleted), and a manifest with `state`
        (what the job adds); committed only while this job's lease fences the store; prune; record in MLflow."""
        self.lease.check()  # a job whose lease was taken over writes nothing more
        staging = self.local_dir / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        leader.save(staging / part)
        step = leader.state
        manifest = {"iteration": step.iteration, "episode": step.episode, "run_name": self.name,
                    "world_size": step.me.world_size, "tracking_run_id": self.tracker.run_id,
                    "config": self.cfg.model_dump(mode="json", exclude={"sources"}), "provenance": self.provenance,
                    "models": self.models, "data": self.data, "reward_files": self.reward_files, **(state or {})}
        uri = self.store.save(step.iteration, {part: staging / part, **(parts or {})}, _jsonable(manifest),
                              stored=stored, fence=self.lease.token)
        for key in (stored or {}).values():
            self.store.delete_dir(key)
        self.store.prune(self.cfg.checkpoint.keep_last, fence=self.lease.token)
        self.tracker.log_checkpoint(uri, step.iteration)
        shutil.rmtree(staging, ignore_errors=True)
        return uri

    # -- MLflow
    def log_steps(self, steps: list[tuple[int, dict]]) -> None:
        """The metrics of several steps (iterations) in one batch; a step an earlier attempt logged (recomputed after
        a resume) is skipped."""
        last = self.tracker.last_step
        fresh = [(step, metrics) for step, metrics in steps if last is None or step > last]
        if fresh:
            self.tracker.log_steps(fresh)

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None:
        """A held-out eval's metrics at `step` (beside the steps' own) and its rows as the MLflow table
        tables/eval_<step>.json; an eval an earlier attempt logged (recomputed after a resume) is skipped."""
        if self.tracker.log_side_metrics(metrics, step=step) and rows:
            self.tracker.log_table(rows, step=step, name="eval")

    def log_data(self, counts: dict[str, float], note: str, log: Callable[[str], None]) -> None:
        """What the job reads: counts in MLflow at step 0 (data/rows, eval/rows, ...) and a line in its log."""
        self.tracker.log_side_metrics(counts, step=0)
        log(note)

    def close(self, status: str) -> None:
        try:
            self.tracker.end(status)
        finally:
            if self.lease is not None:
                self.lease.release()


REWARD_FILES = "rewards"  # <run store>/rewards/<sha256>.py: the bytes of the run's reward files


def store_reward_files(cfg: RLHFConfig, store: CheckpointStore) -> tuple[RLHFConfig, dict]:
    """The run's reward files ('path/to/rewards.py:fn' in reward.function, reward.functions, reward.gold; absolute
    after prepare_run), each read here and stored in the run's store by its sha256, and the config with reward.files
    naming them; returns (config, {field: {path, sha256, uri}}). A file missing here whose copy the config already
    names (a config carried over from the run's manifest) keeps that copy."""
    r = cfg.reward
    specs = [("reward.function", r.function), *((f"reward.functions.{i}", s) for i, s in enumerate(r.functions or [])),
             ("reward.gold", r.gold)]
    files = {path: stored.model_dump() for path, stored in (r.files or {}).items()}
    record = {}
    for field_name, spec in specs:
        if not spec or not is_file_spec(spec):
            continue
        path = reward_file(spec)
        if path.is_file():
            data = path.read_bytes()
            sha256 = hashlib.sha256(data).hexdigest()
            files[str(path)] = {"sha256": sha256, "uri": store.put_bytes(f"{REWARD_FILES}/{sha256}.py", data)}
        elif str(path) not in files:
            raise ValueError(f"{field_name}: reward file '{path}' does not exist where the run starts (working "
                             f"directory {os.getcwd()})")
        record[field_name] = {"path": str(path), **files[str(path)]}
    return (merge(cfg, {"reward.files": files}) if files else cfg), record


def sources_record(sources: Sources) -> tuple[dict, dict]:
    """({model field: provenance}, {data field: provenance}) of a job's pinned sources (models/resolve.py: source,
    hub commit, s3 ETags, the digest of its files; generated data: its name and options): what its summary, its
    checkpoints' manifests and its MLflow tags say it read."""
    return ({field: found.provenance for field, found in sources.models.items()},
            {field: found.provenance for field, found in sources.data.items()})


def provenance_tags(sources: dict, reward_files: dict) -> dict[str, str]:
    """MLflow tags of what a job reads: each reward file's sha256, each model's and data set's digest (and hub
    commit)."""
    tags = {f"{field_name}.sha256": entry["sha256"] for field_name, entry in reward_files.items()}
    for field_name, provenance in sources.items():
        if provenance["digest"] is None:  # builtin data: made by code
            continue
        tags[f"{field_name}.digest"] = provenance["digest"]
        if provenance.get("commit"):
            tags[f"{field_name}.commit"] = provenance["commit"]
    return tags


def record_tags(record: dict, prefix: str = "provenance") -> dict[str, str]:
    """A provenance record as MLflow tags: 'provenance.digest' (the record's digest: a pipeline stage's key) and
    'provenance.<dotted key>' -> value for what it is made of (data, models, files, code; its config fields are the
    run's params already)."""
    if not record:
        return {}
    out = {f"{prefix}.digest": digest(record)} if prefix == "provenance" else {}
    for key, value in record.items():
        name = f"{prefix}.{key}"
        if key == "config" and prefix == "provenance":
            continue
        if isinstance(value, dict):
            out.update(record_tags(value, name))
        elif value is not None:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _jsonable(value):
    """RNG states (tensors, tuples) in a JSON manifest."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def tuple_state(value):
    return tuple(tuple_state(v) if isinstance(v, list) else v for v in value)


def from_jsonable(value):
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=torch.uint8)
    if isinstance(value, dict):
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value
