"""Where a model or a data set that a config field names is on this machine: the one resolver of every job (RL's
model.policy / reference / critic / reward / teacher, the stages' model, the pipeline's base_model, eval's models;
data.prompts, eval.prompts and the stages' data), called once per job where it starts (`pin`).

    tiny/<name>           the embedded default shipped with the package (models/assets/tiny)
    a local path          a directory written by save_pretrained (data: a file or a folder)
    org/name              a hub id at a revision (model.revision, data.revision; None = main): its snapshot in the
                          Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), read with no network access
    s3://bucket/prefix    every object under the prefix (data: or the one object the URI names), fetched once per
                          machine into the cache directory (deploy.cache.dir), checked by digest, reused later

`resolve_model` / `resolve_data` return a pin (`Resolved`): the value as asked (its revision, subset, options), where
it came from, its local path, every file's sha256 and (size, mtime), and its `provenance`, a JSON record of what it
is (the contract other code keys on, e.g. the pipeline's cache):

    source    'tiny' | 'local' | 'hub' | 's3' | 'builtin' | 'reasoning_gym'
    value     the field's value as given
    digest    sha256 over every file's relative path and the sha256 of its bytes (models/tiny_files.manifest_digest
              of file_digests): the same bytes give the same digest whatever the source; None for generated data
    hub       repo, repo_type ('model' | 'dataset'), revision (as asked, None = main), commit (the one it resolved to)
    s3        uri, etags ({relative name: the object's ETag})
    data      subset (a data set's configuration), options (a generated one's), when given

Once per job: `pin(cfg)` resolves every source the config reads (`cfg.reads()`) into `Sources`, which the config
carries (`sources`) to every process of the job: the ranks (their config hand-off), the servers, the node groups of a
run on several nodes. They read the pinned paths (`cfg.local_path(field)`, `cfg.source(field)`) and resolve nothing:
a hub id stays at the commit it was pinned at even when its branch moves, and what the job records (its MLflow tags,
its summary, the pipeline's key) is what its processes load. Each use checks the pin cheaply: every file still has
its pinned size and mtime, or else its pinned sha256 (a file that changed fails naming the field). Where the pinned
path is not on a machine (a node without the job's shared cache), the pinned bytes are found there: the embedded
model in that package, a hub id at its pinned commit in that machine's cache, an s3:// source fetched into it, each
checked against the pinned digests. A digest is computed once per process and path (a hub file stored as a Git LFS
blob is named by its sha256 already; an s3 fetch records its files' digests as it checks them).

Downloads (nothing downloads unless the deployment allows it):
- a hub id missing from the cache fails naming the field and the `hf download` command, unless
  deploy.cache.hub_downloads is true (the cluster's deployments: a cache on the volume the run's pods share): then one
  process downloads it under a lock in the cache (`.locks/rlhf/...`), the others wait and find it there.
  HF_HUB_OFFLINE=1 forbids it whatever the deployment says.
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
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, NamedTuple, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field

from models.deploy import DeployConfig
from models.tiny_files import embedded_model_path, is_embedded, manifest_digest

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # 'org/name' (or a legacy 'name')
# what a model download fetches: weights as safetensors, configs, tokenizer files, chat templates (no remote code)
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
CACHE_ENV = "RLHF_CACHE_DIR"
MARKER = ".rlhf-fetched.json"  # inside a fetched s3 entry: what was fetched and each file's digest


# ---------------------------------------------------------------- the record

class Resolved(BaseModel):
    """One source pinned: the value a field gave, what it resolved to (`source`, hub commit or s3 ETags in `details`),
    its local `path` (a directory; data may be one file; None for generated data) and every file's sha256 and
    (size, mtime) when it was pinned. JSON: it travels in a job's config (`sources`) to every process of the job."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(description="The config field it was pinned for (named in its errors).")
    value: str = Field(description="The field's value as given.")
    revision: Optional[str] = Field(None, description="The hub branch, tag or commit asked for (None: main).")
    subset: Optional[str] = Field(None, description="The data set's configuration asked for.")
    options: Optional[dict] = Field(None, description="A generated data set's options (reasoning_gym:<task>).")
    source: Literal["tiny", "local", "hub", "s3", "builtin", "reasoning_gym"] = Field(
        description="Where it was found: the embedded models, a local path, the hub cache, s3, or code.")
    path: Optional[str] = Field(
        None, description="Its local directory or file where the job started (None: generated rows).")
    details: dict = Field(default_factory=dict, description="hub: repo, repo_type, revision, commit; s3: uri, etags.")
    files: dict[str, str] = Field(
        default_factory=dict, description="The sha256 of every file, by its path under `path`.")
    stats: dict[str, tuple[int, int]] = Field(
        default_factory=dict, description="The (size, mtime_ns) of every file when it was pinned.")

    @property
    def digest(self) -> Optional[str]:
        return manifest_digest(self.files) if self.path is not None else None

    @property
    def provenance(self) -> dict:
        """What the source is, as JSON (the module docstring lists the keys)."""
        asked = {key: value for key, value in (("subset", self.subset), ("options", self.options)) if value is not None}
        return {"source": self.source, "value": self.value, **self.details, **asked, "digest": self.digest}

    def asks(self, want: "Want") -> bool:
        """Whether this is the pin of what `want` asks for (its value at its revision, subset and options)."""
        return (self.value, self.revision, self.subset, self.options) == tuple(want)

    def here(self, deploy: Optional[DeployConfig] = None) -> "Resolved":
        """This pin as this machine has it: every file at `path` still has the size and mtime it was pinned with, or
        else its pinned sha256. Where `path` is not on this machine (another node without the job's shared cache), the
        pinned bytes are found here: tiny/ in this package, a hub id at its pinned commit in this machine's hub cache,
        an s3:// source fetched into its cache; checked file by file. A file that differs fails naming the field."""
        if self.path is None:
            return self
        path = Path(self.path)
        if path.exists():
            if not self._changed(path):
                return self
            return self._checked(path, "changed since the job pinned it")
        if self.source == "tiny":
            found = embedded_model_path(self.value)
        elif self.source == "hub":
            found = resolve_hub(self.details["repo"], self.field, self.details["commit"], deploy or DeployConfig(),
                                self.details["repo_type"]).path
        elif self.source == "s3":  # a prefix, or the one object a data field named (its name is the pinned path's)
            one = list(self.files) == [path.name]
            found = fetch_s3(self.details["uri"], self.field, deploy or DeployConfig(), prefix_only=not one).path
        else:
            raise FileNotFoundError(f"{self.field}: '{self.value}' was pinned at {self.path} where the job started, "
                                    f"and that path is not on this machine")
        return self._checked(Path(found), "is not what the job pinned where it started")

    def _changed(self, path: Path) -> bool:
        """Whether a file at `path` lacks its pinned size or mtime (a check by stat only)."""
        for name, pinned in self.stats.items():
            try:
                stat = (path if path.is_file() else path / name).stat()
            except OSError:
                return True
            if (stat.st_size, stat.st_mtime_ns) != tuple(pinned):
                return True
        return False

    def _checked(self, path: Path, why: str) -> "Resolved":
        """The pin at `path`, every pinned file's sha256 the pinned one (memoized per process, file size and mtime;
        files beside them, an s3 fetch's marker, are not the source's)."""
        found = {name: digest for name, digest in file_digests(path).items() if name in self.files}
        if found != self.files:
            differ = sorted(n for n in set(found) | set(self.files) if found.get(n) != self.files.get(n))
            raise ValueError(f"{self.field}: '{self.value}' at {path} {why}: {differ[:5]} differ (sha256); a job "
                             f"reads the bytes it pinned, and records them (models/resolve.py)")
        return self.model_copy(update={"path": str(path), "stats": _stats(path, found)})


