"""Where a model or a data set that a config field names is on this machine: the one resolver every job goes through
(RL's model.policy / reference / critic / reward, the SFT and reward-model stages' model, the pipeline's base_model,
eval's models; data.prompts, eval.prompts and the stages' data), in every process of a run.

    tiny/<name>           the embedded default shipped with the package (models/assets/tiny)
    a local path          a directory written by save_pretrained (data: a file or a folder)
    org/name              a hub id at a revision (model.revision, data.revision; None = main): its snapshot in the
                          Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), read with no network access
    s3://bucket/prefix    every object under the prefix (data: or the one object the URI names), fetched once per
                          machine into the cache directory (deploy.cache.dir), checked by digest, reused later

`resolve_model` / `resolve_data` return a `Resolved`: where the value came from, its local path, and its
`provenance`, a JSON record of what it is (the contract other code keys on, e.g. the pipeline's cache):

    source    'tiny' | 'local' | 'hub' | 's3' | 'builtin' | 'reasoning_gym'
    value     the field's value as given
    digest    sha256 over every file's relative path and the sha256 of its bytes (models/tiny_files.manifest_digest
              of file_digests): the same bytes give the same digest whatever the source; None for generated data
    hub       repo, repo_type ('model' | 'dataset'), revision (as asked, None = main), commit (the one it resolved to)
    s3        uri, etags ({relative name: the object's ETag})
    data      subset (a data set's configuration), when given

A digest is computed once per process and path (a hub file stored as a Git LFS blob is named by its sha256 already;
an s3 fetch records its files' digests as it checks them), so asking again is cheap.

Downloads (nothing downloads unless the deployment allows it):
- a hub id missing from the cache fails naming the field and the `hf download` command, unless
  deploy.cache.hub_downloads is true (the cluster's deployments: a cache on the volume the run's pods share): then one
  process downloads it under a lock in the cache (`.locks/rlhf/...`), the others wait and find it there. HF_HUB_OFFLINE=1
  forbids it whatever the deployment says.
- an s3:// source is fetched through the S3 transport of components/storage/s3.py (it registers itself here when
  imported: models/ speaks no transport, `register_remote`), into `<cache dir>/s3/<bucket>/<hash>-<name>/`: under an
  exclusive lock (a second process, or pod on a shared volume, waits and then reuses it), into a staging directory
  renamed into place once every file is checked (a crash leaves no half entry), each file checked against the digests
  stored beside the prefix (`<prefix>.sha256.json`, what a run writes beside its model) or its single-part ETag (MD5).
  A later run reuses the entry when the objects' ETags are unchanged and every file still has its size, mtime and,
  for a file whose size or mtime changed, its recorded sha256; otherwise it is fetched again.
- `fetch_file` brings one stored file (a run's reward file, `<run store>/rewards/<sha256>.py`) here by its digest.

The cache directory: deploy.cache.dir, else $RLHF_CACHE_DIR, else <HF_HOME>/rlhf-flows (HF_HOME: ~/.cache/huggingface
unless set; on the cluster /cache/huggingface, the pods' shared volume). Light: no torch import.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol

from models.deploy import DeployConfig
from models.tiny_files import embedded_model_path, is_embedded, manifest_digest

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # 'org/name' (or a legacy 'name')
# what a model download fetches: weights as safetensors, configs, tokenizer files, chat templates (no remote code)
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
CACHE_ENV = "RLHF_CACHE_DIR"
MARKER = ".rlhf-fetched.json"  # inside a fetched s3 entry: what was fetched and each file's digest


# ---------------------------------------------------------------- the record

@dataclass
class Resolved:
    """A model or data source on this machine: where it came from (`source`), its local `path` (a directory; data may
    be one file; None for builtin data) and what identifies it (`provenance`)."""

    value: str
    field: str
    source: str  # 'tiny' | 'local' | 'hub' | 's3' | 'builtin' | 'reasoning_gym'
    path: Optional[str]
    details: dict = dataclass_field(default_factory=dict)  # hub: repo, repo_type, revision, commit; s3: uri, etags
    known: Optional[dict[str, str]] = None  # file digests already checked (an s3 fetch), else computed on demand

    def files(self) -> dict[str, str]:
        """sha256 of every file, by path relative to `path` (a file: its own name)."""
        if self.path is None:
            return {}
        return dict(self.known) if self.known is not None else file_digests(self.path)

    @property
    def digest(self) -> Optional[str]:
        return manifest_digest(self.files()) if self.path is not None else None

    @property
    def provenance(self) -> dict:
        """What the source is, as JSON (the module docstring lists the keys)."""
        return {"source": self.source, "value": self.value, **self.details, "digest": self.digest}


# ---------------------------------------------------------------- models

def resolve_model(value: str, field: str = "model", revision: Optional[str] = None,
                  deploy: Optional[DeployConfig] = None) -> Resolved:
    """The local directory of a model field's value and its record (see the module docstring); a missing model
    raises FileNotFoundError naming `field` and how to get it. `deploy`: the deployment's cache and download
    settings (None: the defaults, offline)."""
    deploy = deploy or DeployConfig()
    if is_embedded(value):
        return Resolved(value, field, "tiny", str(embedded_model_path(value)))
    if value.startswith("s3://"):
        if revision:
            raise ValueError(f"{field}: '{value}' is an s3:// prefix; a revision ('{revision}') names a hub commit, "
                             f"branch or tag: leave it unset")
        return fetch_s3(value, field, deploy, prefix_only=True)
    path = Path(value).expanduser()
    if path.is_dir():
        return Resolved(value, field, "local", str(path.absolute()))
    if not looks_like_hub_id(value):
        raise FileNotFoundError(
            f"{field}: model path '{value}' does not exist (expected a directory saved with save_pretrained, a hub id "
            f"'org/name' in the Hugging Face cache, s3://bucket/prefix, or tiny/<name>, the embedded default)")
    return resolve_hub(value, field, revision, deploy, "model")


def model_path(value: str, field: str = "model", revision: Optional[str] = None,
               deploy: Optional[DeployConfig] = None) -> str:
    """`resolve_model(...).path`: what from_pretrained is given."""
    return resolve_model(value, field, revision, deploy).path


# ---------------------------------------------------------------- data

GENERATED = ("builtin:", "reasoning_gym:")  # data sources whose rows code makes (models/data.py, models/tasks)


def resolve_data(value: str, field: str = "data.prompts", revision: Optional[str] = None,
                 deploy: Optional[DeployConfig] = None, subset: Optional[str] = None) -> Resolved:
    """Where a data source is on this machine: `builtin:<task>` or `reasoning_gym:<task>` (no path: the rows are made
    by code), a local file or folder, s3://bucket/key (one object) or s3://bucket/prefix (a folder of files), or a hub
    data set id at `revision` (its snapshot in the hub cache, read as a local folder; `subset` picks its
    configuration). A missing one raises FileNotFoundError naming `field`."""
    deploy = deploy or DeployConfig()
    extra = {"subset": subset} if subset is not None else {}
    if value.startswith(GENERATED):  # rows made by code from the config: no path
        return Resolved(value, field, value.split(":", 1)[0], None, dict(extra))
    if value.startswith("s3://"):
        found = fetch_s3(value, field, deploy, prefix_only=False)
        found.details.update(extra)
        return found
    path = Path(value).expanduser()
    if path.exists():
        return Resolved(value, field, "local", str(path.absolute()), dict(extra))
    if not looks_like_hub_id(value) or Path(value).suffix in (".parquet", ".jsonl", ".json", ".csv", ".arrow", ".txt"):
        raise FileNotFoundError(f"{field}: '{value}' does not exist (a file, a folder, builtin:<task>, s3://bucket/key "
                                f"or a hub data set id)")
    found = resolve_hub(value, field, revision, deploy, "dataset")
    found.details.update(extra)
    return found


# ---------------------------------------------------------------- the Hugging Face cache

def looks_like_hub_id(value: str) -> bool:
    """Whether a value that is not a local path may name a hub repository (not a path: no leading '.', '/' or '~',
    at most one '/')."""
    return bool(HUB_ID.match(value)) and not value.endswith((".json", ".safetensors"))


def offline() -> bool:
    """Whether the hub is out of reach by configuration (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    return any(os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on")
               for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache as this process sees it now (HF_HUB_CACHE, else HF_HOME/hub, else the default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    return os.path.join(hf_home(), "hub")


def hf_home() -> str:
    return os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"))


def fetch_command(repo_id: str, revision: Optional[str] = None, client: str = "hf", repo_type: str = "model") -> str:
    """The command that puts `repo_id` into the cache where the hub is reachable (`client`: 'hf', or the older
    'huggingface-cli')."""
    return (f"{client} download {repo_id}" + (" --repo-type dataset" if repo_type == "dataset" else "")
            + (f" --revision {revision}" if revision else ""))


def resolve_hub(repo_id: str, field: str, revision: Optional[str], deploy: DeployConfig,
                repo_type: str = "model") -> Resolved:
    """The snapshot of `repo_id` at `revision` in the hub cache; downloaded into it first when the deployment allows
    it (one process at a time, the others wait on the lock and find it there)."""
    from huggingface_hub import snapshot_download  # only a hub id needs it (~0.3 s)
    from huggingface_hub.errors import LocalEntryNotFoundError  # as above

    cache = hub_cache_dir()

    def cached() -> Optional[str]:
        try:
            return snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                     local_files_only=True)
        except LocalEntryNotFoundError:
            return None

    path = cached()
    if path is None:
        refuse_download(repo_id, field, revision, deploy, repo_type, cache)
        lock = Path(cache) / ".locks" / "rlhf" / f"{repo_type}s--{repo_id.replace('/', '--')}--{revision or 'main'}.lock"
        with exclusive(lock):
            path = cached()  # another process (or pod) fetched it while we waited
            if path is None:
                try:  # the hub's progress bars show where the process keeps them (components/environment.quiet)
                    path = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache,
                                             allow_patterns=MODEL_FILES if repo_type == "model" else None)
                except Exception as exc:
                    at = f" at revision '{revision}'" if revision else ""
                    raise FileNotFoundError(
                        f"{field}: '{repo_id}'{at} is not in the Hugging Face cache ({cache}), and downloading it "
                        f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); fetch it "
                        f"with `{fetch_command(repo_id, revision, repo_type=repo_type)}`") from exc
    return Resolved(repo_id, field, "hub", str(path),
                    {"repo": repo_id, "repo_type": repo_type, "revision": revision, "commit": Path(path).name})


