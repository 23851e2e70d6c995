"""The one lease: one holder at a time of a key in a store (components/storage/store.py, local or S3), for

- a run's name: `lease.json` at the root of the run's store, held from the moment its record opens until it closes
  (components/tracking/run.py): one writer per run name; a second run of the name is refused, naming the holder
  (host, pid, when it started, its flow run), and nothing of the live run is touched;
- a pipeline stage's build: `locks/<stage>-<key>` in the pipeline's checkpoint base (components/pipeline/cache.py):
  one builder, the others wait (`wait_s=None`) and then reuse what it built.

How a store holds one:
- local (`file://`, a path): an exclusive `flock` on `<key>.lock` beside the key, which the kernel releases when the
  holder's process ends however it ends (SIGKILL, OOM, a lost node with a local disk): no stale lease to wait out.
  The holder's description is the file `<key>`; one left by a process that is gone is taken over at once, and said.
- S3: the object `<key>`, created with a conditional put (If-None-Match: *) so that of two starting at once exactly
  one gets it, and renewed by a thread every `timeout_s / 3` with a conditional put on its own ETag (If-Match): a
  renewal never writes over another holder's lease. A lease not renewed for `timeout_s` by the server's own clock
  (LastModified against the answer's Date: no clock skew between machines matters) belongs to a holder that is gone:
  it is taken over with a conditional replace of the ETag seen (of two taking it over at once, one wins), and said. A
  holder whose renewal finds another ETag has lost its lease (it stalled past the timeout): `check()` then fails.
Release is conditional too: the local file is removed only while it names us, the S3 object deleted only while it
still has our ETag (If-Match).

`wait_s`: 0 refuses a held lease at once (RunLocked, naming the holder); None waits as long as it takes; N waits up to
N seconds; `waiting(holder)` is told once who holds it.

Fencing: a lease's `token` is its holder's id. A run's store commits `latest.json` only while that file names the
token of the run's lease (CheckpointStore.fence, at open; CheckpointStore.save(fence=token), conditionally on
latest.json's version): a holder that stalled past its lease's timeout and was taken over cannot move latest.json,
even when it wakes up between its own check and its commit.

A job on several nodes writes from another process than the one that took its lease: its controller holds the lease
(and fences the store with it) for all its attempts, and node group 0's rank 0 of each attempt writes the checkpoints
under it (`HeldLease`, whose token is the controller's): before each write it checks that the lease still names the
controller's holder id, and fails (LeaseLost) when it does not; its commits are fenced by the same token.
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
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

LEASE_KEY = "lease.json"  # a run's lease, at the root of its store
LOG = logging.getLogger("rlhf.lease")
_LAST_WORD = "; its store has one writer at a time: wait for it to end, or choose another run_name"


class RunLocked(RuntimeError):
    """Another live holder has the lease (for a run's name: another live run of the name)."""


class LeaseLost(RuntimeError):
    """This holder's lease was taken over (it stalled past the timeout): it must not write any more."""


@dataclass
class Holder:
    """Who holds a lease (written into it: what a refused or waiting process is told)."""

    name: str  # what is held: a run's name, a pipeline's stage build, a server of a run
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
            if not isinstance(data, dict):
                return None
            return Holder(**{k: v for k, v in data.items() if k in Holder.__dataclass_fields__})
        except (ValueError, TypeError):
            return None


def refused(what: str, where: str, holder: "Holder | None", extra: str = "", last_word: str = _LAST_WORD) -> RunLocked:
    who = holder.describe() if holder else "another process"
    return RunLocked(f"{what} is being written by {who}{extra} ({where}){last_word}")


class Lease:
    """A held lease: `check()` fails once it was taken over, `release()` gives it back (conditionally)."""

    holder: Holder
    where: str
    lost: Optional[str] = None

    @property
    def token(self) -> str:
        """The fencing token: the holder's id (what latest.json names while this lease may commit)."""
        return self.holder.id

    def check(self) -> None:
        """Raise LeaseLost when another holder took this lease over (this holder must not write any more)."""
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _Busy(Exception):
    """The lease is held by a live holder right now."""

    def __init__(self, holder: Holder | None, extra: str = ""):
        super().__init__(extra)
        self.holder, self.extra = holder, extra


def _waited(attempt: Callable[[], object], wait_s: float | None, poll_s: float,
            waiting: Callable[[Holder | None], None], refuse: Callable[[_Busy], RunLocked]):
    """`attempt()` until it does not raise _Busy: at once (wait_s=0), for up to wait_s seconds, or without end (None);
    `waiting(holder)` told once."""
    deadline = None if wait_s is None else time.monotonic() + wait_s
    told = False
    while True:
        try:
            return attempt()
        except _Busy as busy:
            if deadline is not None and time.monotonic() >= deadline:
                raise refuse(busy) from None
            if not told:
                told = True
                waiting(busy.holder)
            time.sleep(poll_s)


class FileLease(Lease):
    """The lease of a local store's key: an exclusive flock on `<key>.lock`, released by the kernel with its holder."""

    def __init__(self, root: Path, key: str, holder: Holder, log: Callable[[str], None] = LOG.warning,
                 wait_s: float | None = 0, poll_s: float = 1.0,
                 waiting: Callable[[Holder | None], None] = lambda h: None,
                 what: str | None = None, last_word: str = _LAST_WORD):
        self.path, self.holder, self.log = Path(root) / key, holder, log
        self.where = str(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(lock_path(self.path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _waited(self._try, wait_s, poll_s, waiting,
                    lambda busy: refused(what or f"{holder.name}", self.where, busy.holder, last_word=last_word))
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise
        previous = self._read()
        if previous is not None and previous.id != holder.id:
            self.log(f"{holder.name}: took over the lease of {previous.describe()}: that process is gone (it never "
                     f"released it)")
        self._write()

    def _try(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _Busy(self._read()) from None

    def _read(self) -> Holder | None:
        try:
            return Holder.parse(self.path.read_bytes())
        except OSError:
            return None

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps(asdict(self.holder)))
        os.replace(tmp, self.path)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            mine = self._read()
            if mine is not None and mine.id == self.holder.id:
                self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class S3Lease(Lease):
    """The lease of an S3 store's key: an object created with a conditional put, renewed on its own ETag by a thread,
    taken over after `timeout_s` without renewal."""

    def __init__(self, s3, key: str, holder: Holder, timeout_s: float = 60.0, log: Callable[[str], None] = LOG.warning,
                 wait_s: float | None = 0, poll_s: float = 1.0,
                 waiting: Callable[[Holder | None], None] = lambda h: None,
                 what: str | None = None, last_word: str = _LAST_WORD):
        self.s3, self.key, self.holder, self.timeout_s, self.log = s3, key, holder, timeout_s, log
        self.where = f"s3://{s3.location.bucket}/{s3._key(key)}"
        self.lost = None
        self.etag = _waited(self._try, wait_s, poll_s, waiting,
                            lambda busy: refused(what or holder.name, self.where, busy.holder, busy.extra, last_word))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name=f"lease-{key}")
        self._thread.start()

    def _body(self) -> bytes:
        self.holder.renewed = time.time()
        return json.dumps(asdict(self.holder)).encode()

    def _try(self) -> str:
        for _ in range(3):  # the object may vanish (released) between a failed create and our look at it
            etag = self.s3.put_if(self.key, self._body(), absent=True)
            if etag is not None:
                return etag
            found = self.s3.stat(self.key)
            if found is None:
                continue
            raw, seen, age = found
            holder = Holder.parse(raw)
            if age <= self.timeout_s:
                raise _Busy(holder, f", lease renewed {age:.0f}s ago (taken over only after {self.timeout_s:.0f}s "
                                    f"without renewal)")
            etag = self.s3.put_if(self.key, self._body(), etag=seen)
            if etag is None:  # another process took it over first
                raise _Busy(Holder.parse((self.s3.stat(self.key) or (b"",))[0]))
            self.log(f"{self.holder.name}: took over the lease of "
                     f"{holder.describe() if holder else 'an unreadable holder'}: not renewed for {age:.0f}s "
                     f"(> {self.timeout_s:.0f}s), its holder is gone")
            return etag
        raise _Busy(None, " (its lease keeps changing)")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.timeout_s / 3):
            try:
                etag = self.s3.put_if(self.key, self._body(), etag=self.etag)  # never over another holder's lease
            except Exception as exc:  # noqa: BLE001 - S3 hiccuped: the next renewal tries again (3 per timeout)
                LOG.warning("%s: renewing the lease failed (%s); retrying", self.holder.name, exc)
                continue
            if etag is None:
                found = self.s3.stat(self.key)
                other = Holder.parse(found[0]) if found else None
                self.lost = (f"{self.holder.name}: its lease {self.where} was taken over by "
                             f"{other.describe() if other else 'another holder'} (this one stalled past "
                             f"{self.timeout_s:.0f}s without renewing it); it writes nothing more")
                self.log(self.lost)
                return
            self.etag = etag

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        if not self.lost:
            self.s3.delete_if(self.key, self.etag)  # only while it is still ours


class HeldLease(Lease):
    """A lease held by another process of the same job (a multi-node run's controller): this process writes under it
    while the store's lease still names that holder (`holder_id`, also its fencing token); it neither renews nor
    releases it."""

    def __init__(self, store, run_name: str, holder_id: str):
        self.store, self.run_name, self.holder_id = store, run_name, holder_id
        self.holder = Holder(run_name, id=holder_id)
        self.where = f"{store.uri}/{LEASE_KEY}"
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


def lock_path(path: Path) -> Path:
    """The file a local lease's flock is held on: `.<name>.lock` beside the key."""
    return path.with_name(f".{path.name}.lock")


def acquire(store, name: str, key: str = LEASE_KEY, *, timeout_s: float = 60.0,
            log: Callable[[str], None] = LOG.warning, flow_run_id: Optional[str] = None, wait_s: float | None = 0,
            poll_s: float = 1.0, waiting: Callable[[Holder | None], None] = lambda holder: None,
            what: str | None = None, last_word: str = _LAST_WORD) -> Lease:
    """The lease of `key` in `store` (a CheckpointStore) for this process, held by `name` (what a refused or waiting
    process is told); RunLocked naming the live holder when it is held (after `wait_s`). `what`: how a refusal names
    what is held (a run: "run_name='x'")."""
    holder = Holder(name, flow_run_id=flow_run_id)
    if store.s3 is not None:
        return S3Lease(store.s3, key, holder, timeout_s, log, wait_s, poll_s, waiting, what, last_word)
    return FileLease(store.local_root, key, holder, log, wait_s, poll_s, waiting, what, last_word)


@contextmanager
def held(store, name: str, key: str, **options) -> Iterator[Lease]:
    """The lease of `key` (as `acquire`) while the block runs; released after it, whatever happened."""
    lease = acquire(store, name, key, **options)
    try:
        yield lease
    finally:
        lease.release()