def pinned(value: str, field: str, source: str, path: Optional[str | Path], details: Optional[dict] = None,
           revision: Optional[str] = None, subset: Optional[str] = None, known: Optional[dict[str, str]] = None,
           options: Optional[dict] = None) -> Resolved:
    """A source pinned at `path`: every file's sha256 (`known`: checked already, an s3 fetch's) and (size, mtime)."""
    files = {} if path is None else (dict(known) if known is not None else file_digests(path))
    return Resolved(field=field, value=value, revision=revision, subset=subset, options=options, source=source,
                    path=None if path is None else str(path), details=details or {}, files=files,
                    stats={} if path is None else _stats(Path(path), files))


def _stats(path: Path, files: dict[str, str]) -> dict[str, tuple[int, int]]:
    out = {}
    for name in files:
        stat = (path if path.is_file() else path / name).stat()
        out[name] = (stat.st_size, stat.st_mtime_ns)
    return out


class Want(NamedTuple):
    """What a job asks of one source: a field's value, at a hub revision, at a data set's configuration."""

    value: str
    revision: Optional[str] = None
    subset: Optional[str] = None
    options: Optional[dict] = None  # a generated data set's (reasoning_gym:<task>)


class Reads(NamedTuple):
    """Every source a job reads, by field (a job config's `reads()`): models, and data sets."""

    models: dict[str, Want]
    data: dict[str, Want]