def refuse_download(repo_id: str, field: str, revision: Optional[str], deploy: DeployConfig, repo_type: str,
                    cache: str) -> None:
    """Raise, naming the field and the command that fetches it, unless this process may download `repo_id`."""
    at = f" at revision '{revision}'" if revision else ""
    how = (f"fetch it where the hub is reachable, into the cache this machine reads (HF_HUB_CACHE): "
           f"`{fetch_command(repo_id, revision, repo_type=repo_type)}` (older clients: "
           f"`{fetch_command(repo_id, revision, 'huggingface-cli', repo_type)}`)")
    what = "a local directory" if repo_type == "model" else "a local file or folder"
    if offline():
        raise FileNotFoundError(f"{field}: '{repo_id}'{at} is not in the Hugging Face cache ({cache}), and the hub is "
                                f"not reachable from here (HF_HUB_OFFLINE=1): {how}; or point {field} at {what}")
    if not deploy.cache.hub_downloads:
        raise FileNotFoundError(f"{field}: '{repo_id}'{at} is not in the Hugging Face cache ({cache}), and this "
                                f"deployment downloads nothing at run time (deploy.cache.hub_downloads=false): {how}; "
                                f"or point {field} at {what}")


# ---------------------------------------------------------------- s3:// sources

class Remote(Protocol):
    """The transport of a remote scheme (s3: components/storage/s3.py). Names are relative to the URI: an object's
    base name for a URI that names one object, the key below `<uri>/` for a prefix."""

    def objects(self, uri: str, prefix_only: bool) -> tuple[bool, dict[str, tuple[int, str]]]:
        """(whether `uri` is a prefix, {name: (size, ETag)}): the object `uri` names (unless `prefix_only`) under
        its base name, else every object under `<uri>/`; {} when there is none."""
        ...

    def digests(self, uri: str) -> Optional[dict[str, str]]:
        """{name: sha256} stored beside a prefix as `<uri>.sha256.json`; None without one."""
        ...

    def download(self, uri: str, name: str, local: Path) -> None:
        """Download the object `name` (as `objects` names it) of `uri` to the file `local`."""
        ...


