"""One writer per run name: a lease on the run's checkpoint store, held from the moment the run's record opens until
it closes (components/tracking/run.py).

Two runs with the same `run_name` would otherwise share one store prefix, one local run directory and one MLflow run:
both write iter_<N> and latest.json, and the second would delete the first's live critic and restore directories.
The second run is refused instead, naming the holder (host, pid, when it started, its flow run), and nothing of the
live run is touched.

- A local store (`file://`, a path): an exclusive `flock` on <store>/.lease.lock, which the kernel releases when the
  holder's process ends however it ends (SIGKILL, OOM, a lost node with a local disk): no stale lease to wait out.
  The holder's description is in <store>/lease.json; a lease.json left by a process that is gone is taken over at
  once, and said.
- An S3 store: the object <prefix>/lease.json, created with a conditional put (If-None-Match: *) so that of two runs
  starting at once exactly one gets it, and renewed (If-Match: its ETag) by a thread every `timeout_s / 3`. A lease
  not renewed for `timeout_s` by the server's own clock (LastModified against the answer's Date: no clock skew
  between machines matters) belongs to a holder that is gone: it is taken over with a conditional replace of the
  ETag seen (of two runs taking it over at once, one wins), and said. A holder whose renewal finds another ETag has
  lost its lease (it stalled past the timeout): `check()` then fails its next checkpoint instead of writing over the
  new holder's.
Release deletes the lease (S3: only if it still has our ETag).

A run on several nodes writes from another process than the one that took its lease: its controller holds the lease
for all its attempts, and node group 0's rank 0 of each attempt writes the checkpoints under it (`HeldLease`): before
each write it checks that the lease still names the controller's holder id, and fails (LeaseLost) when it does not.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

LEASE_KEY = "lease.json"
LOCK_FILE = ".lease.lock"
LOG = logging.getLogger("rlhf.lease")


class RunLocked(RuntimeError):
    """Another live run holds the lease of this run name."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over (it stalled past the timeout): it must not write any more."""


@dataclass
class Holder:
    """Who holds a run's lease (written into the lease: what a refused run is told)."""

    run_name: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    flow_run_id: Optional[str] = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    renewed: float = 0.0

    def describe(self) -> str:
        flow = f", flow run {self.flow_run_id}" if self.flow_run_id else ""
        return f"pid {self.pid} on {self.host} (started {self.started}{flow})"

    @staticmethod
    def parse(raw: bytes | None) -> "Holder | None":
        try:
            data = json.loads(raw) if raw else None
            return Holder(**{k: v for k, v in data.items() if k in Holder.__dataclass_fields__}) if data else None
        except (ValueError, TypeError, AttributeError):
            return None


def refused(run_name: str, where: str, holder: "Holder | None", extra: str = "") -> RunLocked:
    who = holder.describe() if holder else "another process"
    return RunLocked(f"run_name={run_name!r} is being written by {who}{extra}; its store {where} has one writer at a "
                     f"time: wait for it to end, or choose another run_name")


