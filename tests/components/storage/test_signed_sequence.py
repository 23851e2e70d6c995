"""Runs that cannot harm each other through a shared store (components/storage/store.py, signing.py), on local disk
and on a real S3 endpoint (moto's server): what a writer with the bucket's rights but without the deployment's store
key leaves in a run's store is never resumed (a latest.json naming the run's own fence token, a manifest, a record
signed for another run or by another deployment, a deleted latest.json over a planted checkpoint); a fenced-out
writer's checkpoint, even with a clock ahead of the live writer's, neither survives a prune over the live writer's
nor becomes a fallback; a new process of the run resumes what it committed, bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from components.storage import store as store_module
from components.storage.backends import CheckpointError
from components.storage.lease import LeaseLost
from tests.components.storage.test_checkpoints import (FAST, REPO, fresh_store, key_of, make_parts, open_store,
                                                       overwrite_in_store, raw_keys, raw_keys_bytes, same_tree)

OLD, NEW = "lease-of-the-stalled-holder", "lease-of-the-live-holder"  # two holders' fencing tokens (lease.token)


@pytest.fixture(params=[pytest.param("file", marks=FAST), "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(uri, s3 endpoint or None) of a fresh run store `exp1`, on local disk and on S3."""
    return fresh_store(request, tmp_path)


def sibling(store_uri: tuple[str, str | None], name: str) -> tuple[str, str | None]:
    """The store of another run, `name`, beside this one (the same bucket or directory)."""
    uri, endpoint = store_uri
    return f"{uri.rstrip('/').rsplit('/', 1)[0]}/{name}", endpoint


def plant(store_uri: tuple[str, str | None], key: str, state: dict) -> None:
    """What a writer with the bucket's rights can make without the store key: a checkpoint prefix whose manifest
    names its files with their true sha256s, unsigned."""
    weights = os.urandom(64)
    overwrite_in_store(store_uri, f"{key}/actor/weights.bin", weights)
    manifest = {"iteration": 9, "state": state, "files": {"actor/weights.bin": hashlib.sha256(weights).hexdigest()},
                "parts": ["actor"], "path": key, "created": datetime.now().isoformat()}
    overwrite_in_store(store_uri, f"{key}/state.json", json.dumps(manifest).encode())


def stale_save(store, store_uri: tuple[str, str | None], iteration: int, parts: dict,
               monkeypatch: pytest.MonkeyPatch) -> str:
    """The stalled holder's save of `iteration`, its clock a day ahead of the live holder's, taken over after its
    first file (the live holder fences the store): its prefix is complete, state.json and all, but its commit fails
    (LeaseLost). Returns that prefix."""
    ahead = type("Ahead", (datetime,), {"now": classmethod(lambda cls, tz=None: datetime.now(tz) + timedelta(days=1))})
    taken = []

    def take_over(relpath: str) -> None:
        if not taken:
            taken.append(relpath)
            store.fence(NEW)

    before = {k.split("/")[0] for k in raw_keys(store_uri)}
    monkeypatch.setattr(store_module, "datetime", ahead)
    try:
        with pytest.raises(LeaseLost):
            store.save(iteration, parts, {"by": "stalled"}, fence=OLD, _after_file=take_over)
    finally:
        monkeypatch.setattr(store_module, "datetime", datetime)
    made = {k.split("/")[0] for k in raw_keys(store_uri)} - before
    assert len(made) == 1 and taken, made
    return made.pop()


def test_a_forged_latest_json_that_names_the_runs_own_fence_is_refused_at_resume(store_uri, tmp_path: Path) -> None:
    """The fence token is readable in latest.json: a foreign latest.json that copies it and names a planted checkpoint
    is refused by the run's next attempt, at its fence and at its restore, naming latest.json; nothing is
    downloaded."""
    victim = open_store(store_uri)
    victim.fence(OLD)
    victim.save(1, make_parts(tmp_path / "a", 1), {"by": "victim"}, fence=OLD)
    latest = json.loads(raw_keys_bytes(store_uri, "latest.json"))
    plant(store_uri, "iter_9", {"by": "attacker"})
    overwrite_in_store(store_uri, "latest.json", json.dumps({**latest, "iteration": 9, "path": "iter_9"}).encode())

    attempt = open_store(store_uri)  # the run's next attempt
    with pytest.raises(CheckpointError, match=r"latest\.json fails its signature check \(its signature does not match"):
        attempt.fence(NEW)
    with pytest.raises(CheckpointError, match=r"/latest\.json fails its signature check"):
        attempt.restore(tmp_path / "restore")
    assert not (tmp_path / "restore").exists()
    assert json.loads(raw_keys_bytes(store_uri, "latest.json"))["fence"] == OLD  # the refused fence wrote nothing


