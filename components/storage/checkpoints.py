"""Checkpoint store on local disk (`file:///abs/dir` or a plain path) or S3 (`s3://bucket/prefix`).

Layout under the store root:
    iter_<N>/<part>/...      the part directories given to `save` (e.g. actor/, critic/)
    iter_<N>/state.json      {"iteration", "state", "files": {relpath: sha256}, "parts", "created"}
    latest.json              {"iteration": N, "path": "iter_<N>"}, written last

A checkpoint is complete once its state.json exists; latest.json only ever names a complete one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from components.storage.s3 import S3Location, S3Store

_ITER_RE = re.compile(r"^iter_(\d+)$")
_STAGING_RE = re.compile(r"^\.tmp-iter_(\d+)-[0-9a-f]+$")
_PART_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_DIGESTS = ".sha256.json"  # beside a put_dir key: {relpath: sha256}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or verified."""


class _Backend(Protocol):
    """Key/value primitives over a store root; keys are '/'-separated relative paths."""

    def put_file(self, local: Path, key: str) -> None: ...
    def get_file(self, key: str, local: Path) -> bool: ...
    def copy_file(self, source: str, target: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def delete_keys(self, keys: list[str]) -> None: ...
    def staging(self, key: str) -> str: ...
    def commit(self, staging: str, key: str) -> None: ...


class _LocalBackend:
    """Files under a root directory; directories appear atomically via a staging dir + os.replace."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put_file(self, local: Path, key: str) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)

    def get_file(self, key: str, local: Path) -> bool:
        source = self.root / key
        if not source.is_file():
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, local)
        return True

    def copy_file(self, source: str, target: str) -> None:
        self.put_file(self.root / source, target)

    def put_bytes(self, key: str, data: bytes) -> None:
        target = self.root / key
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def get_bytes(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None

    def list_keys(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self.root / prefix, ignore_errors=True)

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink(missing_ok=True)

    def staging(self, key: str) -> str:
        name = key.replace("/", "_")
        return f".tmp-{name}-{uuid.uuid4().hex}"

    def commit(self, staging: str, key: str) -> None:
        source, target = self.root / staging, self.root / key
        source.mkdir(parents=True, exist_ok=True)  # an empty upload still commits
        target.parent.mkdir(parents=True, exist_ok=True)
        trash = None
        if target.exists():
            trash = self.root / f".trash-{uuid.uuid4().hex}"
            os.replace(target, trash)
        os.replace(source, target)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


class _S3Backend:
    """Objects under s3://bucket/prefix; writes go straight to their final keys."""

    def __init__(self, s3: S3Store) -> None:
        self.s3 = s3

    def put_file(self, local: Path, key: str) -> None:
        self.s3.upload_file(local, key)

    def get_file(self, key: str, local: Path) -> bool:
        return self.s3.download_file(key, local)

    def copy_file(self, source: str, target: str) -> None:
        self.s3.copy_key(source, target)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.s3.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes | None:
        return self.s3.get_bytes(key)

    def list_keys(self, prefix: str) -> list[str]:
        return self.s3.list_keys(f"{prefix}/" if prefix else "")

    def delete_prefix(self, prefix: str) -> None:
        self.s3.delete_keys(self.list_keys(prefix))

    def delete_keys(self, keys: list[str]) -> None:
        self.s3.delete_keys(keys)

    def staging(self, key: str) -> str:
        return key

    def commit(self, staging: str, key: str) -> None:
        pass


@contextlib.contextmanager
def _file_lock(path: Path, body: bytes, waiting: Callable[[dict | None], None], poll_s: float) -> Iterator[None]:
    """An exclusive flock on `path` (created if needed), `body` written into it while held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    told = True
                    try:
                        waiting(json.loads(path.read_bytes() or b"null"))
                    except ValueError:
                        waiting(None)
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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

    def __init__(self, uri: str, backend: _Backend) -> None:
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
            return cls(location.uri, _S3Backend(s3))
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
            backend = _LocalBackend(root)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {root}: {exc}") from exc
        return cls(root.as_uri(), backend)

    def _checkpoint_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}"

    def save(
        self,
        iteration: int,
        parts: dict[str, Path],
        state: dict,
        *,
        stored: dict[str, str] | None = None,
        _after_file: Callable[[str], None] | None = None,
    ) -> str:
        """Upload `parts` to iter_<N>/<name>/, then state.json, then latest.json; return the checkpoint URI.

        `stored` names parts already in this store (written by `put_dir`, e.g. by a critic server on another node):
        name -> key. They are copied inside the store (server-side on S3) with the digests `put_dir` recorded, so
        the checkpoint is complete, and `latest` moves, only once every part is in place.
        `_after_file(relpath)` is called after each uploaded file (tests use it to simulate a crash).
        """
        stored = stored or {}
        if iteration < 0:
            raise CheckpointError(f"iteration must be >= 0, got {iteration}")
        for name in [*parts, *stored]:
            if not _PART_RE.match(name) or name in (".", "..", "state.json"):
                raise CheckpointError(f"invalid part name {name!r}")
        files = {name: _files_of(Path(local)) for name, local in parts.items()}
        key = f"iter_{iteration}"
        manifest: dict = {"iteration": iteration, "state": state, "files": {}, "parts": sorted(parts)}
        try:
            json.dumps(state)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint state is not JSON-serialisable: {exc}") from exc

        manifest["parts"] = sorted([*parts, *stored])
        adopted = {name: self._stored_digests(source) for name, source in stored.items()}
        staging = self._backend.staging(key)
        for name, entries in files.items():
            for path, rel in entries:
                relpath = f"{name}/{rel}"
                manifest["files"][relpath] = _sha256(path)
                self._backend.put_file(path, f"{staging}/{relpath}")
                if _after_file is not None:
                    _after_file(relpath)
        for name, source in stored.items():
            for rel, digest in adopted[name].items():
                self._backend.copy_file(f"{source}/{rel}", f"{staging}/{name}/{rel}")
                manifest["files"][f"{name}/{rel}"] = digest
        manifest["created"] = datetime.now(timezone.utc).isoformat()
        self._backend.put_bytes(f"{staging}/state.json", json.dumps(manifest, indent=1).encode())
        self._backend.commit(staging, key)
        pointer = {"iteration": iteration, "path": key}
        self._backend.put_bytes("latest.json", json.dumps(pointer).encode())
        return self._checkpoint_uri(key)

    def latest(self) -> int | None:
        """Iteration that latest.json points to, or None when the store has no checkpoint."""
        data = self._backend.get_bytes("latest.json")
        if data is None:
            return None
        try:
            return int(json.loads(data)["iteration"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"corrupt latest.json in {self.uri}: {exc}") from exc

    def _scan(self) -> tuple[set[int], dict[int, list[str]]]:
        """Complete iterations, and every top-level iter_/staging entry by iteration."""
        complete: set[int] = set()
        entries: dict[int, list[str]] = {}
        for key in self._backend.list_keys(""):
            top, _, rest = key.partition("/")
            match = _ITER_RE.match(top) or _STAGING_RE.match(top)
            if not match:
                continue
            n = int(match.group(1))
            if top not in entries.setdefault(n, []):
                entries[n].append(top)
            if rest == "state.json" and _ITER_RE.match(top):
                complete.add(n)
        return complete, entries

    def list(self) -> list[int]:
        """Iterations of complete checkpoints (those with a state.json), ascending."""
        return sorted(self._scan()[0])

    def load(self, dest: Path, iteration: int | None = None, parts: tuple[str, ...] | None = None) -> dict:
        """Download iter_<N> (latest by default) into dest/<part>/..., verify sha256s, return its state.

        `parts` limits the download to those parts (None: all)."""
        if iteration is None:
            iteration = self.latest()
            if iteration is None:
                raise CheckpointError(f"no checkpoint in {self.uri}")
        key = f"iter_{iteration}"
        where = self._checkpoint_uri(key)
        raw = self._backend.get_bytes(f"{key}/state.json")
        if raw is None:
            raise CheckpointError(f"checkpoint {where} is missing or incomplete (no state.json)")
        manifest = json.loads(raw)
        dest = Path(dest)
        wanted = [n for n in manifest.get("parts", []) if parts is None or n in parts]
        for name in wanted:
            (dest / name).mkdir(parents=True, exist_ok=True)
        for relpath, digest in manifest["files"].items():
            if relpath.split("/", 1)[0] not in wanted:
                continue
            local = dest / relpath
            if not self._backend.get_file(f"{key}/{relpath}", local):
                raise CheckpointError(f"file {relpath} is missing from checkpoint {where}")
            if _sha256(local) != digest:
                raise CheckpointError(f"file {relpath} of checkpoint {where} fails its sha256 check")
        return manifest["state"]

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
        """Delete all but the newest `keep_last` complete checkpoints and older incomplete ones.

        The checkpoint latest.json points to is always kept; incomplete entries newer than it
        (possibly a save in progress) are left alone. Returns the deleted iterations.
        """
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        latest = self.latest()
        complete, entries = self._scan()
        keep = set(sorted(complete)[-keep_last:])
        if latest is not None:
            keep.add(latest)
        newest_complete = max(keep, default=-1)
        deleted = []
        for n, tops in sorted(entries.items()):
            for top in tops:
                is_complete = n in complete and _ITER_RE.match(top)
                if (is_complete and n not in keep) or (not is_complete and n < newest_complete):
                    self._backend.delete_prefix(top)
                    if n not in deleted:
                        deleted.append(n)
        return deleted

    def put_dir(self, local: Path, key: str) -> str:
        """Store directory `local` under `key/` (replacing what was there), its sha256s in `key.sha256.json`
        (written last: a key without it is incomplete); return its URI."""
        key = self._check_key(key)
        entries = _files_of(Path(local))
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
        return json.loads(raw)

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

    # -- small records and one writer at a time (a pipeline's stage records and their build lock)
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

    def delete_all(self) -> None:
        """Delete everything in this store (its checkpoints, latest.json, stored directories and records)."""
        self._backend.delete_keys(self._backend.list_keys(""))
        if isinstance(self._backend, _LocalBackend):  # the directories the files were in
            for entry in self._backend.root.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)

    @contextlib.contextmanager
    def exclusive(self, key: str, owner: dict, waiting: Callable[[dict | None], None] = lambda _: None,
                  poll_s: float = 1.0, stale_s: float = 120.0) -> Iterator[None]:
        """Hold the lock `key` of this store while the block runs: one holder at a time, across processes and (on S3)
        machines; the others wait, polling every `poll_s` (`waiting(holder)` is called once, with what the holder
        wrote). Local: an flock on the file, released by the OS if the holder dies. S3: an object written with a
        conditional create, rewritten every stale_s / 4 while held; one not rewritten for `stale_s` (its holder
        died) is taken over with a conditional overwrite (only one waiter wins it)."""
        key = self._check_key(key)
        body = json.dumps(owner).encode()
        if isinstance(self._backend, _LocalBackend):
            with _file_lock(self._backend.root / key, body, waiting, poll_s):
                yield
            return
        s3 = self._backend.s3
        told = False
        while True:
            if s3.create_bytes(key, body):
                break
            seen = s3.head(key)
            if seen is not None and seen[1] > stale_s and s3.replace_bytes(key, body, seen[0]):
                break
            if not told:
                told = True
                waiting(self.get_json(key) if seen is not None else None)
            time.sleep(poll_s)
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(stale_s / 4):
                current = s3.head(key)
                if current is not None:
                    s3.replace_bytes(key, body, current[0])

        beat = threading.Thread(target=heartbeat, name=f"lock-{key}", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()
            self._backend.delete_keys([key])

    @staticmethod
    def _check_key(key: str) -> str:
        key = key.strip("/")
        parts = key.split("/")
        reserved = parts[0] == "latest.json" or _ITER_RE.match(parts[0]) or parts[0].startswith(".")
        if not key or any(p in ("", ".", "..") for p in parts) or reserved:
            raise CheckpointError(f"invalid store key {key!r}")
        return key
