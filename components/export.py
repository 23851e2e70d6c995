"""A trained model out of a run: its final model as a Hugging Face model in the run's store and in MLflow (the last
step of every run: an RL run's policy, an SFT or reward-model stage's model), and `rlhf export RUN [--iteration N]
--out DIR` for any run or checkpoint.

All go through one path: the trained part of a checkpoint (iter_<N>/actor of an RL run, iter_<N>/trainee of a stage)
is downloaded from the run's store and converted by models/export.py as the checkpoint's manifest says (`export`: the
part, the task, the job's dtype, and the base a LoRA adapter merges onto with the digest its run recorded), so what a
run leaves and what `rlhf export` writes for the same iteration are the same files. A job keeps its model beside its
checkpoints, as `<store>/model/` (sha256-checked like a checkpoint part, every file's sha256 in its summary), and an
RL run logs it to its MLflow run as the run's model (an MLflow 3 logged model in the transformers flavor, registered
under tracking.register_as when set).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from components.storage.backends import CheckpointError
from components.storage.store import CheckpointStore
from components.tracking.run import checkpoint_uri
from models.config import RLHFConfig
from models.deploy import DeployConfig
from models.export import export_model
from models.resolve import file_digests, resolve_model
from models.tiny_files import manifest_digest

MODEL_KEY = "model"  # where a run keeps its exported model in its store
PARTS = ("actor", "trainee")  # the trained part of an RL run's checkpoint, of a stage's


def run_store(cfg: RLHFConfig, run: str) -> CheckpointStore:
    """The checkpoint store of `run`: a run name (in the config's checkpoint location: deploy.checkpoint.uri, else
    <state_dir>/checkpoints) or a store's own URI or path (file:///..., s3://bucket/prefix/run, a directory)."""
    if "://" in run or Path(run).expanduser().is_dir():
        uri = run
    else:
        uri = checkpoint_uri(cfg, run)
    return CheckpointStore.from_uri(uri, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)


def export_checkpoint(store: CheckpointStore, out_dir: str | Path, iteration: int | None = None,
                      deploy: DeployConfig | None = None, config: dict | None = None,
                      base: str | None = None) -> tuple[Path, int]:
    """The model of checkpoint `iteration` (the latest by default) of `store` as a Hugging Face model in `out_dir`,
    `config` entries added to its config.json. A LoRA adapter merges onto its base: `base`, its local directory as the
    job pinned it (a job publishing its model), else the base its manifest names found on this machine (`deploy`: the
    cache and downloads; a hub id at the commit the run pinned: models/resolve.py). Returns (out_dir, iteration)."""
    iteration = store.latest() if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {store.uri}: nothing to export")
    if iteration not in store.list():
        raise CheckpointError(f"{store.uri} has no complete checkpoint iter_{iteration}; its checkpoints: "
                              f"{store.list()}")
    out_dir = Path(out_dir)
    scratch = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir.parent if out_dir.parent.is_dir() else None))
    try:
        state = store.load(scratch, iteration, parts=PARTS)
        if "export" not in state:
            raise CheckpointError(f"iter_{iteration} of {store.uri} says nothing of what to export (its manifest has "
                                  f"no 'export': written by an earlier version)")
        spec = state["export"]
        trained = scratch / spec["part"]
        wanted = spec["base"]
        if base is None and (trained / "adapter_config.json").exists():  # an export later, elsewhere: found here
            base = resolve_model(wanted["value"], wanted["field"], wanted.get("commit") or wanted["revision"],
                                 deploy).path
        export_model(trained, out_dir, base, spec["dtype"], spec["task"], config, base_digest=wanted.get("digest"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir, iteration


def publish_model(session, base_field: str, config: dict | None = None, log_model: bool = True) -> dict:
    """The last step of every job that trains a model (components/runs.py): its model exported from its last
    checkpoint (a LoRA adapter merged onto the model of `base_field` as the job pinned it; `config` entries added to
    its config.json: a reward model's statistics) into its store (`model/`,
    every file's sha256 beside it), named in its MLflow run (tag model.uri) and, with `log_model` (an RL run's
    policy), logged to it as the run's model (registered under tracking.register_as when set). Returns {"model": store
    URI, "model_dir", "files": {path: sha256}, "digest", "iteration", "mlflow_model_id" (when logged)}."""
    local = session.local_dir / "model"
    shutil.rmtree(local, ignore_errors=True)
    out, iteration = export_checkpoint(session.store, local, config=config, base=session.cfg.local_path(base_field))
    uri = session.store.put_dir(out, MODEL_KEY)
    files = file_digests(out)
    session.tracker.client.set_tag(session.tracker.run_id, "model.uri", uri)
    published = {"model": uri, "model_dir": str(out), "files": files, "digest": manifest_digest(files),
                 "iteration": iteration}
    if log_model:
        published["mlflow_model_id"] = session.tracker.log_model(out, step=iteration,
                                                                 register_as=session.cfg.tracking.register_as)
    return published