REMOTES: dict[str, Callable[[Optional[str]], Remote]] = {}  # scheme -> factory(endpoint URL)


def register_remote(scheme: str, factory: Callable[[Optional[str]], Remote]) -> None:
    """Make `scheme://` sources fetchable in this process (components/storage/s3.py registers 's3' when imported)."""
    REMOTES[scheme] = factory


def remote(scheme: str, field: str, deploy: DeployConfig) -> Remote:
    if scheme not in REMOTES:
        raise RuntimeError(f"{field}: this process cannot reach {scheme}:// sources: the transport that fetches them "
                           f"(components/storage/s3.py) registers itself when imported, and nothing here imported it")
    return REMOTES[scheme](deploy.checkpoint.s3_endpoint_url)


def cache_root(deploy: Optional[DeployConfig] = None) -> Path:
    """Where s3:// models and data and a run's stored files are fetched on this machine (module docstring)."""
    configured = (deploy or DeployConfig()).cache.dir or os.environ.get(CACHE_ENV)
    return Path(configured).expanduser().absolute() if configured else Path(hf_home()) / "rlhf-flows"


def s3_entry(uri: str, deploy: Optional[DeployConfig] = None) -> Path:
    """The cache directory of an s3:// URI: <cache>/s3/<bucket>/<16 hex of the URI's sha256>-<its last name>."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    name = re.sub(r"[^\w.-]", "_", key.rstrip("/").rsplit("/", 1)[-1]) or "root"
    return cache_root(deploy) / "s3" / bucket / f"{hashlib.sha256(uri.rstrip('/').encode()).hexdigest()[:16]}-{name}"


def fetch_s3(uri: str, field: str, deploy: DeployConfig, prefix_only: bool) -> Resolved:
    """An s3:// source in this machine's cache (fetched once, checked, reused; module docstring)."""
    uri = uri.rstrip("/")
    transport = remote("s3", field, deploy)
    try:
        is_prefix, objects = transport.objects(uri, prefix_only)
    except Exception as exc:
        raise FileNotFoundError(f"{field}: cannot list '{uri}': {exc}") from exc
    if not objects:
        raise FileNotFoundError(f"{field}: nothing is stored at '{uri}' (no object under {uri}/)")
    entry = s3_entry(uri, deploy)
    marker = current_fetch(entry, uri, objects)
    if marker is None:
        with exclusive(entry.with_name(entry.name + ".lock")):
            marker = current_fetch(entry, uri, objects)  # fetched by another process while we waited
            if marker is None:
                marker = download_entry(transport, uri, objects, entry, field, is_prefix)
    path = entry if is_prefix else entry / next(iter(objects))
    return Resolved(uri, field, "s3", str(path),
                    {"uri": uri, "etags": {name: meta["etag"] for name, meta in marker["objects"].items()}},
                    known={name: meta["sha256"] for name, meta in marker["objects"].items()})


