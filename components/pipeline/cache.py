"""Stages cached by what they were made from: keys, records and the lock that builds a stage once.

A stage's key is the sha256 of what decides its output: its own config (the section, with the pipeline's seed), the
digests of its input data (every row as read: models/stages/data.rows_digest), the digests of its upstream stages'
models (the sha256 of every file: `model_digest`) and the code version (the sha256 of the package's source and the
versions of torch, transformers, tokenizers, peft and datasets: any code change or upgrade rebuilds). Where a stage runs (deploy.*: ranks, servers, stores) is not in it: the update is the same whatever
the world size. Nothing else is in it either: the pipeline's name, the time, the user.

A built stage leaves a small record beside its checkpoints, `<checkpoint base>/<stage>-<key[:20]>/record.json`: the
full key and its inputs, the model's URI and the sha256 of each of its files, its metrics, the MLflow run that built
it. On S3 the records are shared by every pod, so a pipeline on any node reuses what any other built; they are never
pickles and never hold a model. A record is reused only if its key matches in full and the stored model still has
every recorded file with the recorded digest (`valid_record`).

Two pipelines (or sweep trials) that need one stage at once build it once: each takes the stage's lock
(`<checkpoint base>/locks/<stage>-<key[:20]>`, components/storage/store.CheckpointStore.exclusive) before
building; the second waits, then finds the first's record and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import Callable

from components.storage.backends import CheckpointError
from components.storage.store import CheckpointStore
from models.deploy import DeployConfig
from models.resolve import resolve_model

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("models", "components", "flows")  # the package's source: what a stage is computed by
PREFIXES = {"sft": "sft", "reward_model": "reward-model", "rl": "rl", "eval": "eval"}
KEY_CHARS = 20  # of the key in a stage's directory name (80 bits); the record holds the full key


LIBRARIES = ("torch", "transformers", "tokenizers", "peft", "datasets")  # what trains, tokenizes and loads a model


@lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 over the package's Python source (models/, components/, flows/: every file's path and bytes) and the
    versions of the libraries that train, tokenize and load the models (an upgrade may change what a stage makes,
    or how its model loads)."""
    digest = hashlib.sha256(json.dumps({name: version(name) for name in LIBRARIES}, sort_keys=True).encode())
    for folder in CODE_DIRS:
        for path in sorted((PACKAGE_ROOT / folder).rglob("*.py")):
            digest.update(f"{path.relative_to(PACKAGE_ROOT).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def model_digest(model: str, field: str, revision: str | None = None, deploy: DeployConfig | None = None) -> str:
    """What a model is: the digest of its files wherever it comes from (models/resolve.py: a local directory, the
    embedded tiny/<name>, a hub id's snapshot at `revision`, an s3:// prefix), so a hub model at another commit is
    another model."""
    return resolve_model(model, field, revision, deploy).digest


def stage_key(stage: str, config: dict, data: dict[str, str], upstream: dict[str, str], code: str) -> str:
    """The key of a stage: sha256 of its config, input-data digests, upstream model digests and code version."""
    inputs = {"stage": stage, "config": config, "data": data, "upstream": upstream, "code": code}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def stage_dir(stage: str, key: str) -> str:
    """The stage's directory (and run name) under the checkpoint base: '<stage>-<key[:20]>'."""
    return f"{PREFIXES[stage]}-{key[:KEY_CHARS]}"


class Records:
    """The stage records and locks under one checkpoint base (deploy.checkpoint.uri, or <state_dir>/checkpoints)."""

    def __init__(self, base_uri: str, s3_endpoint_url: str | None = None):
        self.base_uri, self.s3_endpoint_url = base_uri.rstrip("/"), s3_endpoint_url
        self.base = CheckpointStore.from_uri(self.base_uri, s3_endpoint_url=s3_endpoint_url)

    def store(self, stage: str, key: str) -> CheckpointStore:
        """The store of a stage's run: its checkpoints, its model, its record."""
        return CheckpointStore.from_uri(f"{self.base_uri}/{stage_dir(stage, key)}", s3_endpoint_url=self.s3_endpoint_url)

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

    def lock(self, stage: str, key: str, pipeline: str, waiting):
        """The lock that builds (stage, key) once; `waiting(holder)` is told who holds it when it is taken."""
        owner = {"pipeline": pipeline, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        return self.base.exclusive(f"locks/{stage_dir(stage, key)}", owner, waiting)


def build_once(records: Records, stage: str, key: str, build: Callable[[], dict], pipeline: str,
               log: Callable[[str], None], forced: bool = False) -> dict:
    """The record of (stage, key): reused when valid (marked `reused`), else built under the stage's lock and
    written. A pipeline that finds the lock taken waits, then reuses what the holder built (or builds it, if the
    holder failed). `forced` (--from): built again from scratch, its earlier checkpoints deleted first, so the run
    does not resume them."""
    if not forced and (record := records.valid_record(stage, key)) is not None:
        return reused(stage, record, log)

    def waiting(holder: dict | None) -> None:
        who = (f"pipeline {holder.get('pipeline')} (host {holder.get('host')}, pid {holder.get('pid')})"
               if holder else "another pipeline")
        log(f"{stage}: {who} is building {stage_dir(stage, key)}; waiting for it")

    with records.lock(stage, key, pipeline, waiting):
        if not forced and (record := records.valid_record(stage, key)) is not None:
            return reused(stage, record, log)  # built while we waited
        if forced:
            records.store(stage, key).delete_all()
        log(f"{stage}: building {stage_dir(stage, key)}")
        record = {**build(), "pipeline": pipeline, "code": code_version(), "created": time.time()}
        records.write(stage, key, record)
        return {**record, "stage": stage, "key": key}


def reused(stage: str, record: dict, log: Callable[[str], None]) -> dict:
    log(f"{stage}: cached: reusing {record.get('model') or stage_dir(stage, record['key'])} (built by pipeline "
        f"{record.get('pipeline')}, MLflow run {record.get('mlflow_run_id')})")
    return {**record, "reused": True}
