"""Checkpoint store on local disk (`file:///abs/dir` or a plain path) or S3 (`s3://bucket/prefix`): saving, reading,
restoring and pruning checkpoints (the backends: components/storage/backends.py).

Layout under the store root:
    iter_<N>-<seq>-<id>/<part>/...  the part directories given to `save` (e.g. actor/, critic/), under a prefix of
                                    their own: <seq> is the store's sequence number the save started at, <id> random,
                                    so no save ever writes over another (a resumed run that saves iteration N again,
                                    an interrupted upload)
    iter_<N>-<seq>-<id>/state.json  {"iteration", "state", "files": {relpath: sha256}, "parts", "path", "created",
                                    "mac"}: written last, create-only, the checkpoint's commit point; a prefix without
                                    it is an incomplete save, never read
    latest.json                     {"seq", "fence", "iteration", "path", "checkpoints": [{"iteration", "path"}, ...],
                                    "mac"}: the committed sequence, oldest first; the last entry (also "iteration" and
                                    "path") is the latest checkpoint

Signed records: latest.json and every state.json carry a signature ("mac", components/storage/signing.py) with a key
the bucket does not reveal, and every read checks it. A latest.json or a manifest that fails it (written by another
run, another deployment, by hand, or by rlhf-flows before stores were signed) is refused naming the object and why
(ForeignCheckpoint): never resumed, never passed over for an older checkpoint. So is a missing latest.json in a store
that holds committed checkpoints: a run never starts over silently.

The store's own sequence orders the commits, never a writer's clock: latest.json moves only by a conditional write on
the version read (S3: If-Match on its ETag, If-None-Match: * when it is absent; locally a compare-and-swap under an
flock), each write adds 1 to `seq`, and the list of committed checkpoints is what that sequence committed. Saving
iteration N drops the entries of iterations >= N (a resumed run that saves them again replaces them). A restore's
fallback goes only to entries of that list, older ones first; a prune keeps the newest `keep_last` entries and
deletes a prefix only when the list names none of it and it was started before the record the pruner verified
(<seq> below its seq): a save that never committed, or one a fenced-out writer made.

One writer: a run's lease (components/storage/lease.py) fences its store when the run opens (`fence(token)`:
latest.json names the lease's token from then on), and every `save(..., fence=token)` and `prune(..., fence=token)`
moves latest.json only while it still names that token. A holder whose lease was taken over (it stalled, the next
holder fenced the store) fails with LeaseLost before its upload and again at its commit, and latest.json stays where
the new holder put it; its uploads are never listed, so they never become a fallback, and the live writer's prune
deletes them.

Locally every file is fsynced before state.json is written, and state.json and latest.json are written to a temporary
name, fsynced, renamed and their directory fsynced: a power cut leaves the previous checkpoint or the new one.

Reading: every file is checked against its sha256, and every path a state.json names must stay inside the directory
it is downloaded to (a manifest naming '../x' or an absolute path is refused naming it). `restore` starts from the
latest checkpoint and, when it fails its check (a corrupt or missing file, a missing or unreadable manifest), falls
back to the previous committed one and says so. Checkpoints hold no pickles: state.json is JSON, the parts are
safetensors, JSON and torch.load(weights_only=True) files (models/critic.py, models/loop.py).
"""

from __future__ import annotations

import functools
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
from components.storage.signing import Signer, store_key

LATEST = "latest.json"
_ITER_RE = re.compile(r"^iter_(\d+)-(\d+)-[0-9a-f]{8}$")  # iter_<N>-<seq>-<id>: a save's fresh prefix
_ANY_ITER_RE = re.compile(r"^iter_\d+")  # a checkpoint's prefix of any layout (reserved; never a store key)
_PART_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_DIGESTS = ".sha256.json"  # beside a put_dir key: {relpath: sha256}
_REFUSED = ("nothing is resumed from it. If it replaced this run's own, put its last good version back (S3 keeps the "
            "versions of a versioned bucket) or run under another run_name; if this process lacks the deployment's "
            "store key, see docs/security.md (signed stores)")


class CorruptCheckpoint(CheckpointError):
    """A committed checkpoint fails its checks (a file missing or not matching its sha256, a missing or unreadable
    manifest): a resume passes over it to the previous committed one. An error reaching the store (access denied,
    unreachable) is not one: it fails the run."""


class ForeignCheckpoint(CheckpointError):
    """latest.json or a manifest that this store did not sign (another run, another deployment, a hand, an earlier
    version), or no latest.json over committed checkpoints: refused naming it, never resumed and never passed over
    for an older checkpoint."""


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