def current_fetch(entry: Path, uri: str, objects: dict[str, tuple[int, str]]) -> Optional[dict]:
    """The marker of a cache entry that still holds exactly `objects` (same names and ETags), every file with its
    size and, for a file whose size or mtime changed since it was checked, its sha256; None otherwise."""
    try:
        marker = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return None
    recorded = marker.get("objects", {})
    if marker.get("uri") != uri or {n: (m.get("size"), m.get("etag")) for n, m in recorded.items()} != \
            {n: (size, etag) for n, (size, etag) in objects.items()}:
        return None
    for name, meta in recorded.items():
        path = entry / name
        try:
            stat = path.stat()
        except OSError:
            return None
        if stat.st_size != meta["size"]:
            return None
        if stat.st_mtime_ns != meta.get("mtime_ns") and _sha256(path)[0] != meta["sha256"]:
            return None  # changed on disk since it was fetched: fetched again
    return marker


def download_entry(transport: Remote, uri: str, objects: dict[str, tuple[int, str]], entry: Path, field: str,
                   is_prefix: bool) -> dict:
    """Download `objects` (of the prefix `uri`, or the one object it names) into a staging directory beside `entry`,
    check every file, then rename it into place."""
    expected = transport.digests(uri) if is_prefix else None
    base = uri if is_prefix else uri.rsplit("/", 1)[0]  # what the objects' names are relative to
    staging = entry.with_name(f".{entry.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        record = {}
        for name, (size, etag) in sorted(objects.items()):
            local = inside(staging, name, uri, field)
            local.parent.mkdir(parents=True, exist_ok=True)
            transport.download(base, name, local)
            sha256, md5 = _sha256(local)
            where = f"{field}: '{uri}' ({name})"
            if local.stat().st_size != size:
                raise OSError(f"{where}: downloaded {local.stat().st_size} bytes, the store lists {size}")
            if expected is not None and name in expected and expected[name] != sha256:
                raise OSError(f"{where}: its sha256 {sha256} is not the one stored beside it ({expected[name]})")
            plain = etag.strip('"')
            if expected is None and re.fullmatch(r"[0-9a-f]{32}", plain) and plain != md5:
                raise OSError(f"{where}: its MD5 {md5} is not its ETag {plain}")
            record[name] = {"size": size, "etag": etag, "sha256": sha256, "mtime_ns": local.stat().st_mtime_ns}
        missing = sorted(set(expected or ()) - set(objects))
        if missing:
            raise OSError(f"{field}: '{uri}' lacks {missing[:5]}, which the digests stored beside it list")
        marker = {"uri": uri, "objects": record, "fetched_at": time.time()}
        (staging / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        trash = entry.with_name(f".{entry.name}.trash-{uuid.uuid4().hex[:8]}")
        if entry.exists():
            os.replace(entry, trash)  # an older version: out of the way first, removed once the new one is in place
        os.replace(staging, entry)
        shutil.rmtree(trash, ignore_errors=True)
        return marker
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch_file(uri: str, sha256: str, field: str, deploy: Optional[DeployConfig] = None) -> Path:
    """A stored file by its digest on this machine (a run's reward file): a local store's file as it is, an s3://
    object fetched once into <cache>/files/<sha256><suffix>; either is checked against `sha256` before it is used."""
    deploy = deploy or DeployConfig()
    if uri.startswith("file://") or "://" not in uri:
        path = Path(uri[len("file://"):] if uri.startswith("file://") else uri)
        if not path.is_file():
            raise FileNotFoundError(f"{field}: the run's stored copy '{uri}' does not exist on this machine")
        if _sha256(path)[0] != sha256:
            raise ValueError(f"{field}: the run's stored copy '{uri}' fails its sha256 check (expected {sha256})")
        return path
    local = cache_root(deploy) / "files" / f"{sha256}{Path(uri).suffix}"
    if local.is_file() and _sha256(local)[0] == sha256:
        return local
    transport = remote(uri.split("://", 1)[0], field, deploy)
    local.parent.mkdir(parents=True, exist_ok=True)
    staging = local.with_name(f".{local.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        parent, _, name = uri.rpartition("/")
        transport.download(parent, name, staging)
        if _sha256(staging)[0] != sha256:
            raise ValueError(f"{field}: the run's stored copy '{uri}' fails its sha256 check (expected {sha256})")
        os.replace(staging, local)
    except (OSError, RuntimeError) as exc:
        raise FileNotFoundError(f"{field}: cannot fetch the run's stored copy '{uri}': {exc}") from exc
    finally:
        staging.unlink(missing_ok=True)
    return local


# ---------------------------------------------------------------- digests, locks, paths

_DIGEST_MEMO: dict[str, tuple[tuple, dict[str, str]]] = {}  # path -> (its files' (name, size, mtime), digests)


def directory_digest(path: str | Path) -> str:
    """The digest of a local model directory's files (`Resolved.digest` of a local path)."""
    return manifest_digest(file_digests(path))


def file_digests(path: str | Path) -> dict[str, str]:
    """sha256 of every file under `path` (or of `path`, a file), memoized by each file's size and mtime; a hub
    snapshot's file that is a link to a Git LFS blob is named by its sha256 already and is not read."""
    root = Path(path)
    files = [(root.name, root)] if root.is_file() else sorted(
        (p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
    stats = [(name, p.stat()) for name, p in files]
    signature = tuple((name, s.st_size, s.st_mtime_ns) for name, s in stats)
    memo = _DIGEST_MEMO.get(str(root))
    if memo is not None and memo[0] == signature:
        return dict(memo[1])
    out = {}
    for name, path in files:
        target = os.path.realpath(path)
        blob = os.path.basename(target)
        lfs = path.is_symlink() and os.path.basename(os.path.dirname(target)) == "blobs" \
            and re.fullmatch(r"[0-9a-f]{64}", blob)
        out[name] = blob if lfs else _sha256(path)[0]
    _DIGEST_MEMO[str(root)] = (signature, out)
    return dict(out)


def _sha256(path: Path) -> tuple[str, str]:
    """(sha256, md5) of a file's bytes, read once."""
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            md5.update(chunk)
    return sha.hexdigest(), md5.hexdigest()


@contextlib.contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """An exclusive flock on `lock` while the block runs: processes (and, on a shared NFS/EFS volume, pods) take it
    in turn; the OS releases it if the holder dies."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def inside(root: Path, name: str, uri: str, field: str) -> Path:
    """root/name, refused when `name` would leave `root` (an object key with '..')."""
    target = (root / name).resolve()
    if root.resolve() not in target.parents:
        raise ValueError(f"{field}: '{uri}' holds an object named {name!r}, which would land outside the cache entry")
    return root / name
