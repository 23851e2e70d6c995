"""CheckpointStore against local disk and a real S3 endpoint (moto server): round trips, fresh prefixes per save with
state.json as the commit point, interrupted saves, corrupt checkpoints detected (and a resume falling back past
them), manifests that name paths outside their destination refused, pruning, put_dir."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import boto3
import pytest

from components.storage.backends import CheckpointError
from components.storage.store import CheckpointStore

FAST = pytest.mark.fast  # no server, stack or second process: `make test-fast` (the local stores; S3 starts moto)

REPO = Path(__file__).resolve().parents[3]
PREFIX = r"iter_{}-\d+-[0-9a-f]{{8}}"  # a save's fresh prefix: iter_<N>-<seq>-<id>


def key_of(store: CheckpointStore, uri: str) -> str:
    """The top-level prefix of a checkpoint URI `save` returned."""
    return uri[len(store.uri.rstrip("/")) + 1:]


def make_parts(root: Path, seed: int, big: int = 200_000) -> dict[str, Path]:
    """actor/ and critic/ directories with nested files whose bytes depend on `seed`."""
    actor, critic = root / f"actor{seed}", root / f"critic{seed}"
    (actor / "sub").mkdir(parents=True)
    critic.mkdir(parents=True)
    (actor / "config.json").write_text(json.dumps({"seed": seed}))
    (actor / "weights.bin").write_bytes(os.urandom(big))
    (actor / "sub" / "notes.txt").write_text(f"seed {seed}\n")
    (critic / "head.bin").write_bytes(os.urandom(1000 + seed))
    return {"actor": actor, "critic": critic}


def same_tree(a: Path, b: Path) -> bool:
    files_a = {p.relative_to(a): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    return bool(files_a) and files_a == files_b


@pytest.fixture(params=[pytest.param("file", marks=FAST), pytest.param("path", marks=FAST), "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(uri, s3 endpoint or None) for a fresh store of each kind (the local ones `fast`)."""
    return fresh_store(request, tmp_path)


@pytest.fixture(params=["file", "path", "s3"])
def crashing_store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """As store_uri, for a test that crashes a second process (never `fast`)."""
    return fresh_store(request, tmp_path)


def fresh_store(request: pytest.FixtureRequest, tmp_path: Path, layout: str | None = None) -> tuple[str, str | None]:
    """A fresh store of `layout` (the fixture's parameter by default): file, path or s3."""
    layout = layout or request.param
    if layout == "file":
        return (tmp_path / "store").as_uri(), None
    if layout == "path":
        return str(tmp_path / "store"), None
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/exp1", endpoint


def open_store(store_uri: tuple[str, str | None], **kw) -> CheckpointStore:
    uri, endpoint = store_uri
    return CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint, **kw)


def local_root(uri: str) -> Path:
    return Path(unquote(urlparse(CheckpointStore.from_uri(uri).uri).path))


def overwrite_in_store(store_uri: tuple[str, str | None], key: str, data: bytes | None) -> None:
    """Write (or delete, when data is None) one stored file behind the store's back."""
    uri, endpoint = store_uri
    if endpoint is None:
        path = local_root(uri) / key
        if data is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", endpoint_url=endpoint)
    if data is None:
        client.delete_object(Bucket=bucket, Key=f"{prefix}/{key}")
    else:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)


def raw_keys(store_uri: tuple[str, str | None]) -> list[str]:
    uri, endpoint = store_uri
    if endpoint is None:
        root = local_root(uri)
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    objects = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1 :] for o in objects.get("Contents", []))