def _record(seq: int, fence: str | None, checkpoints: list[dict]) -> dict:
    """The content of latest.json (unsigned): the committed checkpoints, the last one named on its own too."""
    last = checkpoints[-1] if checkpoints else {"iteration": None, "path": None}
    return {"seq": seq, "fence": fence, "iteration": last["iteration"], "path": last["path"],
            "checkpoints": checkpoints}


class CheckpointStore:
    """Versioned training checkpoints (`iter_<N>-<seq>-<id>/`) plus a signed `latest.json` (the module docstring)."""

    def __init__(self, uri: str, backend: Backend) -> None:
        self.uri = uri
        self._backend = backend

    @property
    def name(self) -> str:
        """The store's name, the last segment of its URI (a run's store: the run's name): what its signatures and its
        S3 credentials are bound to."""
        parsed = urlparse(self.uri)
        return parsed.path.rstrip("/").rsplit("/", 1)[-1] or parsed.netloc

    @functools.cached_property
    def signer(self) -> Signer:
        """What signs and checks this store's records: the run's key, from the deployment's store key (found when a
        record is first signed or checked: components/storage/signing.py)."""
        return Signer(store_key(), self.name)

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
        """Open a store; for S3 this probes the endpoint and bucket and fails fast, and its requests carry the
        credentials of its name (components/storage/s3.py: tagged_session)."""
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
                run=location.prefix.rsplit("/", 1)[-1] or location.bucket,
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

    # -- latest.json: the committed sequence
    def _read(self, first: bool = False) -> tuple[dict | None, object]:
        """(latest.json checked against its signature, its version for a conditional write); (None, None) when the
        store has none and no committed checkpoint (`first`: the first commit of a store nobody fenced, whose own
        state.json is there already). ForeignCheckpoint for one it did not sign, or none over committed
        checkpoints."""
        raw, version = self._backend.get_versioned(LATEST)
        where = self._checkpoint_uri(LATEST)
        if raw is None and first:
            return None, None
        if raw is None:
            committed = sorted({k.split("/", 1)[0] for k in self._backend.list_keys("")
                                if _ANY_ITER_RE.match(k) and k.endswith("/state.json")})
            if committed:
                raise ForeignCheckpoint(f"{where} is missing, while the store holds committed checkpoints "
                                        f"({', '.join(committed[-3:])}): refused rather than start the run over; "
                                        f"{_REFUSED}")
            return None, None
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise ForeignCheckpoint(f"{where} is not JSON ({exc}): refused; {_REFUSED}") from None
        why = self.signer.verify(record)
        if why is not None:
            raise ForeignCheckpoint(f"{where} fails its signature check ({why}): this store did not write it; "
                                    f"{_REFUSED}")
        return record, version

    def _commit(self, checkpoints: Callable[[dict | None], list[dict]], fence: str | None, what: str,
                check: bool = True) -> dict:
        """Write latest.json = the committed `checkpoints(record read)`, with the next `seq` and `fence`, by a
        conditional write on the version read; with `check`, only while it names `fence` (else LeaseLost)."""
        for _ in range(10):
            record, version = self._read(first=check and fence is None)
            if check:
                self._fenced(record, fence, what)
            new = self.signer.sign(_record((record["seq"] if record else 0) + 1, fence, checkpoints(record)))
            if self._backend.swap(LATEST, json.dumps(new, indent=1).encode(), version):
                return new
        raise CheckpointError(f"cannot commit {what} to {self.uri}: its latest.json keeps changing (another writer?)")

    def _fenced(self, record: dict | None, fence: str | None, what: str) -> None:
        """LeaseLost unless latest.json (`record`) names `fence` as its writer (a store nobody fenced: no fence)."""
        named = record.get("fence") if record is not None else None
        if record is None and fence is not None:
            raise LeaseLost(f"{self.uri}: latest.json is gone, so it no longer names this run's lease ({fence}): "
                            f"{what} is not committed")
        if named != fence:
            raise LeaseLost(f"{self.uri}: latest.json names another writer (lease {named}), not this one's ({fence}): "
                            f"this run's lease was taken over; {what} is not committed")

    def fence(self, token: str) -> None:
        """Make `token` (a lease's) the one writer whose saves move latest.json from now on: a holder before it, whose
        lease was taken over, cannot move it any more (the module docstring). A latest.json this store did not sign
        is refused here, before the run touches anything (ForeignCheckpoint)."""
        self._commit(lambda record: record["checkpoints"] if record else [], token, f"the fence of lease {token}",
                     check=False)

    def _committed(self) -> list[dict]:
        """The committed checkpoints ({"iteration", "path"}), oldest first."""
        record, _ = self._read()
        return list(record["checkpoints"]) if record is not None else []

    def latest(self) -> int | None:
        """Iteration of the latest committed checkpoint, None when the store has none."""
        committed = self._committed()
        return committed[-1]["iteration"] if committed else None

    def list(self) -> list[int]:
        """Iterations of the committed checkpoints, ascending."""
        return [entry["iteration"] for entry in self._committed()]

    def path_of(self, iteration: int | None = None) -> str:
        """The prefix of the committed checkpoint of `iteration` (the latest by default)."""
        return self._entry(iteration)["path"]

    def _entry(self, iteration: int | None) -> dict:
        """The committed checkpoint ({"iteration", "path"}) of `iteration` (the latest by default)."""
        committed = self._committed()
        if not committed:
            raise CheckpointError(f"no checkpoint in {self.uri}")
        found = committed[-1] if iteration is None else next(
            (entry for entry in committed if entry["iteration"] == iteration), None)
        if found is None:
            raise CheckpointError(f"{self.uri} has no committed checkpoint of iteration {iteration} (its checkpoints: "
                                  f"{[entry['iteration'] for entry in committed]})")
        return found

    # -- checkpoints
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
        """Upload `parts` to a fresh iter_<N>-<seq>-<id>/<name>/, then its signed state.json, then commit it to
        latest.json; return the checkpoint URI.

        `stored` names parts already in this store (written by `put_dir`, e.g. by a critic server on another node):
        name -> key. They are copied inside the store (server-side on S3) with the digests `put_dir` recorded, so
        the checkpoint is complete, and committed, only once every part is in place.
        `fence`: the writer's lease token; latest.json moves only while it names it (the module docstring), else
        LeaseLost, checked before the upload and at the commit.
        `_after_file(relpath)` is called after each uploaded file (tests use it to simulate a crash).
        """
        stored = stored or {}
        what = f"iteration {iteration}"
        record, _ = self._read()
        self._fenced(record, fence, what)
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
        key = fresh_prefix(iteration, record["seq"] if record is not None else 0)
        manifest: dict = {"iteration": iteration, "state": state, "files": {}, "parts": sorted([*parts, *stored]),
                          "path": key}
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
        manifest["created"] = datetime.now(timezone.utc).isoformat()  # for people: the sequence orders commits
        self._backend.create_bytes(f"{key}/state.json", json.dumps(self.signer.sign(manifest), indent=1).encode())
        entry = {"iteration": iteration, "path": key}
        self._commit(lambda record: [e for e in (record["checkpoints"] if record else []) if e["iteration"] < iteration]
                     + [entry], fence, f"{what} ({key})")
        return self._checkpoint_uri(key)

    def load(self, dest: Path, iteration: int | None = None, parts: tuple[str, ...] | None = None) -> dict:
        """Download the committed checkpoint of `iteration` (the latest by default) into dest/<part>/..., verify its
        signature and sha256s, return its state.

        `parts` limits the download to those parts (None: all). A path of the manifest that would land outside
        `dest` (absolute, '..', not under one of its parts) is refused before anything is written."""
        return self._load_key(Path(dest), self._entry(iteration), parts)

    def _load_key(self, dest: Path, entry: dict, parts: tuple[str, ...] | None) -> dict:
        key = entry["path"]
        where = self._checkpoint_uri(key)
        raw = self._backend.get_bytes(f"{key}/state.json")
        if raw is None:
            raise CorruptCheckpoint(f"checkpoint {where} is missing or incomplete (no state.json)")
        try:
            manifest = json.loads(raw)
            if not isinstance(manifest, dict):
                raise TypeError(f"a JSON {type(manifest).__name__}, not an object")
        except (ValueError, TypeError) as exc:
            raise CorruptCheckpoint(f"checkpoint {where} has an unreadable state.json "
                                    f"({type(exc).__name__}: {exc})") from None
        why = self.signer.verify(manifest)
        if why is None and (manifest.get("path"), manifest.get("iteration")) != (key, entry["iteration"]):
            why = f"it was signed for {manifest.get('path')!r}, iteration {manifest.get('iteration')!r}"
        if why is not None:
            raise ForeignCheckpoint(f"{where}/state.json fails its signature check ({why}): this store did not write "
                                    f"it there; {_REFUSED}")
        try:
            names, files, state = list(manifest.get("parts", [])), dict(manifest["files"]), manifest["state"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(f"checkpoint {where} has an unreadable state.json "
                                    f"({type(exc).__name__}: {exc})") from None
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
        """Download the latest committed checkpoint that passes its checks into `dest` (emptied first): the latest,
        else (a file fails its sha256 check, a file or its state.json is missing or unreadable: CorruptCheckpoint)
        the previous committed one, and so on, each fallback said through `log`; never a checkpoint latest.json does
        not list. Returns (iteration, state); None when the store has no checkpoint. Raises when checkpoints exist
        and none passes; at once on a record this store did not sign (ForeignCheckpoint) and on an error reaching the
        store (access denied, unreachable): never a reason to go back to an older checkpoint."""
        candidates = list(reversed(self._committed()))
        if not candidates:
            return None
        failures = []
        for entry in candidates:
            shutil.rmtree(dest, ignore_errors=True)
            try:
                state = self._load_key(Path(dest), entry, parts)
            except CorruptCheckpoint as exc:
                failures.append(str(exc))
                log(f"checkpoint {self._checkpoint_uri(entry['path'])} cannot be restored ({exc}); falling back to the "
                    f"previous committed checkpoint")
                continue
            except BaseException:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            if failures:
                log(f"resuming from checkpoint iteration {entry['iteration']} ({self._checkpoint_uri(entry['path'])}), "
                    f"the newest that passes its checks")
            return entry["iteration"], state
        shutil.rmtree(dest, ignore_errors=True)
        raise CorruptCheckpoint(f"no checkpoint of {self.uri} passes its checks: " + "; ".join(failures))

    def load_part(self, iteration: int, name: str, dest: Path) -> Path:
        """Replace directory `dest` with part `name` of the committed checkpoint of `iteration` (signature- and
        sha256-checked); the checkpoint must hold it."""
        scratch = Path(tempfile.mkdtemp(prefix=".restore-",
                                        dir=Path(dest).parent if Path(dest).parent.exists() else None))
        try:
            self.load(scratch, iteration, parts=(name,))
            if not (scratch / name).is_dir():
                raise CheckpointError(f"checkpoint {self._checkpoint_uri(self.path_of(iteration))} has no part "
                                      f"'{name}'")
            shutil.rmtree(dest, ignore_errors=True)
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(scratch / name), str(dest))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return Path(dest)

    def prune(self, keep_last: int, fence: str | None = None) -> list[int]:
        """Keep the newest `keep_last` committed checkpoints (latest.json is rewritten without the older ones, while
        it names `fence`, else LeaseLost), and delete every checkpoint prefix it does not list that was started
        before it (the module docstring): older committed ones, ones a newer save of their iteration replaced, saves
        that never committed, a fenced-out writer's. Returns the deleted iterations."""
        if keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
        record, _ = self._read()
        self._fenced(record, fence, "pruning")
        if record is None:
            return []
        if len(record["checkpoints"]) > keep_last:
            record = self._commit(lambda now: (now["checkpoints"] if now else [])[-keep_last:], fence, "pruning")
        listed = {entry["path"] for entry in record["checkpoints"]}
        deleted = []
        for top in sorted({key.split("/", 1)[0] for key in self._backend.list_keys("")}):
            match = _ITER_RE.match(top)
            if match is None or top in listed or int(match.group(2)) >= record["seq"]:
                continue
            self._backend.delete_prefix(top)
            deleted.append(int(match.group(1)))
        return sorted(set(deleted))

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
        reserved = parts[0] == LATEST or _ANY_ITER_RE.match(parts[0]) or parts[0].startswith(".")
        if not key or any(p in ("", ".", "..") for p in parts) or reserved:
            raise CheckpointError(f"invalid store key {key!r}")
        return key


