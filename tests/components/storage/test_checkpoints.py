"""CheckpointStore against local disk and a real S3 endpoint (moto server)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import boto3
import pytest

from components.storage.checkpoints import CheckpointError, CheckpointStore

pytestmark = pytest.mark.fast  # no server, stack or second process: `make test-fast`

REPO = Path(__file__).resolve().parents[3]


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


@pytest.fixture(params=["file", "path", "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(uri, s3 endpoint or None) for a fresh store of each kind."""
    if request.param == "file":
        return (tmp_path / "store").as_uri(), None
    if request.param == "path":
        return str(tmp_path / "store"), None
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/exp1", endpoint


def open_store(store_uri: tuple[str, str | None], **kw) -> CheckpointStore:
    uri, endpoint = store_uri
    return CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint, **kw)


def local_root(uri: str) -> Path:
    return Path(unquote(urlparse(CheckpointStore.from_uri(uri).uri).path))


def overwrite_in_store(store_uri: tuple[str, str | None], key: str, data: bytes | None) -> None:
    """Replace (or delete, when data is None) one stored file behind the store's back."""
    uri, endpoint = store_uri
    if endpoint is None:
        path = local_root(uri) / key
        path.unlink() if data is None else path.write_bytes(data)
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

    assert uri == f"{store.uri}/iter_2"
    assert store.uri.startswith("s3://" if store_uri[1] else "file:///")
    assert store.list() == [1, 2] and store.latest() == 2
    assert json.loads(raw_keys_bytes(store_uri, "latest.json")) == {"iteration": 2, "path": "iter_2"}

    state = store.load(tmp_path / "out")
    assert state == {"step": 2, "nested": {"lr": 1e-5}}
    assert same_tree(parts2["actor"], tmp_path / "out" / "actor")
    assert same_tree(parts2["critic"], tmp_path / "out" / "critic")
    assert store.load(tmp_path / "old", iteration=1) == {"step": 1, "rng": [1, 2]}
    assert same_tree(parts1["actor"], tmp_path / "old" / "actor")

    manifest = json.loads(raw_keys_bytes(store_uri, "iter_2/state.json"))
    assert set(manifest["files"]) == {"actor/config.json", "actor/weights.bin", "actor/sub/notes.txt", "critic/head.bin"}
    assert manifest["iteration"] == 2 and manifest["created"]


def test_s3_multipart_forced_on_small_file(s3_bucket, tmp_path: Path) -> None:
    endpoint, bucket = s3_bucket
    store = CheckpointStore.from_uri(
        f"s3://{bucket}/mp", s3_endpoint_url=endpoint, multipart_threshold=1024 * 1024, multipart_chunksize=5 * 1024 * 1024
    )
    parts = make_parts(tmp_path / "src", 3, big=5 * 1024 * 1024 + 65_536)
    store.save(7, parts, {"ok": True})
    head = boto3.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key="mp/iter_7/actor/weights.bin")
    assert head["ETag"].strip('"').endswith("-2")  # a 2-part multipart upload
    assert store.load(tmp_path / "out") == {"ok": True}
    assert same_tree(parts["actor"], tmp_path / "out" / "actor")


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
from components.storage.checkpoints import CheckpointStore
uri, endpoint, actor = sys.argv[1], sys.argv[2] or None, Path(sys.argv[3])
store = CheckpointStore.from_uri(uri, s3_endpoint_url=endpoint)
store.save(2, {"actor": actor}, {"step": 2}, _after_file=lambda rel: os._exit(17))
"""


def test_interrupted_save_keeps_previous_checkpoint(store_uri, tmp_path: Path) -> None:
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
    assert any("iter_2" in k for k in keys), keys  # the crash left a partial upload behind
    assert "iter_2/state.json" not in keys

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
    store.save(4, make_parts(tmp_path / "src", 4), {"step": 4})
    overwrite_in_store(store_uri, "iter_4/actor/weights.bin", b"garbage")
    with pytest.raises(CheckpointError, match=r"actor/weights\.bin.*iter_4"):
        store.load(tmp_path / "out")

    store.save(5, make_parts(tmp_path / "src", 5), {"step": 5})
    overwrite_in_store(store_uri, "iter_5/critic/head.bin", None)
    with pytest.raises(CheckpointError, match=r"critic/head\.bin is missing .*iter_5"):
        store.load(tmp_path / "out5")


def test_prune_keeps_last_two_and_latest(store_uri, tmp_path: Path) -> None:
    store = open_store(store_uri)
    for n in range(1, 6):
        store.save(n, make_parts(tmp_path / f"src{n}", n, big=1000), {"step": n})
    assert store.prune(keep_last=2) == [1, 2, 3]
    assert store.list() == [4, 5] and store.latest() == 5
    tops = {k.split("/")[0] for k in raw_keys(store_uri)}
    assert tops == {"iter_4", "iter_5", "latest.json"}
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


def test_bad_uri_and_state_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="unsupported checkpoint URI"):
        CheckpointStore.from_uri("gs://bucket/x")
    store = CheckpointStore.from_uri(str(tmp_path / "s"))
    with pytest.raises(CheckpointError, match="not JSON-serialisable"):
        store.save(1, make_parts(tmp_path, 1, big=10), {"bad": object()})
    assert store.latest() is None and store.list() == []