def raw_keys_bytes(store_uri: tuple[str, str | None], key: str) -> bytes:
    uri, endpoint = store_uri
    if endpoint is None:
        return (local_root(uri) / key).read_bytes()
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def test_roundtrip(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    assert store.latest() is None and store.list() == []
    parts1, parts2 = make_parts(tmp_path / "src", 1), make_parts(tmp_path / "src", 2)
    store.save(1, parts1, {"step": 1, "rng": [1, 2]})
    uri = store.save(2, parts2, {"step": 2, "nested": {"lr": 1e-5}})

    key = key_of(store, uri)
    assert re.fullmatch(PREFIX.format(2), key), uri  # a prefix of its own
    assert store.uri.startswith("s3://" if store_uri[1] else "file:///")
    assert store.list() == [1, 2] and store.latest() == 2
    latest = json.loads(raw_keys_bytes(store_uri, "latest.json"))
    assert (latest["iteration"], latest["path"], latest["seq"], latest["fence"]) == (2, key, 2, None)
    assert [entry["iteration"] for entry in latest["checkpoints"]] == [1, 2] and len(latest["mac"]) == 64

    state = store.load(tmp_path / "out")
    assert state == {"step": 2, "nested": {"lr": 1e-5}}
    assert same_tree(parts2["actor"], tmp_path / "out" / "actor")
    assert same_tree(parts2["critic"], tmp_path / "out" / "critic")
    assert store.load(tmp_path / "old", iteration=1) == {"step": 1, "rng": [1, 2]}
    assert same_tree(parts1["actor"], tmp_path / "old" / "actor")

    manifest = json.loads(raw_keys_bytes(store_uri, f"{key}/state.json"))
    assert set(manifest["files"]) == {"actor/config.json", "actor/weights.bin", "actor/sub/notes.txt",
                                      "critic/head.bin"}
    assert manifest["iteration"] == 2 and manifest["path"] == key and manifest["created"] and len(manifest["mac"]) == 64


def test_s3_multipart_forced_on_small_file(s3_bucket, tmp_path: Path) -> None:
    endpoint, bucket = s3_bucket
    store = CheckpointStore.from_uri(
        f"s3://{bucket}/mp", s3_endpoint_url=endpoint, multipart_threshold=1024 * 1024, multipart_chunksize=5 * 1024
        * 1024
    )
    parts = make_parts(tmp_path / "src", 3, big=5 * 1024 * 1024 + 65_536)
    key = key_of(store, store.save(7, parts, {"ok": True}))
    head = boto3.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"mp/{key}/actor/weights.bin")
    assert head["ETag"].strip('"').endswith("-2")  # a 2-part multipart upload
    assert store.load(tmp_path / "out") == {"ok": True}
    assert same_tree(parts["actor"], tmp_path / "out" / "actor")


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
from components.storage.store import CheckpointStore
uri, endpoint, actor = sys.argv[1], sys.argv[2] or None, Path(sys.argv[3])
store = CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint)
store.save(2, {"actor": actor}, {"step": 2}, _after_file=lambda rel: os._exit(17))
"""


def test_interrupted_save_keeps_previous_checkpoint(crashing_store_uri, tmp_path: Path) -> None:
    store_uri = crashing_store_uri
    store = open_store(store_uri)
    parts1 = make_parts(tmp_path / "src", 1)
    store.save(1, parts1, {"step": 1})
    parts2 = make_parts(tmp_path / "src", 2, big=3_000_000)

    proc = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, store_uri[0], store_uri[1] or "", str(parts2["actor"])],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 17, proc.stderr
    keys = raw_keys(store_uri)
    assert any(k.startswith("iter_2-") for k in keys), keys  # the crash left a partial upload behind
    assert not any(k.startswith("iter_2-") and k.endswith("/state.json") for k in keys)

    assert store.latest() == 1 and store.list() == [1]
    assert store.load(tmp_path / "out") == {"step": 1}
    assert same_tree(parts1["actor"], tmp_path / "out" / "actor")

    # the next save succeeds, and pruning removes the old complete and the incomplete one
    store.save(3, make_parts(tmp_path / "src", 3), {"step": 3})
    assert store.prune(keep_last=1) == [1, 2]
    assert not any("iter_1" in k or "iter_2" in k for k in raw_keys(store_uri))
    assert store.list() == [3] and store.load(tmp_path / "out3") == {"step": 3}


def test_corrupt_or_missing_file_is_detected(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    key = key_of(store, store.save(4, make_parts(tmp_path / "src", 4), {"step": 4}))
    overwrite_in_store(store_uri, f"{key}/actor/weights.bin", b"garbage")
    with pytest.raises(CheckpointError, match=r"actor/weights\.bin.*iter_4"):
        store.load(tmp_path / "out")

    key = key_of(store, store.save(5, make_parts(tmp_path / "src", 5), {"step": 5}))
    overwrite_in_store(store_uri, f"{key}/critic/head.bin", None)
    with pytest.raises(CheckpointError, match=r"critic/head\.bin is missing .*iter_5"):
        store.load(tmp_path / "out5")


def test_prune_keeps_last_two_and_latest(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    for n in range(1, 6):
        store.save(n, make_parts(tmp_path / f"src{n}", n, big=1000), {"step": n})
    assert store.prune(keep_last=2) == [1, 2, 3]
    assert store.list() == [4, 5] and store.latest() == 5
    tops = {re.sub(r"-.*", "", k.split("/")[0]) for k in raw_keys(store_uri) if not k.startswith(".")}
    assert tops == {"iter_4", "iter_5", "latest.json"}  # (locally beside them: .latest.json.swap, latest.json's lock)
    assert store.load(tmp_path / "out") == {"step": 5}
    assert store.prune(keep_last=2) == []


def test_put_dir_and_get_dir_replace_contents(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    first = make_parts(tmp_path / "a", 1)["actor"]
    second = make_parts(tmp_path / "b", 2)["critic"]
    uri = store.put_dir(first, "critic_server/ckpt")
    assert uri == f"{store.uri}/critic_server/ckpt"
    store.put_dir(second, "critic_server/ckpt")  # replaces, leaving nothing of `first`
    store.get_dir("critic_server/ckpt", tmp_path / "got")
    assert same_tree(second, tmp_path / "got")
    assert store.list() == []  # generic keys are not checkpoints
    with pytest.raises(CheckpointError, match="nothing stored"):
        store.get_dir("absent", tmp_path / "none")


@FAST
def test_unreachable_endpoint_fails_fast(aws_env) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens there
    endpoint = f"http://127.0.0.1:{port}"
    with pytest.raises(CheckpointError, match=f"cannot reach S3 endpoint {endpoint}"):
        CheckpointStore.from_uri("s3://bucket/x", s3_endpoint_url=endpoint)


def test_missing_bucket_is_named(moto_endpoint: str, aws_env) -> None:
    with pytest.raises(CheckpointError, match=f"bucket 'no-such-bucket-1' does not exist at {moto_endpoint}"):
        CheckpointStore.from_uri("s3://no-such-bucket-1/x", s3_endpoint_url=moto_endpoint)


def test_endpoint_from_environment(s3_bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    endpoint, bucket = s3_bucket
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", endpoint)
    store = CheckpointStore.from_uri(f"s3://{bucket}/env")
    store.save(0, make_parts(tmp_path, 0, big=10), {})
    assert store.list() == [0]


@FAST
def test_bad_uri_and_state_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="unsupported checkpoint URI"):
        CheckpointStore.from_uri("gs://bucket/x")
    store = CheckpointStore.from_uri(str(tmp_path / "s"))
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        store.save(1, make_parts(tmp_path, 1, big=10), {"bad": object()})
    assert store.latest() is None and store.list() == []


def test_a_second_save_of_an_iteration_never_touches_the_first(store_uri, tmp_path: Path) -> None:
    """A resumed run that saves iteration N again writes a prefix of its own; the earlier save of N is whole (and
    read) until the new state.json and latest.json are written, then pruning drops it."""
    store = open_store(store_uri)
    first = key_of(store, store.save(3, make_parts(tmp_path / "a", 1), {"step": "first"}))
    before = {k: raw_keys_bytes(store_uri, k) for k in raw_keys(store_uri) if k.startswith(first)}
    second = key_of(store, store.save(3, make_parts(tmp_path / "b", 2), {"step": "second"}))
    assert second != first and re.fullmatch(PREFIX.format(3), second)
    assert {k: raw_keys_bytes(store_uri, k) for k in raw_keys(store_uri) if k.startswith(first)} == before
    assert store.list() == [3] and store.load(tmp_path / "out") == {"step": "second"}
    assert store.prune(keep_last=2) == [3]  # the replaced save of iteration 3
    assert not any(k.startswith(first) for k in raw_keys(store_uri))
    assert store.load(tmp_path / "again") == {"step": "second"}


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_good_one(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    oldest = key_of(store, store.save(1, make_parts(tmp_path / "a", 1), {"step": 1}))
    good = key_of(store, store.save(2, make_parts(tmp_path / "b", 2), {"step": 2}))
    bad = key_of(store, store.save(3, make_parts(tmp_path / "c", 3), {"step": 3}))
    overwrite_in_store(store_uri, f"{bad}/actor/weights.bin", b"flipped bits")
    said: list[str] = []
    assert store.restore(tmp_path / "restore", log=said.append) == (2, {"step": 2})
    assert same_tree(tmp_path / "b" / "actor2", tmp_path / "restore" / "actor")
    assert bad in said[0] and "fails its sha256 check" in said[0] and "falling back" in said[0]
    assert said[-1].startswith("resuming from checkpoint iteration 2") and good in said[-1]
    # nothing passes: refused, naming every failure (a run never starts over silently)
    overwrite_in_store(store_uri, f"{good}/critic/head.bin", None)
    overwrite_in_store(store_uri, f"{oldest}/state.json", b"[]")
    with pytest.raises(CheckpointError, match=r"no checkpoint of .* passes its checks: .*sha256.*missing.*unreadable"):
        store.restore(tmp_path / "restore")


def test_an_empty_store_restores_nothing(store_uri, tmp_path: Path) -> None:
    assert open_store(store_uri).restore(tmp_path / "restore") is None


@FAST
@pytest.mark.parametrize("relpath", ["../escaped.txt", "actor/../../escaped.txt", "{tmp}/escaped.txt", "actor",
                                     "unknown/escaped.txt", "actor//escaped.txt", "actor\\..\\..\\escaped.txt"])
def test_a_manifest_path_outside_its_destination_is_refused(tmp_path: Path, relpath: str) -> None:
    """A state.json that names a file outside the download directory, signed (a holder of the store key wrote it):
    refused naming the path, before anything is written."""
    relpath = relpath.format(tmp=tmp_path)
    store = CheckpointStore.from_uri(str(tmp_path / "store"))
    key = key_of(store, store.save(1, make_parts(tmp_path / "src", 1, big=10), {"step": 1}))
    manifest_path = tmp_path / "store" / key / "state.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][relpath] = manifest["files"]["actor/config.json"]
    manifest_path.write_text(json.dumps(store.signer.sign(manifest)))  # as a holder of the store key could
    dest = tmp_path / "deep" / "restore"
    with pytest.raises(CheckpointError, match=r"manifest path .* refused"):
        store.load(dest)
    assert sorted(p.name for p in tmp_path.rglob("escaped.txt")) == []
    assert not dest.exists() or not any(dest.rglob("*.json"))  # refused before any download


@FAST
def test_store_keys_never_leave_a_local_store(tmp_path: Path) -> None:
    store = CheckpointStore.from_uri(str(tmp_path / "store"))
    actor = make_parts(tmp_path / "src", 1, big=10)["actor"]
    for key in ("../outside", "a/../../outside", "latest.json", "iter_3/x", ".hidden/x"):
        with pytest.raises(CheckpointError, match="invalid store key"):
            store.put_dir(actor, key)
    assert not (tmp_path / "outside").exists()
    (tmp_path / "store" / "pending.sha256.json").write_text(json.dumps({"../../../outside.txt": "0" * 64}))
    (tmp_path / "store" / "pending").mkdir()
    with pytest.raises(CheckpointError, match="digests name a path outside it"):
        store.save(1, {}, {}, stored={"critic": "pending"})