def fresh_prefix(iteration: int, seq: int) -> str:
    """iter_<N>-<seq>-<random>: a prefix no save wrote before, marked with the store's sequence number its save started
    at (what a prune reads: the module docstring)."""
    return f"iter_{iteration}-{seq}-{secrets.token_hex(4)}"


def inside(dest: Path, relpath: str, parts: list[str], where: str) -> Path:
    """Where a manifest's `relpath` lands under `dest`; refused unless it is a relative path below one of the
    checkpoint's parts (no absolute path, no '..', nothing outside `dest`)."""
    pure = PurePosixPath(relpath) if isinstance(relpath, str) else None
    if (pure is None or not relpath or pure.is_absolute() or "\\" in relpath
            or any(p in ("", ".", "..") for p in relpath.split("/")) or len(pure.parts) < 2
            or pure.parts[0] not in parts):
        raise CorruptCheckpoint(f"checkpoint {where}: manifest path {relpath!r} is not a file below one of its parts "
                                f"{sorted(parts)}: refused (it would be written outside {dest})")
    target = (Path(dest) / relpath).resolve()
    if Path(dest).resolve() not in target.parents:
        raise CorruptCheckpoint(f"checkpoint {where}: manifest path {relpath!r} would be written outside {dest}: "
                                "refused")
    return Path(dest) / relpath
