"""Rendezvous that admit only the run's own processes: the store a torch.distributed group meets through, and the
proof every member gives once the group has formed. Used by the actor's and a critic server's ranks (models/
distributed.py) and by both ends of the `dist` weight transfer (components/serving/rollout/: the trainer's rank 0
and the rollout server's workers), so it imports nothing of the project: torch and the standard library only.

torch.distributed's TCPStore and gloo are "for trusted networks only" (torch's own security note): the store
answers whoever connects (set, get, list_keys, delete), and gloo's pairs connect to whatever address the store names.
So here:
- the store's master listens on the one address it serves (`listening_socket`: loopback for ranks on one machine,
  the pod's address on a cluster), never on every interface as TCPStore alone would;
- every key lives under a prefix derived from the run's secret (`SignedStore`): a process using torch's standard
  rendezvous on the same port (default keys) never meets the group, and cannot disturb it;
- every value carries an HMAC of its key and bytes under the run's secret: a value written by anyone else (a rank's
  gloo address, an NCCL id) is not believed: it is read again until a signed one appears, and refused after the
  store's timeout, naming the key. A stranger can read the keys (TCPStore has `list_keys`) but can substitute none;
- once the group has formed, every member proves that it holds the run's secret (`prove`): all members' random
  nonces are gathered, then an HMAC of them, the group's size and the member's rank, and every member checks every
  other's. A member that fails (a process that reached a gloo pair's listener first, say) fails the group on every
  member, naming its rank, before any payload is exchanged.
What this does not do: encrypt. The store's values (the members' addresses) can be read by whoever reaches the
store, and the tensors travel in the clear: the network between the members (loopback, a pod network restricted by
NetworkPolicies) is where confidentiality comes from. A stranger who reaches the port can still make a group fail
(delete keys, hold connections): it fails within the store's or the collective's timeout, saying why.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import socket
import time

import torch
import torch.distributed as dist

DIGEST = 32  # bytes of an HMAC-SHA256 tag
CONTEXT = b"rlhf-flows rendezvous v1 "


class RendezvousRefused(RuntimeError):
    """A member of a group did not prove the run's secret, or the store holds a value nobody of the run signed."""


def derived(secret: str, purpose: str) -> bytes:
    """A key for one purpose, derived from the run's secret (the secret itself is never used twice)."""
    return hmac.new(secret.encode(), CONTEXT + purpose.encode(), hashlib.sha256).digest()


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A socket listening on `host` alone (a name resolves to its first address) on `port` (0: a free one): a
    TCPStore master takes it (`master_listen_fd`); TCPStore by itself would listen on every interface."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port} for the rendezvous: {exc.strerror or exc}") from None
    return sock


class SignedStore(dist.Store):
    """A store (a TCPStore) whose keys are under a prefix derived from the run's secret and whose values carry an
    HMAC-SHA256 of (key, value) under a key derived from it. `get` believes signed values only: a value without a
    valid tag is read again until a signed one replaces it, for at most `timeout`, then refused naming the key.
    Counters (`add`) are not signed: the groups here never read a counter back as a value."""

    def __init__(self, store: dist.Store, secret: str, timeout: datetime.timedelta, poll_s: float = 0.05):
        super().__init__()
        prefix = derived(secret, "store prefix").hex()[:32]
        self._store = dist.PrefixStore(f"rlhf-{prefix}", store)
        self._key = derived(secret, "store values")
        self._timeout, self._poll_s = timeout, poll_s

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._store.set(key, self._tag(key, value) + value)

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            raw = bytes(self._store.get(key))  # waits for the key, up to the store's timeout
            tag, value = raw[:DIGEST], raw[DIGEST:]
            if len(raw) >= DIGEST and hmac.compare_digest(tag, self._tag(key, value)):
                return value
            if time.monotonic() > deadline:
                raise RendezvousRefused(f"rendezvous key {key!r}: its value is not signed with the run's secret "
                                        f"(a process that is not this run's wrote it), and no signed value "
                                        f"replaced it within {self._timeout.total_seconds():.0f}s")
            time.sleep(self._poll_s)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout
        self._store.set_timeout(timeout)


def open_store(host: str, port: int, world_size: int, master: bool, secret: str,
               timeout: datetime.timedelta) -> tuple[SignedStore, int]:
    """The group's store and its port: its master (`master`) listening on `host` alone at `port` (0: a free one), or
    a client of it. Nobody waits for a count of connections (a stranger's connection would count): the group's own
    rendezvous waits for its members' keys."""
    if master:
        listener = listening_socket(host, port)
        port = listener.getsockname()[1]
        try:
            store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False, timeout=timeout,
                                  master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now (and closes it)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, wait_for_workers=False, timeout=timeout)
    return SignedStore(store, secret, timeout), port


def _gather(group, tensor: torch.Tensor, world_size: int) -> list[bytes]:
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    group.allgather([out], [tensor]).wait()
    return [bytes(t.cpu().tolist()) for t in out]


def prove(group, rank: int, world_size: int, secret: str, device: torch.device, name: str) -> None:
    """Every member of `group` (a ProcessGroup; this process is `rank`) proves it holds the run's secret, and checks
    every other's proof: RendezvousRefused naming the ranks that fail (`name`: the group, e.g. 'actor')."""
    nonce = torch.tensor(list(secrets.token_bytes(DIGEST)), dtype=torch.uint8, device=device)
    challenge = b"".join(_gather(group, nonce, world_size))
    key = derived(secret, "member proof")

    def tag(r: int) -> bytes:
        return hmac.new(key, f"{world_size} {r} ".encode() + challenge, hashlib.sha256).digest()

    mine = torch.tensor(list(tag(rank)), dtype=torch.uint8, device=device)
    tags = _gather(group, mine, world_size)
    failed = [r for r, given in enumerate(tags) if not hmac.compare_digest(given, tag(r))]
    if failed:
        raise RendezvousRefused(f"{name}: rank(s) {failed} of {world_size} did not prove the run's secret: a process "
                                f"that is not this run's took that place in the group (or was given another secret); "
                                f"nothing was exchanged with it")