def test_a_record_signed_for_another_run_is_refused_at_resume(store_uri, tmp_path: Path) -> None:
    """Another run of the same deployment (the same store key) signs its own store's records: its latest.json and
    checkpoint copied into this run's store do not verify here (the key is bound to the run's name)."""
    other_uri = sibling(store_uri, "exp2")
    other = open_store(other_uri)
    other.fence(OLD)
    key = key_of(other, other.save(1, make_parts(tmp_path / "b", 2), {"by": "exp2"}, fence=OLD))
    for name in raw_keys(other_uri):
        if name.startswith(f"{key}/") or name == "latest.json":
            overwrite_in_store(store_uri, name, raw_keys_bytes(other_uri, name))
    with pytest.raises(CheckpointError, match=r"latest\.json fails its signature check"):
        open_store(store_uri).fence(NEW)
    with pytest.raises(CheckpointError, match=r"latest\.json fails its signature check"):
        open_store(store_uri).restore(tmp_path / "restore")
    assert open_store(other_uri).restore(tmp_path / "theirs") == (1, {"by": "exp2"})  # where it belongs, it holds


def test_a_forged_manifest_of_a_committed_checkpoint_is_refused_not_passed_over(store_uri, tmp_path: Path) -> None:
    """A committed checkpoint's state.json rewritten without the key: the resume refuses it naming it, and does not
    fall back to the older checkpoint either (a forgery is not a corruption to route around)."""
    store = open_store(store_uri)
    store.fence(OLD)
    store.save(1, make_parts(tmp_path / "a", 1), {"by": "victim", "step": 1}, fence=OLD)
    key = key_of(store, store.save(2, make_parts(tmp_path / "b", 2), {"by": "victim", "step": 2}, fence=OLD))
    manifest = json.loads(raw_keys_bytes(store_uri, f"{key}/state.json"))
    overwrite_in_store(store_uri, f"{key}/state.json", json.dumps({**manifest, "state": {"by": "attacker"}}).encode())
    said: list[str] = []
    with pytest.raises(CheckpointError, match=rf"{key}/state\.json fails its signature check"):
        store.restore(tmp_path / "restore", log=said.append)
    assert said == [] and not (tmp_path / "restore").exists()
    with pytest.raises(CheckpointError, match=r"state\.json fails its signature check"):
        store.load(tmp_path / "load", iteration=2)


def test_a_deleted_latest_json_never_lets_a_planted_checkpoint_be_resumed(store_uri, tmp_path: Path) -> None:
    """latest.json deleted and a complete-looking checkpoint planted with a later name: the run's next attempt refuses
    to open the store (rather than resume the newest-looking checkpoint or start over), naming latest.json."""
    store = open_store(store_uri)
    store.fence(OLD)
    store.save(1, make_parts(tmp_path / "a", 1), {"by": "victim"}, fence=OLD)
    plant(store_uri, f"iter_9-{datetime.now() + timedelta(days=1):%Y%m%dT%H%M%S%f}Z-0000", {"by": "attacker"})
    overwrite_in_store(store_uri, "latest.json", None)
    attempt = open_store(store_uri)
    with pytest.raises(CheckpointError, match=r"latest\.json is missing, while the store holds committed checkpoints"):
        attempt.fence(NEW)
    with pytest.raises(CheckpointError, match=r"latest\.json is missing"):
        attempt.restore(tmp_path / "restore")
    assert not (tmp_path / "restore").exists()


