"""Checkpoint store on local disk (`file:///abs/dir` or a plain path) or S3 (`s3://bucket/prefix`): saving, reading,
restoring and pruning checkpoints (the backends: components/storage/backends.py).

Layout under the store root:
    iter_<N>-<id>/<part>/...   the part directories given to `save` (e.g. actor/, critic/), under a prefix of their
                               own: <id> is the save's UTC time and a random tag, so no save ever writes over another
                               (a resumed run that saves iteration N again, an interrupted upload)
    iter_<N>-<id>/state.json   {"iteration", "state", "files": {relpath: sha256}, "parts", "created"}: written last,
                               the commit point: a prefix without it is an incomplete save, never read
    latest.json                {"iteration": N, "path": "iter_<N>-<id>", "fence": token}: moved only after that
                               state.json exists, and (with a fence) only while it names the writer's lease
A store written before fresh prefixes (iter_<N>/) reads as before.

One writer: a run's lease (components/storage/lease.py) fences its store when the run opens (`fence(token)`: latest.json
names the lease's token from then on, {"iteration": null, ...} before a first checkpoint), and every `save(...,
fence=token)` moves latest.json with a conditional write on the version it read, only while it still names that
token. A holder whose lease was taken over (it stalled, the next holder fenced the store) fails with LeaseLost before
its upload and again at its commit, and latest.json stays where the new holder put it.

Locally every file is fsynced before state.json is written, and state.json and latest.json are written to a temporary
name, fsynced, renamed and their directory fsynced: a power cut leaves the previous checkpoint or the new one.

Reading: every file is checked against its sha256, and every path a state.json names must stay inside the directory
it is downloaded to (a manifest naming '../x' or an absolute path is refused naming it). `restore` starts from the
checkpoint latest.json names and, when it fails its check (a corrupt or missing file, an unreadable manifest),
falls back to the previous complete one and says so. Checkpoints hold no pickles: state.json is JSON, the parts are
safetensors, JSON and torch.load(weights_only=True) files (models/critic.py, models/loop.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from components.storage.backends import Backend, CheckpointError, LocalBackend, S3Backend
from components.storage.lease import LeaseLost
from components.storage.s3 import S3Location, S3Store

_ITER_RE = re.compile(r"^iter_(\d+)(?:-\d{8}T\d{12}Z-[0-9a-f]{4})?$")  # iter_<N> (before fresh prefixes) or iter_<N>-<id>
_STAGING_RE = re.compile(r"^\.tmp-iter_(\d+)-[0-9a-f]+$")
_PART_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_DIGESTS = ".sha256.json"  # beside a put_dir key: {relpath: sha256}


class CorruptCheckpoint(CheckpointError):
    """A checkpoint fails its checks (a file missing or not matching its sha256, an unreadable or unsafe manifest):
    a resume passes over it. An error reaching the store (access denied, unreachable) is not one: it fails the run."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files_of(local: Path) -> list[tuple[Path, str]]:
    """(absolute path, posix path relative to `local`) of every file below `local`, sorted."""
    if not local.is_dir():
        raise CheckpointError(f"{local} is not a directory")
    return sorted((p, p.relative_to(local).as_posix()) for p in local.rglob("*") if p.is_file())


