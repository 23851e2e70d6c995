"""The two backends of a checkpoint store (components/storage/store.py): key/value primitives over a root, on local
disk (`file:///abs/dir` or a plain path) or S3 (`s3://bucket/prefix`).

Locally every file is fsynced, and small files and directories are replaced atomically (a temporary name, renamed,
and their directory fsynced): a power cut leaves the old version or the new one. On S3 writes go straight to their
final keys; a commit point is written with a conditional create.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from pathlib import Path
from typing import Protocol

from components.storage.s3 import S3Store


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or verified."""


class Backend(Protocol):
    """Key/value primitives over a store root; keys are '/'-separated relative paths."""

    def put_file(self, local: Path, key: str) -> None: ...
    def get_file(self, key: str, local: Path) -> bool: ...
    def copy_file(self, source: str, target: str) -> None: ...
    def put_bytes(self, key: str, data: bytes) -> None: ...
    def create_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes | None: ...
    def get_versioned(self, key: str) -> tuple[bytes | None, object]: ...
    def swap(self, key: str, data: bytes, version: object) -> bool: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def delete_keys(self, keys: list[str]) -> None: ...
    def staging(self, key: str) -> str: ...
    def commit(self, staging: str, key: str) -> None: ...


class LocalBackend:
    """Files under a root directory; every file fsynced, small files and directories replaced atomically (a temporary
    name + os.replace + an fsync of the directory). A key that would leave the root is refused."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if path != self.root and self.root not in path.parents:
            raise CheckpointError(f"store key {key!r} would leave the store at {self.root}")
        return path

    def put_file(self, local: Path, key: str) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)
        _fsync(target)

    def get_file(self, key: str, local: Path) -> bool:
        source = self._path(key)
        if not source.is_file():
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, local)
        return True

    def copy_file(self, source: str, target: str) -> None:
        self.put_file(self._path(source), target)

    def put_bytes(self, key: str, data: bytes) -> None:
        target, tmp = self._fsynced_beside(key, data)
        os.replace(tmp, target)
        _fsync_dir(target.parent)

    def _fsynced_beside(self, key: str, data: bytes) -> tuple[Path, Path]:
        """(the path of `key`, a temporary file beside it holding `data`, written and fsynced)."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return target, tmp

    def create_bytes(self, key: str, data: bytes) -> None:
        """Write `key` only if it does not exist (a hard link of a complete, fsynced file: all or nothing)."""
        target, tmp = self._fsynced_beside(key, data)
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise CheckpointError(f"{target} exists already: a checkpoint's commit point is written once") from None
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(target.parent)

    def get_bytes(self, key: str) -> bytes | None:
        path = self._path(key)
        return path.read_bytes() if path.is_file() else None

    def get_versioned(self, key: str) -> tuple[bytes | None, object]:
        """(the bytes of `key`, its version: the bytes themselves) for `swap`."""
        data = self.get_bytes(key)
        return data, data

    def swap(self, key: str, data: bytes, version: object) -> bool:
        """Replace `key` with `data` only if it still holds `version` (what get_versioned gave; None: absent), under
        an flock beside it, so two processes on this file system swap one at a time; False when it changed."""
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.with_name(f".{target.name}.swap"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.get_bytes(key) != version:
                return False
            self.put_bytes(key, data)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def list_keys(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)

    def delete_keys(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def staging(self, key: str) -> str:
        name = key.replace("/", "_")
        return f".tmp-{name}-{uuid.uuid4().hex}"

    def commit(self, staging: str, key: str) -> None:
        source, target = self._path(staging), self._path(key)
        source.mkdir(parents=True, exist_ok=True)  # an empty upload still commits
        target.parent.mkdir(parents=True, exist_ok=True)
        trash = None
        if target.exists():
            trash = self.root / f".trash-{uuid.uuid4().hex}"
            os.replace(target, trash)
        os.replace(source, target)
        _fsync_dir(target.parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class S3Backend:
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

    def create_bytes(self, key: str, data: bytes) -> None:
        """A conditional create (If-None-Match: *): the bucket policy refuses any other write of a commit point."""
        if self.s3.put_if(key, data, absent=True) is None:
            raise CheckpointError(f"s3://{self.s3.location.bucket}/{self.s3._key(key)} exists already: a checkpoint's "
                                  f"commit point is written once")

    def get_bytes(self, key: str) -> bytes | None:
        return self.s3.get_bytes(key)

    def get_versioned(self, key: str) -> tuple[bytes | None, object]:
        """(the bytes of `key`, its ETag) for `swap`."""
        found = self.s3.versioned(key)
        return (None, None) if found is None else found

    def swap(self, key: str, data: bytes, version: object) -> bool:
        """A conditional put: If-Match the ETag get_versioned gave (If-None-Match: * when it was absent); False
        when someone else wrote it since."""
        return self.s3.put_if(key, data, absent=version is None, etag=version) is not None

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