class Sources(BaseModel):
    """Every source a job reads, pinned once where the job starts (`pin`), by field: its models and its data sets.
    The job's config carries it (`sources`) to its ranks and servers, which read the pinned paths (`local`) and
    resolve nothing; the job's records (its MLflow tags, summary and checkpoints' manifests; the provenance record
    a pipeline keys its stages on) are made from it."""

    model_config = ConfigDict(extra="forbid")

    models: dict[str, Resolved] = Field(default_factory=dict, description="The pin of every model field it reads.")
    data: dict[str, Resolved] = Field(default_factory=dict, description="The pin of every data field it reads.")

    def local(self, field: str, reads: Reads, deploy: Optional[DeployConfig] = None) -> Resolved:
        """The pin of `field` as this machine has it (`Resolved.here`); a field the job does not read, or whose pin
        is not of the value the config now gives, fails naming it (nothing is resolved here)."""
        for group in ("models", "data"):
            want = getattr(reads, group).get(field)
            if want is not None:
                found = getattr(self, group).get(field)
                if found is None or not found.asks(want):
                    raise RuntimeError(f"{field}: '{want.value}' is not pinned in the job's sources (every source a "
                                       f"job reads is pinned once where it starts: models/resolve.pin)")
                return found.here(deploy)
        raise KeyError(f"{field}: the job reads no such source; it reads "
                       f"{', '.join([*reads.models, *reads.data]) or 'none'}")


def pin(cfg, fields: Optional[Iterable[str]] = None):
    """`cfg` with `sources` holding a pin of every source it reads (`cfg.reads()`; `fields`: of those only, what a
    server started on its own loads), each resolved once: a field whose pin it carries already keeps it (checked on
    this machine: `Resolved.here`), a field that asks what another field's pin holds (the critic initialised from the
    policy) shares it, the rest are resolved here; pins of fields it does not read are dropped."""
    reads, have, deploy = cfg.reads(), cfg.sources, cfg.deploy
    out = {}
    for group, resolve in (("models", resolve_model), ("data", resolve_data)):
        pins, known = {}, list(getattr(have, group).values())
        for field, want in getattr(reads, group).items():
            if fields is not None and field not in fields:
                continue
            found = next((p for p in [getattr(have, group).get(field), *pins.values(), *known]
                          if p is not None and p.asks(want)), None)
            if found is not None:
                pins[field] = found.here(deploy).model_copy(update={"field": field})
            elif group == "models":
                pins[field] = resolve(want.value, field, want.revision, deploy)
            else:
                pins[field] = resolve(want.value, field, want.revision, deploy, want.subset, want.options)
        out[group] = pins
    return cfg.model_copy(update={"sources": Sources(**out)})


# ---------------------------------------------------------------- models

