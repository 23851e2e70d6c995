"""One writer at a time over a checkpoint store (`CheckpointStore.exclusive`, components/storage/store.py): an flock
on a local store's file, a conditionally created and heartbeated object on S3."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from components.storage.s3 import S3Store


@contextlib.contextmanager
def file_lock(path: Path, body: bytes, waiting: Callable[[dict | None], None], poll_s: float) -> Iterator[None]:
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


@contextlib.contextmanager
def object_lock(s3: S3Store, key: str, body: bytes, waiting: Callable[[dict | None], None], poll_s: float,
                stale_s: float, holder: Callable[[], dict | None]) -> Iterator[None]:
    """The object `key` written with a conditional create (`body` in it), rewritten every stale_s / 4 while held and
    deleted on release; one not rewritten for `stale_s` (its holder died) is taken over with a conditional overwrite
    (only one waiter wins it). `waiting(holder())` is called once while waiting."""
    told = False
    while True:
        if s3.create_bytes(key, body):
            break
        seen = s3.head(key)
        if seen is not None and seen[1] > stale_s and s3.replace_bytes(key, body, seen[0]):
            break
        if not told:
            told = True
            waiting(holder() if seen is not None else None)
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
        s3.delete_keys([key])