class FileLease:
    """The lease of a local store: an exclusive flock, released by the kernel with its holder's process."""

    def __init__(self, root: Path, holder: Holder, log: Callable[[str], None] = LOG.warning):
        self.root, self.holder, self.log = Path(root), holder, log
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise refused(holder.run_name, str(self.root), self._read()) from None
        except BaseException:
            os.close(self._fd)
            raise
        previous = self._read()
        if previous is not None and previous.id != holder.id:
            self.log(f"run {holder.run_name}: took over the lease of {previous.describe()}: that process is gone "
                     f"(it never released it)")
        self._write()

    def _read(self) -> Holder | None:
        try:
            return Holder.parse((self.root / LEASE_KEY).read_bytes())
        except OSError:
            return None

    def _write(self) -> None:
        tmp = self.root / f".{LEASE_KEY}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(asdict(self.holder)))
        os.replace(tmp, self.root / LEASE_KEY)

    def check(self) -> None:
        """Nothing to lose: the kernel holds the lock for as long as this process lives."""

    def release(self) -> None:
        if self._fd is None:
            return
        (self.root / LEASE_KEY).unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class S3Lease:
    """The lease of an S3 store: an object created with a conditional put, renewed by a thread, taken over after
    `timeout_s` without renewal."""

    def __init__(self, s3, holder: Holder, timeout_s: float = 60.0, log: Callable[[str], None] = LOG.warning):
        self.s3, self.holder, self.timeout_s, self.log = s3, holder, timeout_s, log
        self.where = f"s3://{s3.location.bucket}/{s3._key(LEASE_KEY)}"
        self.lost: Optional[str] = None
        self.etag = self._acquire()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="run-lease")
        self._thread.start()

    def _body(self) -> bytes:
        self.holder.renewed = time.time()
        return json.dumps(asdict(self.holder)).encode()

    def _acquire(self) -> str:
        for _ in range(3):  # the object may vanish (released) between a failed create and our look at it
            etag = self.s3.put_if(LEASE_KEY, self._body(), absent=True)
            if etag is not None:
                return etag
            found = self.s3.stat(LEASE_KEY)
            if found is None:
                continue
            raw, seen, age = found
            holder = Holder.parse(raw)
            if age <= self.timeout_s:
                raise refused(self.holder.run_name, self.where, holder,
                              f", lease renewed {age:.0f}s ago (taken over only after {self.timeout_s:.0f}s without "
                              f"renewal)")
            etag = self.s3.put_if(LEASE_KEY, self._body(), etag=seen)
            if etag is None:  # another run took it over first
                raise refused(self.holder.run_name, self.where, Holder.parse((self.s3.stat(LEASE_KEY) or (b"",))[0]))
            self.log(f"run {self.holder.run_name}: took over the lease of "
                     f"{holder.describe() if holder else 'an unreadable holder'}: not renewed for {age:.0f}s "
                     f"(> {self.timeout_s:.0f}s), its holder is gone")
            return etag
        raise refused(self.holder.run_name, self.where, None, " (its lease keeps changing)")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timeout_s / 3):
            try:
                etag = self.s3.put_if(LEASE_KEY, self._body(), etag=self.etag)
            except Exception as exc:  # noqa: BLE001 - S3 hiccuped: the next renewal tries again (3 per timeout)
                LOG.warning("run %s: renewing the lease failed (%s); retrying", self.holder.run_name, exc)
                continue
            if etag is None:
                found = self.s3.stat(LEASE_KEY)
                other = Holder.parse(found[0]) if found else None
                self.lost = (f"run {self.holder.run_name}: its lease {self.where} was taken over by "
                             f"{other.describe() if other else 'another run'} (this run stalled past "
                             f"{self.timeout_s:.0f}s without renewing it); it writes nothing more")
                self.log(self.lost)
                return
            self.etag = etag

    def check(self) -> None:
        """Raise LeaseLost when another run took this run's lease over (this run must not write any more)."""
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if not self.lost:
            self.s3.delete_if(LEASE_KEY, self.etag)


class HeldLease:
    """A lease held by another process of the same run (a multi-node run's controller): this process writes under it
    while the store's lease still names that holder (`holder_id`); it neither renews nor releases it."""

    def __init__(self, store, run_name: str, holder_id: str):
        self.store, self.run_name, self.holder_id = store, run_name, holder_id
        self.check()

    def _holder(self) -> Holder | None:
        if self.store.s3 is not None:
            found = self.store.s3.stat(LEASE_KEY)
            return Holder.parse(found[0]) if found else None
        try:
            return Holder.parse((Path(self.store.local_root) / LEASE_KEY).read_bytes())
        except OSError:
            return None

    def check(self) -> None:
        """Raise LeaseLost unless the store's lease is the holder's this process writes for."""
        holder = self._holder()
        if holder is None or holder.id != self.holder_id:
            who = holder.describe() if holder else "nobody"
            raise LeaseLost(f"run {self.run_name}: its lease in {self.store.uri} is held by {who}, not by this run's "
                            f"controller (holder {self.holder_id}); it writes nothing more")

    def release(self) -> None:
        """Not ours to release: the holder does."""


def acquire(store, run_name: str, timeout_s: float = 60.0, log: Callable[[str], None] = LOG.warning,
            flow_run_id: Optional[str] = None):
    """The lease of `store` (a CheckpointStore) for this process, or RunLocked naming the live holder."""
    holder = Holder(run_name, flow_run_id=flow_run_id)
    s3 = store.s3
    if s3 is not None:
        return S3Lease(s3, holder, timeout_s, log)
    return FileLease(store.local_root, holder, log)
