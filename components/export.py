"""A trained model out of a run: its final policy as a Hugging Face model in the run's store and in MLflow (the last
step of every run), and `rlhf export RUN [--iteration N] --out DIR` for any run or checkpoint.

Both go through one path: the actor part of a checkpoint (iter_<N>/actor) is downloaded from the run's store and
converted by models/export.py with the run's own config (its base model for LoRA, its model.dtype), so what a run
leaves and what `rlhf export` writes for the same iteration are the same files. A run keeps its model beside its
checkpoints, as `<store>/model/` (sha256-checked like a checkpoint part), and logs it to its MLflow run as the run's
model (an MLflow 3 logged model in the transformers flavor, registered under tracking.register_as when set).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from components.storage.backends import CheckpointError
from components.storage.store import CheckpointStore
from components.tracking.run import checkpoint_uri
from models.config import RLHFConfig
from models.export import export_policy
from models.tiny_files import file_digests, manifest_digest

MODEL_KEY = "model"  # where a run keeps its exported model in its store


def run_store(cfg: RLHFConfig, run: str) -> CheckpointStore:
    """The checkpoint store of `run`: a run name (in the config's checkpoint location: deploy.checkpoint.uri, else
    <state_dir>/checkpoints) or a store's own URI or path (file:///..., s3://bucket/prefix/run, a directory)."""
    if "://" in run or Path(run).expanduser().is_dir():
        uri = run
    else:
        uri = checkpoint_uri(cfg, run)
    return CheckpointStore.from_uri(uri, s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)


def export_checkpoint(store: CheckpointStore, out_dir: str | Path, iteration: int | None = None) -> tuple[Path, int]:
    """The policy of checkpoint `iteration` (the latest by default) of `store` as a Hugging Face model in `out_dir`;
    returns (out_dir, iteration)."""
    iteration = store.latest() if iteration is None else iteration
    if iteration is None:
        raise CheckpointError(f"no checkpoint in {store.uri}: nothing to export")
    if iteration not in store.list():
        raise CheckpointError(f"{store.uri} has no complete checkpoint iter_{iteration}; its checkpoints: {store.list()}")
    out_dir = Path(out_dir)
    scratch = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir.parent if out_dir.parent.is_dir() else None))
    try:
        state = store.load(scratch, iteration, parts=("actor",))
        cfg = RLHFConfig.model_validate(state["config"])
        base = cfg.resolve_model_path(cfg.model.policy) if (scratch / "actor" / "adapter_config.json").exists() else None
        export_policy(scratch / "actor", out_dir, base, cfg.model.dtype)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out_dir, iteration


def publish_directory(session, local: str | Path) -> dict:
    """A job's model (a Hugging Face directory on this machine) into its store as `model/`, with every file's sha256
    beside it, and named in its MLflow run (tag model.uri). Returns {"model": store URI, "model_dir", "files":
    {path: sha256}, "digest"}: what a pipeline records and a later stage checks."""
    uri = session.store.put_dir(Path(local), MODEL_KEY)
    files = file_digests(Path(local))
    session.tracker.client.set_tag(session.tracker.run_id, "model.uri", uri)
    return {"model": uri, "model_dir": str(local), "files": files, "digest": manifest_digest(files)}


def publish_model(session) -> dict:
    """The last step of an RL run (components/jobs/rl.py): its final policy exported from its last checkpoint into
    its store (`model/`, as publish_directory) and logged to its MLflow run as the run's model (registered under
    tracking.register_as when set). Returns where it went: publish_directory's, "mlflow_model_id", "iteration"."""
    local = session.local_dir / "model"
    shutil.rmtree(local, ignore_errors=True)
    out, iteration = export_checkpoint(session.store, local)
    published = publish_directory(session, out)
    model_id = session.tracker.log_model(out, step=iteration, register_as=session.cfg.tracking.register_as)
    return {**published, "mlflow_model_id": model_id, "iteration": iteration}
