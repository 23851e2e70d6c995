"""s3:// models and data (models/resolve.py, through the S3 transport of components/storage/s3.py) against a real S3
endpoint (moto's server): a model a run stored with CheckpointStore.put_dir (its files' sha256 beside it) is fetched
once into this machine's cache, checked against those digests, and reused by a later resolve without a download; a
cached file that was corrupted is caught by its digest and fetched again, as is an object that changed on S3; a
download that does not match the digests stored beside it is refused naming the field; two processes fetching the
same model at once download it once (the second waits on the first's lock); a data file or a folder of them on S3
reads as rows. A job's pin of an s3:// model is read by its processes without listing S3 again, and a newer fetch of
the prefix into the same cache entry is refused where the job reads its pin."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from components.storage import s3
from components.storage.store import CheckpointStore
from components.launch.processes import project_env
from models.config import RLHFConfig, preset
from models.data import read_rows
from models.deploy import DeployConfig
from models.resolve import MARKER, pin, resolve_data, resolve_model
from models.tiny_files import EMBEDDED_DIR

POLICY = EMBEDDED_DIR / "policy"


@pytest.fixture
def stored(s3_bucket, tmp_path):
    """The tiny policy stored on S3 as a run stores its model (put_dir: the files and `policy.sha256.json`), and
    a deployment whose cache is this test's."""
    endpoint, bucket = s3_bucket
    CheckpointStore.from_uri(f"s3://{bucket}/models", s3_endpoint_url=endpoint).put_dir(POLICY, "policy")
    deploy = DeployConfig(checkpoint={"s3_endpoint_url": endpoint}, cache={"dir": str(tmp_path / "cache")})
    return {"endpoint": endpoint, "bucket": bucket, "uri": f"s3://{bucket}/models/policy", "deploy": deploy,
            "client": boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")}


@pytest.fixture
def downloads(monkeypatch) -> list[str]:
    """The names S3Source downloads in this process."""
    seen, original = [], s3.S3Source.download

    def counted(self, uri, name, local):
        seen.append(name)
        return original(self, uri, name, local)

    monkeypatch.setattr(s3.S3Source, "download", counted)
    return seen


def test_a_model_on_s3_is_fetched_once_checked_and_reused(stored, downloads):
    found = resolve_model(stored["uri"], "model.policy", None, stored["deploy"])
    files = sorted(p.name for p in POLICY.iterdir())
    assert found.source == "s3" and Path(found.path).parent.parent == Path(stored["deploy"].cache.dir) / "s3"
    assert sorted(downloads) == files
    assert found.files == {name: sha256(POLICY / name) for name in files}  # checked: the bytes of the original
    assert found.digest == resolve_model("tiny/policy").digest  # the same bytes, the same digest
    listed = {o["Key"].rsplit("/", 1)[1]: o["ETag"] for o in
              stored["client"].list_objects_v2(Bucket=stored["bucket"], Prefix="models/policy/")["Contents"]}
    assert found.provenance["etags"] == listed and found.provenance["uri"] == stored["uri"]
    fetched = json.loads((Path(found.path) / MARKER).read_text())["fetched_at"]
    again = resolve_model(stored["uri"] + "/", "model.policy", None, stored["deploy"])  # a later run
    assert again.path == found.path and len(downloads) == len(files)  # nothing downloaded again
    assert json.loads((Path(found.path) / MARKER).read_text())["fetched_at"] == fetched


def test_a_corrupted_cached_file_and_a_changed_object_are_fetched_again(stored, downloads):
    found = resolve_model(stored["uri"], "model.policy", None, stored["deploy"])
    config = Path(found.path) / "config.json"
    config.write_bytes(config.read_bytes().replace(b"{", b"[", 1))  # the cache's copy corrupted in place
    assert resolve_model(stored["uri"], "model.policy", None, stored["deploy"]).files == found.files
    assert config.read_bytes() == (POLICY / "config.json").read_bytes() and downloads.count("config.json") == 2
    # the object changes on S3 (a new model stored over it, digests and all): its new ETag says so
    changed = json.loads((POLICY / "generation_config.json").read_text()) | {"note": "v2"}
    new = Path(found.path).parent / "v2"
    new.mkdir()
    for p in POLICY.iterdir():
        (new / p.name).write_bytes(p.read_bytes())
    (new / "generation_config.json").write_text(json.dumps(changed))
    CheckpointStore.from_uri(f"s3://{stored['bucket']}/models",
                             s3_endpoint_url=stored["endpoint"]).put_dir(new, "policy")
    refreshed = resolve_model(stored["uri"], "model.policy", None, stored["deploy"])
    assert json.loads((Path(refreshed.path) / "generation_config.json").read_text())["note"] == "v2"
    assert refreshed.digest != found.digest
    # an object whose bytes are not the ones the digests beside it name is refused, the cache left as it was
    stored["client"].put_object(Bucket=stored["bucket"], Key="models/policy/config.json", Body=b'{"tampered": 1}')
    with pytest.raises(OSError, match=r"^model.policy: 's3://.*/models/policy' \(config.json\): its sha256 .* is not "
                                      r"the one stored beside it"):
        resolve_model(stored["uri"], "model.policy", None, stored["deploy"])
    assert json.loads((Path(refreshed.path) / "generation_config.json").read_text())["note"] == "v2"


FETCH = """
import json, sys, time
from pathlib import Path
from components.storage import s3
from models.deploy import DeployConfig
from models.resolve import resolve_model

log, started, other, uri, endpoint, cache = sys.argv[1:]
original = s3.S3Source.download
def download(self, uri, name, local):
    with open(log, "a") as f:
        f.write(name + "\\n")
    while not Path(other).exists():  # hold the lock until the other process is on its way to it
        time.sleep(0.01)
    return original(self, uri, name, local)
s3.S3Source.download = download
Path(started).touch()
deploy = DeployConfig(checkpoint={"s3_endpoint_url": endpoint}, cache={"dir": cache})
found = resolve_model(uri, "model.policy", None, deploy)
print(json.dumps({"path": found.path, "digest": found.digest}))
"""


def test_two_processes_fetching_one_model_at_once_download_it_once(stored, tmp_path):
    """As two pods on one shared cache volume would: each waits for the other to be started before its first
    download goes on, so both are inside the resolver at once; the one that takes the entry's lock downloads, the
    other waits on it and reuses what it fetched."""
    log = tmp_path / "downloads.log"
    env = project_env({})
    args = [str(log), None, None, stored["uri"], stored["endpoint"], stored["deploy"].cache.dir]
    procs = []
    for me, other in (("a", "b"), ("b", "a")):
        argv = [sys.executable, "-c", FETCH, *args]
        argv[4:6] = [str(tmp_path / f"{me}.started"), str(tmp_path / f"{other}.started")]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert sorted(log.read_text().split()) == sorted(p.name for p in POLICY.iterdir())  # each file once


def test_data_on_s3_reads_as_rows_a_file_or_a_folder_of_files(stored):
    client, bucket = stored["client"], stored["bucket"]
    rows = [{"prompt": f"review the cat {i} :", "target": "cat"} for i in range(5)]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    client.put_object(Bucket=bucket, Key="data/one/prompts.jsonl", Body=body)
    client.put_object(Bucket=bucket, Key="data/splits/train.jsonl", Body=body)
    client.put_object(Bucket=bucket, Key="data/splits/test.jsonl", Body=body[:body.index(b"\n") + 1])
    found = resolve_data(f"s3://{bucket}/data/one/prompts.jsonl", "data.prompts", deploy=stored["deploy"])
    assert read_rows(found, "train").to_list() == rows
    assert found.files == {"prompts.jsonl": hashlib.sha256(body).hexdigest()}  # the digest a run records
    assert found.provenance["etags"] == {"prompts.jsonl": f'"{hashlib.md5(body).hexdigest()}"'}
    splits = resolve_data(f"s3://{bucket}/data/splits", "eval.prompts", deploy=stored["deploy"])
    assert read_rows(splits, "test").to_list() == rows[:1]
    with pytest.raises(FileNotFoundError, match=r"^data.prompts: nothing is stored at 's3://.*/data/none'"):
        resolve_data(f"s3://{bucket}/data/none", "data.prompts", deploy=stored["deploy"])


def test_a_pinned_s3_model_is_read_without_listing_s3_and_a_newer_fetch_under_it_is_refused(stored, monkeypatch):
    """A run's config as its ranks and servers receive it carries the pin: they read the fetched files without
    listing the prefix. Another job that fetches a newer model stored over the prefix into the same cache entry
    replaces its files; the run's next read of its pin fails naming the field instead of loading other bytes than it
    recorded."""
    deploy = stored["deploy"]
    cfg = pin(preset("tiny", **{"model.policy": stored["uri"], "deploy": deploy.model_dump()}))
    listings, original = [], s3.S3Source.objects
    monkeypatch.setattr(s3.S3Source, "objects", lambda self, *a, **k: listings.append(a) or original(self, *a, **k))
    received = RLHFConfig.model_validate_json(cfg.model_dump_json())
    path = received.local_path("model.policy")
    assert Path(path).parent.parent == Path(deploy.cache.dir) / "s3" and listings == []
    assert received.source("model.policy").digest == resolve_model("tiny/policy").digest
    newer = Path(deploy.cache.dir).parent / "newer"
    newer.mkdir()
    for p in POLICY.iterdir():
        (newer / p.name).write_bytes(p.read_bytes())
    (newer / "config.json").write_text((POLICY / "config.json").read_text().replace("{", '{"note": "newer", ', 1))
    CheckpointStore.from_uri(f"s3://{stored['bucket']}/models",
                             s3_endpoint_url=stored["endpoint"]).put_dir(newer, "policy")
    assert resolve_model(stored["uri"], "model.policy", None, deploy).path == path  # the other job's fetch
    with pytest.raises(ValueError, match=r"^model.policy: 's3://.*' at .* changed since the job pinned it: "
                                         r"\['config.json'\]"):
        received.local_path("model.policy")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
