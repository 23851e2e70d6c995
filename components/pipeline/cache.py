"""Stages cached by what they were made from: records and the lease that builds a stage once.

A stage's key is the digest of its job's provenance record (components/tracking/provenance.py): the config fields
that change what it trains, its seed, its data by content, its upstream models by content (a hub model by its
resolved commit too), its reward and gold files by their bytes, and the code version (the syntax tree, docstrings
aside, of every project module the job's processes import: components/tracking/code.py; the versions of the libraries
that change results). Where a stage runs (deploy.*: ranks, servers, stores) is not in it:
the update is the same whatever the world size. Nothing else is in it either: the pipeline's name, the time, the user,
an edit of the CLI.

A built stage leaves a small record beside its checkpoints, `<checkpoint base>/<stage>-<key[:20]>/record.json`: the
full key and its provenance, the model's URI and the sha256 of each of its files, its metrics, the MLflow run that
built it. On S3 the records are shared by every pod, so a pipeline on any node reuses what any other built; they are
never pickles and never hold a model. A record is reused only if its key matches in full and the stored model still
has every recorded file with the recorded digest (`valid_record`).

Two pipelines (or sweep trials) that need one stage at once build it once: each takes the stage's lease
(`<checkpoint base>/locks/<stage>-<key[:20]>`, components/storage/lease.py, waiting for as long as it takes) before
building; the second waits, then finds the first's record and reuses it. A holder that died leaves the lease to the
next one (locally at once; on S3 once it was not renewed for deploy.checkpoint.lease_timeout_s).
"""

from __future__ import annotations

import time
from typing import Callable

from components.storage.backends import CheckpointError
from components.storage.lease import Holder, held
from components.storage.store import CheckpointStore
from models.kinds import KINDS

PREFIXES = {kind.job: kind.command for kind in KINDS}  # of a stage's directory: its kind's command (models/kinds.py)
KEY_CHARS = 20  # of the key in a stage's directory name (80 bits); the record holds the full key


def stage_dir(stage: str, key: str) -> str:
    """The stage's directory (and run name) under the checkpoint base: '<stage>-<key[:20]>'."""
    return f"{PREFIXES[stage]}-{key[:KEY_CHARS]}"


class Records:
    """The stage records and leases under one checkpoint base (deploy.checkpoint.uri, or <state_dir>/checkpoints)."""

    def __init__(self, base_uri: str, s3_endpoint_url: str | None = None, lease_timeout_s: float = 60.0):
        self.base_uri, self.s3_endpoint_url = base_uri.rstrip("/"), s3_endpoint_url
        self.lease_timeout_s = lease_timeout_s
        self.base = CheckpointStore.from_uri(self.base_uri, s3_endpoint_url=s3_endpoint_url)

    def store(self, stage: str, key: str) -> CheckpointStore:
        """The store of a stage's run: its checkpoints, its model, its record."""
        return CheckpointStore.from_uri(f"{self.base_uri}/{stage_dir(stage, key)}",
                                        s3_endpoint_url=self.s3_endpoint_url)

    def valid_record(self, stage: str, key: str) -> dict | None:
        """The record of (stage, key) if it can be reused: its full key matches and its model (if it has one) is in
        the store with every recorded file and digest; else None."""
        store = self.store(stage, key)
        record = store.get_json("record.json")
        if record is None or record.get("key") != key:
            return None
        if record.get("files"):
            try:
                stored = store.get_json("model.sha256.json")
            except CheckpointError:
                return None
            if stored != record["files"]:
                return None
        return record

    def write(self, stage: str, key: str, record: dict) -> str:
        return self.store(stage, key).put_json("record.json", {**record, "stage": stage, "key": key})

    def lease(self, stage: str, key: str, pipeline: str, waiting: Callable[[Holder | None], None]):
        """The lease that builds (stage, key) once, waited for; `waiting(holder)` is told who holds it."""
        return held(self.base, f"pipeline {pipeline}", f"locks/{stage_dir(stage, key)}", wait_s=None,
                    timeout_s=self.lease_timeout_s, waiting=waiting)


def build_once(records: Records, stage: str, key: str, build: Callable[[], dict], pipeline: str,
               log: Callable[[str], None], forced: bool = False) -> dict:
    """The record of (stage, key): reused when valid (marked `reused`), else built under the stage's lease and
    written. A pipeline that finds the lease taken waits, then reuses what the holder built (or builds it, if the
    holder failed). `forced` (--from): built again from scratch, its earlier checkpoints deleted first, so the run
    does not resume them."""
    if not forced and (record := records.valid_record(stage, key)) is not None:
        return reused(stage, record, log)

    def waiting(holder: Holder | None) -> None:
        who = f"{holder.name} ({holder.describe()})" if holder else "another pipeline"
        log(f"{stage}: {who} is building {stage_dir(stage, key)}; waiting for it")

    with records.lease(stage, key, pipeline, waiting):
        if not forced and (record := records.valid_record(stage, key)) is not None:
            return reused(stage, record, log)  # built while we waited
        if forced:
            records.store(stage, key).delete_all()
        log(f"{stage}: building {stage_dir(stage, key)}")
        record = {**build(), "pipeline": pipeline, "created": time.time()}
        records.write(stage, key, record)
        return {**record, "stage": stage, "key": key}


def reused(stage: str, record: dict, log: Callable[[str], None]) -> dict:
    log(f"{stage}: cached: reusing {record.get('model') or stage_dir(stage, record['key'])} (built by pipeline "
        f"{record.get('pipeline')}, MLflow run {record.get('mlflow_run_id')})")
    return {**record, "reused": True}