def test_a_stale_writers_checkpoint_with_a_later_clock_does_not_survive_prune_over_the_live_writers(
        store_uri, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stalled holder's uncommitted save of iteration 2 (its clock a day ahead) and the live holder's committed
    save of 2: a prune keeps the live one and deletes the stalled one, and a fallback from a corrupt 3 resumes the
    live holder's 2."""
    store = open_store(store_uri)
    store.fence(OLD)
    store.save(1, make_parts(tmp_path / "a", 1), {"by": "stalled", "step": 1}, fence=OLD)
    stale = stale_save(store, store_uri, 2, make_parts(tmp_path / "b", 2), monkeypatch)
    live = key_of(store, store.save(2, make_parts(tmp_path / "c", 3), {"by": "live", "step": 2}, fence=NEW))
    third = key_of(store, store.save(3, make_parts(tmp_path / "d", 4), {"by": "live", "step": 3}, fence=NEW))
    assert store.prune(3, fence=NEW) == [2]
    tops = {name.split("/")[0] for name in raw_keys(store_uri)}
    assert live in tops and stale not in tops and store.list() == [1, 2, 3]
    overwrite_in_store(store_uri, f"{third}/actor/weights.bin", b"flipped bits")
    assert store.restore(tmp_path / "restore") == (2, {"by": "live", "step": 2})
    assert same_tree(tmp_path / "c" / "actor3", tmp_path / "restore" / "actor")


def test_a_fenced_out_writers_checkpoint_is_never_a_fallback(store_uri, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stalled holder's complete but uncommitted save of iteration 2 (its clock ahead): when the live holder's 3
    fails its checks, the resume falls back to 1, the previous committed checkpoint, never to the stalled 2."""
    store = open_store(store_uri)
    store.fence(OLD)
    store.save(1, make_parts(tmp_path / "a", 1), {"by": "stalled", "step": 1}, fence=OLD)
    stale = stale_save(store, store_uri, 2, make_parts(tmp_path / "b", 2), monkeypatch)
    third = key_of(store, store.save(3, make_parts(tmp_path / "c", 3), {"by": "live", "step": 3}, fence=NEW))
    overwrite_in_store(store_uri, f"{third}/critic/head.bin", None)
    said: list[str] = []
    assert store.restore(tmp_path / "restore", log=said.append) == (1, {"by": "stalled", "step": 1})
    assert store.list() == [1, 3] and not any(stale in line for line in said), said
    assert third in said[0] and said[-1].startswith("resuming from checkpoint iteration 1")


RESUME = """
import json, sys
from pathlib import Path
from components.storage.store import CheckpointStore
store = CheckpointStore.from_uri(sys.argv[1], s3_endpoint_url=sys.argv[2] or None)
store.fence(sys.argv[3])
iteration, state = store.restore(Path(sys.argv[4]))
print(json.dumps({"iteration": iteration, "state": state}))
"""


@pytest.mark.parametrize("layout", [pytest.param("file", marks=FAST), pytest.param("path", marks=FAST), "s3"])
def test_only_the_deployments_store_key_resumes_a_run_in_a_new_process(layout: str, request: pytest.FixtureRequest,
                                                                       tmp_path: Path) -> None:
    """A new attempt of the run (a new process with the deployment's store key) fences its store and resumes its last
    commit bit for bit, on local disk and S3; a process with another deployment's key is refused, naming
    latest.json."""
    store_uri = fresh_store(request, tmp_path, layout)
    store = open_store(store_uri)
    store.fence(OLD)
    store.save(1, make_parts(tmp_path / "a", 1), {"step": 1}, fence=OLD)
    parts = make_parts(tmp_path / "b", 2)
    store.save(2, parts, {"step": 2, "rng": [3, 4]}, fence=OLD)

    def resume(key: str, dest: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", RESUME, store_uri[0], store_uri[1] or "", NEW,
                               str(tmp_path / dest)], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO), "RLHF_STORE_KEY": key})

    stranger = resume("another-deployments-key-" + "x" * 16, "stranger")
    assert stranger.returncode != 0 and "latest.json fails its signature check" in stranger.stderr, stranger.stderr
    assert not (tmp_path / "stranger").exists()
    resumed = resume(os.environ["RLHF_STORE_KEY"], "resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout) == {"iteration": 2, "state": {"step": 2, "rng": [3, 4]}}
    assert same_tree(parts["actor"], tmp_path / "resumed" / "actor")
    assert same_tree(parts["critic"], tmp_path / "resumed" / "critic")
    store.save(3, make_parts(tmp_path / "c", 3), {"step": 3}, fence=NEW)  # the new attempt's fence holds
    assert store.list() == [1, 2, 3]
    with pytest.raises(LeaseLost):
        store.save(4, make_parts(tmp_path / "d", 4), {"step": 4}, fence=OLD)