class CheckpointStore:
    """Versioned training checkpoints (`iter_<N>/`) plus a `latest.json` pointer."""

    def __init__(self, uri: str, backend: Backend) -> None:
        self.uri = uri
        self._backend = backend

    @classmethod
    def from_uri(
        cls,
        uri: str,
        *,
        s3_endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
    ) -> CheckpointStore:
        """Open a store; for S3 this probes the endpoint and bucket and fails fast."""
        parsed = urlparse(uri)
        if parsed.scheme == "s3":
            location = S3Location.parse(uri)
            s3 = S3Store(
                location,
                endpoint_url=s3_endpoint_url,
                region=region,
                multipart_threshold=multipart_threshold,
                multipart_chunksize=multipart_chunksize,
                error=CheckpointError,
            )
            s3.probe()
            return cls(location.uri, S3Backend(s3))
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise CheckpointError(f"file URI must be file:///absolute/path, got {uri!r}")
            root = Path(parsed.path)
        elif parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
            root = Path(uri)
        else:
            raise CheckpointError(f"unsupported checkpoint URI {uri!r} (use file:///dir, a path or s3://bucket/prefix)")
        root = root.expanduser().resolve()
        try:
            backend = LocalBackend(root)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {root}: {exc}") from exc
        return cls(root.as_uri(), backend)

    @property
    def s3(self) -> S3Store | None:
        """The S3 prefix of an S3 store (None for a local one)."""
        return getattr(self._backend, "s3", None)

    @property
    def local_root(self) -> Path | None:
        """The directory of a local store (None for S3)."""
        return getattr(self._backend, "root", None)

    def _checkpoint_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    def save(
        self,
        iteration: int,
        parts: dict[str, Path],
        state: dict,
        *,
        stored: dict[str, str] | None = None,
        fence: str | None = None,
        _after_file: Callable[[str], None] | None = None,
    ) -> str:
        """Upload `parts` to a fresh iter_<N>-<id>/<name>/, then its state.json, then latest.json; return the
        checkpoint URI.

        `stored` names parts already in this store (written by `put_dir`, e.g. by a critic server on another node):
        name -> key. They are copied inside the store (server-side on S3) with the digests `put_dir` recorded, so
        the checkpoint is complete, and `latest` moves, only once every part is in place.
        `fence`: the writer's lease token; latest.json moves only while it names it (the module docstring), else
        LeaseLost, checked before the upload and at the commit.
        `_after_file(relpath)` is called after each uploaded file (tests use it to simulate a crash).
        """
        stored = stored or {}
        if fence is not None:
            self._fenced(self._backend.get_versioned("latest.json")[0], fence, f"iteration {iteration}")
        if iteration < 0:
            raise CheckpointError(f"iteration must be >= 0, got {iteration}")
        for name in [*parts, *stored]:
            if not _PART_RE.match(name) or name in (".", "..", "state.json"):
                raise CheckpointError(f"invalid part name {name!r}")
        files = {name: _files_of(Path(local)) for name, local in parts.items()}
        try:
            json.dumps(state)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint state is not JSON-serialisable: {exc}") from exc
        key = fresh_prefix(iteration)
        manifest: dict = {"iteration": iteration, "state": state, "files": {}, "parts": sorted([*parts, *stored])}
        adopted = {name: self._stored_digests(source) for name, source in stored.items()}
        for name, entries in files.items():
            for path, rel in entries:
                relpath = f"{name}/{rel}"
                manifest["files"][relpath] = _sha256(path)
                self._backend.put_file(path, f"{key}/{relpath}")
                if _after_file is not None:
                    _after_file(relpath)
        for name, source in stored.items():
            for rel, digest in adopted[name].items():
                self._backend.copy_file(f"{source}/{rel}", f"{key}/{name}/{rel}")
                manifest["files"][f"{name}/{rel}"] = digest
        manifest["created"] = datetime.now(timezone.utc).isoformat()
        self._backend.create_bytes(f"{key}/state.json", json.dumps(manifest, indent=1).encode())  # the commit point
        pointer = {"iteration": iteration, "path": key}
        if fence is None:
            self._backend.put_bytes("latest.json", json.dumps(pointer).encode())
        else:
            self._move_latest({**pointer, "fence": fence}, fence, f"iteration {iteration} ({key})")
        return self._checkpoint_uri(key)

    def fence(self, token: str) -> None:
        """Make `token` (a lease's) the one writer whose saves move latest.json from now on: a holder before it, whose
        lease was taken over, cannot move it any more (the module docstring)."""
        for _ in range(10):
            raw, version = self._backend.get_versioned("latest.json")
            try:
                current = self._pointer(raw)
            except CorruptCheckpoint:
                current = None  # an unreadable pointer: restore falls back to the newest complete checkpoint
            pointer = {"iteration": None, "path": None} if current is None else dict(current)
            if self._backend.swap("latest.json", json.dumps({**pointer, "fence": token}).encode(), version):
                return
        raise CheckpointError(f"cannot fence {self.uri}: its latest.json keeps changing (another writer?)")

    def _move_latest(self, pointer: dict, fence: str, what: str) -> None:
        """Write latest.json = `pointer` on the version read, while it names `fence`."""
        for _ in range(10):
            raw, version = self._backend.get_versioned("latest.json")
            self._fenced(raw, fence, what)
            if self._backend.swap("latest.json", json.dumps(pointer).encode(), version):
                return
        raise CheckpointError(f"cannot commit {what} to {self.uri}: its latest.json keeps changing")

    def _fenced(self, raw: bytes | None, fence: str, what: str) -> None:
        """LeaseLost unless latest.json (`raw`) names `fence` (or no writer yet)."""
        try:
            named = json.loads(raw).get("fence") if raw else None
        except (ValueError, AttributeError):
            named = None
        if named is not None and named != fence:
            raise LeaseLost(f"{self.uri}: latest.json names another writer (lease {named}), not this one's ({fence}): "
                            f"this run's lease was taken over; {what} is not committed")

    def _pointer(self, data: bytes | None | bool = False) -> dict | None:
        """latest.json ({"iteration", "path"}; read now unless its bytes are given), None when the store has no
        checkpoint yet (no latest.json, or a fenced one naming none)."""
        data = self._backend.get_bytes("latest.json") if data is False else data
        if data is None:
            return None
        try:
            pointer = json.loads(data)
            if pointer.get("iteration") is None and "fence" in pointer:
                return None  # fenced before its first checkpoint
            pointer = {"iteration": int(pointer["iteration"]), "path": str(pointer.get("path") or
                                                                         f"iter_{int(pointer['iteration'])}")}
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpoint(f"corrupt latest.json in {self.uri}: {exc}") from exc
        if not _ITER_RE.match(pointer["path"]):
            raise CorruptCheckpoint(f"corrupt latest.json in {self.uri}: path {pointer['path']!r} is not a checkpoint")
        return pointer

    def latest(self) -> int | None:
        """Iteration that latest.json points to, or None when the store has no checkpoint."""
        pointer = self._pointer()
        return None if pointer is None else pointer["iteration"]

    def _scan(self) -> list[tuple[int, str, bool]]:
        """(iteration, top-level prefix, complete) of every checkpoint prefix and leftover staging directory, in
        order: by iteration, then oldest first (a fresh prefix's id sorts by time)."""
        found: dict[str, list] = {}
        for key in self._backend.list_keys(""):
            top, _, rest = key.partition("/")
            match = _ITER_RE.match(top) or _STAGING_RE.match(top)
            if not match:
                continue
            entry = found.setdefault(top, [int(match.group(1)), top, False])
            if rest == "state.json" and _ITER_RE.match(top):
                entry[2] = True
        return sorted(tuple(e) for e in found.values())

    def _current(self, scan: list[tuple[int, str, bool]] | None = None) -> dict[int, str]:
        """The complete checkpoint of each iteration: the one latest.json names, else the newest saved."""
        scan = self._scan() if scan is None else scan
        try:
            pointer = self._pointer()
        except CorruptCheckpoint:
            pointer = None
        current = {n: top for n, top, complete in scan if complete}  # oldest first: the newest of an iteration wins
        if pointer is not None and (pointer["iteration"], pointer["path"], True) in scan:
            current[pointer["iteration"]] = pointer["path"]
        return current

    def list(self) -> list[int]:
        """Iterations of complete checkpoints (those with a state.json), ascending."""
        return sorted(self._current())

    def _key(self, iteration: int | None) -> tuple[int, str]:
        """(iteration, prefix) of iter_<N> (latest by default)."""
        if iteration is None:
            pointer = self._pointer()
            if pointer is None:
                raise CheckpointError(f"no checkpoint in {self.uri}")
            return pointer["iteration"], pointer["path"]
        key = self._current().get(iteration)
        if key is None:
            raise CheckpointError(f"checkpoint {self._checkpoint_uri(f'iter_{iteration}')} is missing or incomplete "
                                  f"(no state.json)")
        return iteration, key

    def load(self, dest: Path, iteration: int | None = None, parts: tuple[str, ...] | None = None) -> dict:
        """Download iter_<N> (latest by default) into dest/<part>/..., verify sha256s, return its state.

        `parts` limits the download to those parts (None: all). A path of the manifest that would land outside
        `dest` (absolute, '..', not under one of its parts) is refused before anything is written."""
        return self._load_key(Path(dest), self._key(iteration)[1], parts)

    def _load_key(self, dest: Path, key: str, parts: tuple[str, ...] | None) -> dict:
        where = self._checkpoint_uri(key)
        raw = self._backend.get_bytes(f"{key}/state.json")
        if raw is None:
            raise CorruptCheckpoint(f"checkpoint {where} is missing or incomplete (no state.json)")
        try:
            manifest = json.loads(raw)
            names, files, state = list(manifest.get("parts", [])), dict(manifest["files"]), manifest["state"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(f"checkpoint {where} has an unreadable state.json ({type(exc).__name__}: {exc})") from None
        for name in names:
            if not isinstance(name, str) or not _PART_RE.match(name) or name in (".", ".."):
                raise CorruptCheckpoint(f"checkpoint {where} names an invalid part {name!r}")
        wanted = [n for n in names if parts is None or n in parts]
        targets = {relpath: inside(dest, relpath, names, where) for relpath in files}
        for name in wanted:
            (dest / name).mkdir(parents=True, exist_ok=True)
        for relpath, digest in files.items():
            if relpath.split("/", 1)[0] not in wanted:
                continue
            local = targets[relpath]
            if not self._backend.get_file(f"{key}/{relpath}", local):
                raise CorruptCheckpoint(f"file {relpath} is missing from checkpoint {where}")
            if _sha256(local) != digest:
                raise CorruptCheckpoint(f"file {relpath} of checkpoint {where} fails its sha256 check")
        return state

    def restore(self, dest: Path, parts: tuple[str, ...] | None = None,
                log: Callable[[str], None] = lambda message: None) -> tuple[int, dict] | None:
        """Download the latest checkpoint that passes its checks into `dest` (emptied first): the one latest.json
        names, else (it fails its sha256 check, a file or its state.json is missing or unreadable: CorruptCheckpoint)
        the previous complete one, and so on, each fallback said through `log`. Returns (iteration, state); None
        when the store has no checkpoint. Raises when checkpoints exist and none passes, and at once on an error
        reaching the store (access denied, unreachable: never a reason to go back to an older checkpoint)."""
        try:
            pointer = self._pointer()
        except CorruptCheckpoint as exc:
            log(f"{exc}: looking for the newest complete checkpoint instead")
            pointer = None
        current = self._current()
        candidates = [(pointer["iteration"], pointer["path"])] if pointer is not None else []
        candidates += [(n, top) for n, top in sorted(current.items(), reverse=True)
                       if (n, top) not in candidates and (pointer is None or n <= pointer["iteration"])]
        if not candidates:
            return None
        failures = []
        for iteration, key in candidates:
            shutil.rmtree(dest, ignore_errors=True)
            try:
                state = self._load_key(Path(dest), key, parts)
            except CorruptCheckpoint as exc:
                failures.append(str(exc))
                log(f"checkpoint {self._checkpoint_uri(key)} cannot be restored ({exc}); falling back to the previous "
                    f"complete checkpoint")
                continue
            if failures:
                log(f"resuming from checkpoint iteration {iteration} ({self._checkpoint_uri(key)}), the newest that "
                    f"passes its checks")
            return iteration, state
        shutil.rmtree(dest, ignore_errors=True)
        raise CorruptCheckpoint(f"no checkpoint of {self.uri} passes its checks: " + "; ".join(failures))

    def load_part(self, iteration: int, name: str, dest: Path) -> Path:
        """Replace directory `dest` with part `name` of iter_<N> (sha256-checked); the checkpoint must hold it."""
        scratch = Path(tempfile.mkdtemp(prefix=".restore-", dir=Path(dest).parent if Path(dest).parent.exists() else None))
        try:
            self.load(scratch, iteration, parts=(name,))
            if not (scratch / name).is_dir():
                raise CheckpointError(f"checkpoint {self._checkpoint_uri(f'iter_{iteration}')} has no part '{name}'")
            shutil.rmtree(dest, ignore_errors=True)
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(scratch / name), str(dest))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return Path(dest)

    def prune(self, keep_last: int) -> list[int]:
        """Delete all but the newest `keep_last` complete checkpoints, complete ones an iteration's newer save
        replaced, and incomplete ones older than the newest kept.

        The checkpoint latest.json points to is always kept; incomplete entries newer than it
        (possibly a save in progress) are left alone. Returns the deleted iterations.
        """
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        latest = self.latest()
        scan = self._scan()
        current = self._current(scan)
        keep = set(sorted(current)[-keep_last:])
        if latest is not None:
            keep.add(latest)
        kept_tops = {current[n] for n in keep if n in current}
        newest_kept = max(keep, default=-1)
        deleted = []
        for n, top, complete in scan:
            if top in kept_tops or (not complete and n >= newest_kept):
                continue
            self._backend.delete_prefix(top)
            if n not in deleted:
                deleted.append(n)
        return sorted(deleted)

    def put_dir(self, local: Path, key: str) -> str:
        """Store directory `local` under `key/` (replacing what was there), its sha256s in `key.sha256.json`
        (written last: a key without it is incomplete; an earlier version's is removed first, so no reader ever
        takes new files for old digests or old files for new ones); return its URI."""
        key = self._check_key(key)
        entries = _files_of(Path(local))
        self._backend.delete_keys([f"{key}{_DIGESTS}"])
        staging = self._backend.staging(key)
        written, digests = set(), {}
        for path, rel in entries:
            digests[rel] = _sha256(path)
            self._backend.put_file(path, f"{staging}/{rel}")
            written.add(f"{key}/{rel}")
        self._backend.commit(staging, key)
        # S3 writes in place: drop objects left from an earlier version of this key
        self._backend.delete_keys([k for k in self._backend.list_keys(key) if k not in written])
        self._backend.put_bytes(f"{key}{_DIGESTS}", json.dumps(digests, indent=1).encode())
        return self._checkpoint_uri(key)

    def key_of(self, uri: str) -> str | None:
        """The key of a URI inside this store (as `put_dir` returns it), None for anything else (a local path)."""
        root = self.uri.rstrip("/") + "/"
        return uri[len(root):] if uri.startswith(root) else None

    def _stored_digests(self, key: str) -> dict[str, str]:
        raw = self._backend.get_bytes(f"{self._check_key(key)}{_DIGESTS}")
        if raw is None:
            raise CheckpointError(f"{self._checkpoint_uri(key)} is missing or incomplete (no {key}{_DIGESTS})")
        digests = json.loads(raw)
        for rel in digests:
            parts = PurePosixPath(rel).parts
            if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise CheckpointError(f"{self._checkpoint_uri(key)}: digests name a path outside it: {rel!r}")
        return digests

    def delete_dir(self, key: str) -> None:
        """Delete everything under `key/` and its digests."""
        key = self._check_key(key)
        self._backend.delete_prefix(key)
        self._backend.delete_keys([f"{key}{_DIGESTS}"])

    def get_dir(self, key: str, dest: Path) -> None:
        """Download everything under `key/` into `dest`."""
        key = self._check_key(key)
        keys = self._backend.list_keys(key)
        if not keys:
            raise CheckpointError(f"nothing stored under {self._checkpoint_uri(key)}")
        for k in keys:
            self._backend.get_file(k, Path(dest) / k[len(key) + 1 :])

    # -- small records (a pipeline's stage records)
    def get_json(self, key: str) -> dict | None:
        """The JSON object stored at `key`, None if there is none."""
        raw = self._backend.get_bytes(self._check_key(key))
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{self._checkpoint_uri(key)} is not valid JSON: {exc}") from exc

    def put_json(self, key: str, value: dict) -> str:
        """Store a JSON object at `key` (atomically replacing what was there); return its URI."""
        self._backend.put_bytes(self._check_key(key), json.dumps(value, indent=1, sort_keys=True).encode())
        return self._checkpoint_uri(key)

    def put_bytes(self, key: str, data: bytes) -> str:
        """Store `data` at `key` (atomically replacing what was there); return its URI."""
        self._backend.put_bytes(self._check_key(key), data)
        return self._checkpoint_uri(key)

    def delete_all(self) -> None:
        """Delete everything in this store (its checkpoints, latest.json, stored directories and records)."""
        self._backend.delete_keys(self._backend.list_keys(""))
        if isinstance(self._backend, LocalBackend):  # the directories the files were in
            for entry in self._backend.root.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)

    @staticmethod
    def _check_key(key: str) -> str:
        key = key.strip("/")
        parts = key.split("/")
        reserved = parts[0] == "latest.json" or _ITER_RE.match(parts[0]) or parts[0].startswith(".")
        if not key or any(p in ("", ".", "..") for p in parts) or reserved:
            raise CheckpointError(f"invalid store key {key!r}")
        return key


def fresh_prefix(iteration: int) -> str:
    """iter_<N>-<UTC time>-<random>: a prefix no save wrote before (sorts by time within an iteration)."""
    return f"iter_{iteration}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}Z-{secrets.token_hex(2)}"


def inside(dest: Path, relpath: str, parts: list[str], where: str) -> Path:
    """Where a manifest's `relpath` lands under `dest`; refused unless it is a relative path below one of the
    checkpoint's parts (no absolute path, no '..', nothing outside `dest`)."""
    pure = PurePosixPath(relpath) if isinstance(relpath, str) else None
    if (pure is None or not relpath or pure.is_absolute() or "\\" in relpath
            or any(p in ("", ".", "..") for p in relpath.split("/")) or len(pure.parts) < 2 or pure.parts[0] not in parts):
        raise CorruptCheckpoint(f"checkpoint {where}: manifest path {relpath!r} is not a file below one of its parts "
                                f"{sorted(parts)}: refused (it would be written outside {dest})")
    target = (Path(dest) / relpath).resolve()
    if Path(dest).resolve() not in target.parents:
        raise CorruptCheckpoint(f"checkpoint {where}: manifest path {relpath!r} would be written outside {dest}: refused")
    return Path(dest) / relpath