def resolve_model(value: str, field: str = "model", revision: Optional[str] = None,
                  deploy: Optional[DeployConfig] = None) -> Resolved:
    """The local directory of a model field's value and its record (see the module docstring); a missing model
    raises FileNotFoundError naming `field` and how to get it. `deploy`: the deployment's cache and download
    settings (None: the defaults, offline)."""
    deploy = deploy or DeployConfig()
    if is_embedded(value):
        return pinned(value, field, "tiny", embedded_model_path(value), revision=revision)
    if value.startswith("s3://"):
        if revision:
            raise ValueError(f"{field}: '{value}' is an s3:// prefix; a revision ('{revision}') names a hub commit, "
                             f"branch or tag: leave it unset")
        return fetch_s3(value, field, deploy, prefix_only=True)
    path = Path(value).expanduser()
    if path.is_dir():
        return pinned(value, field, "local", path.absolute(), revision=revision)
    if not looks_like_hub_id(value):
        raise FileNotFoundError(
            f"{field}: model path '{value}' does not exist (expected a directory saved with save_pretrained, a hub id "
            f"'org/name' in the Hugging Face cache, s3://bucket/prefix, or tiny/<name>, the embedded default)")
    return resolve_hub(value, field, revision, deploy, "model")


# ---------------------------------------------------------------- data

GENERATED = ("builtin:", "reasoning_gym:")  # data sources whose rows code makes (models/data.py, models/tasks)


def resolve_data(value: str, field: str = "data.prompts", revision: Optional[str] = None,
                 deploy: Optional[DeployConfig] = None, subset: Optional[str] = None,
                 options: Optional[dict] = None) -> Resolved:
    """Where a data source is on this machine: `builtin:<task>` or `reasoning_gym:<task>` (no path: the rows are made
    by code), a local file or folder, s3://bucket/key (one object) or s3://bucket/prefix (a folder of files), or a hub
    data set id at `revision` (its snapshot in the hub cache, read as a local folder; `subset` picks its
    configuration). A missing one raises FileNotFoundError naming `field`."""
    deploy = deploy or DeployConfig()
    if not value:
        raise ValueError(f"{field}: not set; name the rows (a local file or folder, s3://..., a hub data set id, or "
                         f"builtin:<task>: models/data.py)")
    if options and not value.startswith("reasoning_gym:"):
        raise ValueError(f"{field.rsplit('.', 1)[0]}.options: only a reasoning_gym:<task> source takes options; "
                         f"'{value}' takes none")
    if value.startswith(GENERATED):  # rows made by code from the config: no path
        return pinned(value, field, value.split(":", 1)[0], None, revision=revision, subset=subset, options=options)
    if value.startswith("s3://"):
        return fetch_s3(value, field, deploy, prefix_only=False, revision=revision, subset=subset)
    path = Path(value).expanduser()
    if path.exists():
        return pinned(value, field, "local", path.absolute(), revision=revision, subset=subset)
    if not looks_like_hub_id(value) or Path(value).suffix in (".parquet", ".jsonl", ".json", ".csv", ".arrow", ".txt"):
        raise FileNotFoundError(f"{field}: '{value}' does not exist (a file, a folder, builtin:<task>, s3://bucket/key "
                                f"or a hub data set id)")
    return resolve_hub(value, field, revision, deploy, "dataset", subset)


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
                repo_type: str = "model", subset: Optional[str] = None) -> Resolved:
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
        name = f"{repo_type}s--{repo_id.replace('/', '--')}--{revision or 'main'}.lock"
        lock = Path(cache) / ".locks" / "rlhf" / name
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
    return pinned(repo_id, field, "hub", path, {"repo": repo_id, "repo_type": repo_type, "revision": revision,
                                                "commit": Path(path).name}, revision, subset)


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


def fetch_s3(uri: str, field: str, deploy: DeployConfig, prefix_only: bool, revision: Optional[str] = None,
             subset: Optional[str] = None) -> Resolved:
    """An s3:// source in this machine's cache (fetched once, checked, reused; module docstring)."""
    value, uri = uri, uri.rstrip("/")
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
    return pinned(value, field, "s3", path,
                  {"uri": uri, "etags": {name: meta["etag"] for name, meta in marker["objects"].items()}},
                  revision, subset, known={name: meta["sha256"] for name, meta in marker["objects"].items()})


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
