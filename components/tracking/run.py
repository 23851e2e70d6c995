"""A run's durable state: its name, local directory, checkpoint store, MLflow run, and the resume manifest.

A checkpoint holds `actor/` (all written by rank 0: full HF save_pretrained weights or the LoRA adapter;
optimizer.pt: the full optimizer state, gathered from the shards; actor_state.pt: schedule, KL controller, minibatch
stream, iteration, consumed rollouts, world size, every rank's sampling stream), `critic/` (the critic's critic_save output of the same iteration, in
every launch mode) and state.json (the manifest: iteration, critic step, tracking run id, global RNG states, config).
Re-running with the same run name resumes from the newest complete checkpoint that passes its checks: one that fails
them (a corrupt or missing file) is said and passed over for the previous one; when none passes, the run fails naming
each checkpoint and the cause; only "no checkpoint yet" starts a new run.

What a run is made of travels with it: opening it stores the bytes of every reward file it names (a local
'path/to/rewards.py:fn') in its store, `rewards/<sha256>.py`, and sets reward.files, so every process that scores
loads those bytes by their digest (models/reward.py); the digests are MLflow tags (`reward.function.sha256`, ...) and
the run's record holds them with the provenance of every model (models/resolve.py: its source, hub commit, s3 ETags,
the digest of its files), in the summary and in every checkpoint's manifest (what `rlhf export` checks a LoRA
adapter's base against).

One writer per run name: opening a run takes the lease of its store (components/storage/lease.py) before anything
of the run is touched; another live run of the name is refused naming its holder, and the lease is released at close.
An attempt of a run on several nodes opens it under the lease its controller holds (`lease_holder`: the holder id),
checked before every checkpoint.
RunPlace has a slot for the run's secret, which the run's servers are started with (components/serving/services.py
makes it, once per attempt); what is logged to MLflow has the passwords of URLs taken out (tracker.redact).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import random
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from components.launch.stack import running_mlflow_uri
from components.storage.lease import HeldLease, acquire as acquire_lease
from components.storage.store import CheckpointStore
from components.tracking.tracker import Tracker, resolve_tracking_uri
from models.config import RLHFConfig, merge, run_name_for
from models.export import export_spec
from models.resolve import resolve_data
from models.reward import is_file_spec, reward_file

if TYPE_CHECKING:  # only annotations here: what reads a run's record (a sweep, rlhf compare) loads no model code
    from models.loop import Leader


LOG = logging.getLogger("rlhf.run")


def _flow_run_id() -> str | None:
    """The Prefect flow run this process runs, if any (named in the run's lease)."""
    try:
        from prefect.runtime import flow_run  # heavy: Prefect, only to name the holder of the run's lease

        return str(flow_run.get_id()) if flow_run.get_id() else None
    except Exception:  # noqa: BLE001 - no Prefect context: a plain process
        return None


def checkpoint_uri(cfg: RLHFConfig, run_name: str) -> str:
    base = cfg.deploy.checkpoint.uri or (cfg.resolved_state_dir() / "checkpoints").as_uri()
    return f"{base.rstrip('/')}/{run_name}"


def default_tracking_uri(cfg: RLHFConfig) -> str:
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
    checkpoint store (a deployment critic uploads there), the checkpoint iteration a resumed critic starts from, and
    the run's secret (every server of the run takes requests carrying it only: components/serving/auth.py)."""

    run_name: str
    log_dir: Path
    critic_dir: Optional[Path] = None
    store_uri: Optional[str] = None
    critic_restore_iteration: Optional[int] = None
    secret: Optional[str] = field(default=None, repr=False)  # made where the servers start (services.run_secret)


@contextmanager
def closed_when_done(session):
    """A run's record (a RunSession, a stage's session) for the block, closed on the way out: its MLflow run
    FINISHED, or FAILED when the block raised (a failure, a cancellation)."""
    status = "FAILED"
    try:
        yield session
        status = "FINISHED"
    finally:
        session.close(status)


@dataclass
class RunSession:
    cfg: RLHFConfig
    name: str
    local_dir: Path
    store: CheckpointStore
    tracker: Tracker
    resumed_from: int | None = None
    manifest: dict = field(default_factory=dict)
    lease: object = None  # one writer per run name (components/storage/lease.py), released at close
    models: dict = field(default_factory=dict)  # model field -> its provenance (models/resolve.py)
    data: dict = field(default_factory=dict)  # data field -> its provenance (data.prompts, eval.prompts)
    reward_files: dict = field(default_factory=dict)  # reward field -> {path, sha256, uri} (store_reward_files)

    @property
    def critic_restore_iteration(self) -> int | None:
        """The checkpoint iteration whose critic a (deployment) critic server must start from; None for a new critic."""
        return self.resumed_from if self.manifest.get("critic_step") is not None else None

    @property
    def critic_dir(self) -> Path:
        return self.local_dir / "critic"

    @functools.cached_property
    def place(self) -> RunPlace:
        """One RunPlace per session: the servers of the run share it (and the secret made for them)."""
        return RunPlace(self.name, self.local_dir / "logs", self.critic_dir, self.store.uri, self.critic_restore_iteration)

    @classmethod
    def open(cls, cfg: RLHFConfig, tags: dict[str, str] | None = None,
             log: Callable[[str], None] = LOG.warning, lease_holder: str | None = None) -> "RunSession":
        """Resolve the run; take its lease (one writer per run name: another live run of this name is refused,
        naming it, before anything of it is touched), or with `lease_holder` write under the lease of that holder
        (a multi-node run's controller); if its store has a checkpoint, download the newest that passes its checks
        (an older one when the newest fails them, said through `log`) and remember the manifest."""
        name = run_name_for(cfg)
        store = CheckpointStore.from_uri(checkpoint_uri(cfg, name), s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
        lease = (HeldLease(store, name, lease_holder) if lease_holder else
                 acquire_lease(store, name, cfg.deploy.checkpoint.lease_timeout_s, log, _flow_run_id()))
        try:
            cfg, reward_files = store_reward_files(cfg, store)
            models, data = model_provenance(cfg), data_provenance(cfg)
            local_dir = cfg.resolved_state_dir() / "runs" / name
            local_dir.mkdir(parents=True, exist_ok=True)
            manifest, resumed_from = {}, None
            restore_dir = local_dir / "restore"
            shutil.rmtree(local_dir / "critic", ignore_errors=True)  # never resume a critic newer/older than the actor
            # launch=deployment: the critic server (maybe on another node) restores its part from the store itself
            parts = ("actor",) if cfg.deploy.critic.launch == "deployment" else None
            restored = store.restore(restore_dir, parts=parts, log=log)
            if restored is not None:
                resumed_from, manifest = restored[0], from_jsonable(restored[1])
                if (restore_dir / "critic").exists():
                    shutil.copytree(restore_dir / "critic", local_dir / "critic")
            nested = {"mlflow.parentRunId": cfg.tracking.parent_run_id} if cfg.tracking.parent_run_id else {}
            tracker = Tracker(default_tracking_uri(cfg), cfg.tracking.experiment, name,
                              run_id=manifest.get("tracking_run_id"),
                              tags={"algorithm": cfg.algorithm,
                                    "preset": "tiny" if cfg.model.policy.startswith("tiny/") else "custom",
                                    "reward_transport": cfg.reward.transport,
                                    **provenance_tags({**models, **data}, reward_files),
                                    **nested, **(tags or {})},
                              system_metrics=cfg.deploy.tracking.system_metrics)
            # URL passwords redacted by the tracker; the reward files' digests are tags (their paths make no param names)
            tracker.start(cfg.model_dump(mode="json", exclude={"reward": {"files"}}))
        except BaseException:
            lease.release()
            raise
        return cls(cfg, name, local_dir, store, tracker, resumed_from, manifest, lease=lease, models=models,
                   data=data, reward_files=reward_files)

    @property
    def start_iteration(self) -> int:
        return int(self.manifest.get("iteration", 0))

    def restore_actor(self, actor: Leader) -> str | None:
        """Load the downloaded checkpoint into the freshly built actor on all its ranks (weights, optimizer, RNGs);
        returns a warning when the checkpoint was saved by another number of ranks (then the optimizer starts fresh)."""
        if self.resumed_from is None:
            return None
        warning = actor.restore(self.local_dir / "restore" / "actor")
        torch.set_rng_state(self.manifest["rng"]["torch"])
        random.setstate(_tuple_state(self.manifest["rng"]["python"]))
        return warning

    def save(self, actor: Leader, critic_info: dict | None) -> str:
        """Checkpoint the actor (all ranks take part) + the critic of the same iteration + the manifest; prune;
        record in MLflow."""
        if self.lease is not None:
            self.lease.check()  # a run whose lease was taken over writes nothing more
        state = actor.state
        stage = self.local_dir / "staging"
        shutil.rmtree(stage, ignore_errors=True)
        actor_dir = stage / "actor"
        actor.save(actor_dir)
        parts, stored = {"actor": actor_dir}, {}
        if critic_info:
            # a server with the run's store (launch=deployment) uploaded its save there: adopted inside the store;
            # a local child or in-process critic saved into a directory on this machine
            key = self.store.key_of(critic_info["path"])
            if key is not None:
                stored["critic"] = key
            else:
                parts["critic"] = Path(critic_info["path"])
        manifest = {"iteration": state.iteration, "episode": state.episode, "run_name": self.name,
                    "world_size": state.me.world_size,
                    "tracking_run_id": self.tracker.run_id, "critic_step": (critic_info or {}).get("step"),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "config": self.cfg.model_dump(mode="json"), "models": self.models, "data": self.data,
                    "reward_files": self.reward_files,
                    "export": export_spec("actor", "causal-lm", self.cfg.model.dtype, self.cfg.model.policy,
                                          self.cfg.model.revision, "model.policy", self.models.get("model.policy"))}
        uri = self.store.save(state.iteration, parts, _jsonable(manifest), stored=stored)
        for key in stored.values():
            self.store.delete_dir(key)
        self.store.prune(self.cfg.checkpoint.keep_last)
        self.tracker.log_checkpoint(uri, state.iteration)
        shutil.rmtree(stage, ignore_errors=True)
        return uri

    def log(self, iteration: int, metrics: dict, samples: list[dict]) -> None:
        """Metrics at step=iteration; a step already logged by an earlier attempt (recomputed after resume) is skipped."""
        if self.tracker.last_step is not None and iteration <= self.tracker.last_step:
            return
        self.tracker.log_metrics(metrics, step=iteration)
        if self.logs_table(iteration):
            self.tracker.log_table(samples, step=iteration)

    def logs_table(self, iteration: int) -> bool:
        """Whether iteration `iteration`'s samples are logged as a table (every tracking.table_every, and the first)."""
        return iteration % self.cfg.tracking.table_every == 0 or iteration == 1

    def log_eval(self, iteration: int, metrics: dict, rows: list[dict]) -> None:
        """A held-out eval before iteration + 1 (or at the end): its metrics at step=iteration and its samples as
        the MLflow table tables/eval_<iteration>.json."""
        self.tracker.log_side_metrics(metrics, step=iteration)
        if rows:
            self.tracker.log_table(rows, step=iteration, name="eval")

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
            digest = hashlib.sha256(data).hexdigest()
            files[str(path)] = {"sha256": digest, "uri": store.put_bytes(f"{REWARD_FILES}/{digest}.py", data)}
        elif str(path) not in files:
            raise ValueError(f"{field_name}: reward file '{path}' does not exist where the run starts (working "
                             f"directory {os.getcwd()})")
        record[field_name] = {"path": str(path), **files[str(path)]}
    return (merge(cfg, {"reward.files": files}) if files else cfg), record


def model_provenance(cfg: RLHFConfig) -> dict:
    """{model.<field>: provenance} of every model the run names (models/resolve.py: source, hub commit, s3 ETags,
    the digest of its files)."""
    return {f"model.{name}": cfg.resolve_model(value).provenance for name in ("policy", "reward", "critic")
            if (value := getattr(cfg.model, name))}


def data_provenance(cfg: RLHFConfig) -> dict:
    """{data.prompts / eval.prompts: provenance} of the data the run reads (models/resolve.py: a local file's,
    an s3:// object's or a hub data set's digest and origin; builtin data: its name; reasoning_gym data: its name and
    options)."""
    d, e = cfg.data, cfg.eval
    sources = [("data.prompts", d.prompts, d.revision, d.subset, d.options)]
    if e.prompts and e.every:
        sources.append(("eval.prompts", e.prompts, e.revision, e.subset, e.options))
    return {name: {**resolve_data(value, name, revision, cfg.deploy, subset).provenance,
                   **({"options": options} if options else {})}
            for name, value, revision, subset, options in sources if value}


def provenance_tags(sources: dict, reward_files: dict) -> dict[str, str]:
    """MLflow tags of what a run is made of: each reward file's sha256, each model's and data set's digest (and hub
    commit)."""
    tags = {f"{field_name}.sha256": entry["sha256"] for field_name, entry in reward_files.items()}
    for field_name, provenance in sources.items():
        if provenance["digest"] is None:  # builtin data: made by code
            continue
        tags[f"{field_name}.digest"] = provenance["digest"]
        if provenance.get("commit"):
            tags[f"{field_name}.commit"] = provenance["commit"]
    return tags


def _jsonable(value):
    """RNG states (tensors, tuples) in a JSON manifest."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist()}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _tuple_state(value):
    return tuple(_tuple_state(v) if isinstance(v, list) else v for v in value)


def from_jsonable(value):
    if isinstance(value, dict) and "__tensor__" in value:
        return torch.tensor(value["__tensor__"], dtype=torch.uint8)
    if isinstance(value, dict):
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return value
