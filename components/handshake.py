"""How a run's clients and servers know each other on the wire, without the run's secret ever crossing it.

Two keys are derived from the run's secret (HMAC-SHA256 with a label each): the server key, which only proves a server,
and the client key, which only signs requests. Neither, nor the secret, is ever sent.

- A server proves itself first. Before a client sends anything on a new TCP connection (the run's secret, a token, a
  payload), it sends `GET /rlhf/proof` with a fresh random challenge (`x-rlhf-challenge`, 128 bits, with the role
  it expects: `triton` or `rollout`) and reads the answer's `x-rlhf-proof`: HMAC(server key, role, challenge). A
  server that cannot answer it (an impostor at the address, a stranger's server on a port the run's server left, a
  server of another run) is refused before the client sends it anything: `ServerNotProven`, naming the address. What
  the impostor saw, a random challenge, lets it do nothing. Each new connection of a client is proven this way
  (`proving_transport`, `async_proving_transport`: the check runs inside the connection's set-up, so no request can
  go out on a connection that was not proven).
- Each request is signed: `Authorization: RLHF-HMAC ts=<unix seconds>, nonce=<128 random bits>, mac=<HMAC(client
  key, method, path, ts, nonce)>` (`request_headers`, or `RequestAuth` for httpx). The server checks the MAC in
  constant time, the time within WINDOW_S of its clock, and that the nonce was not used before (`Verifier`): a
  captured request cannot be sent again, nor its header put on another method or path.

What this does not promise: the wire is plain HTTP, so the bytes of a request and its answer (the body, the query
string) are not covered; a party that relays a client's connection to the run's real server (it must sit between
the two) reads them, and could alter them. The secret and the keys never cross, so no such party can speak as the run
afterwards.

Stdlib and httpx only: the project's environment, the rollout server's (.venv-vllm) and the verifiers worker's
(.venv-verifiers) import it, and it imports nothing of the project (tests/test_imports.py).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from typing import Optional

import h11
import httpcore
import httpx

PROOF_PATH = "/rlhf/proof"  # GET: a server's proof that it holds the run's secret; open to anyone
CHALLENGE_HEADER = "x-rlhf-challenge"  # the client's fresh challenge, 32 hex digits
ROLE_HEADER = "x-rlhf-role"  # the role the client expects: triton (critic, reward) or rollout
PROOF_HEADER = "x-rlhf-proof"  # the server's answer: HMAC(server key, role, challenge), hex
SCHEME = "RLHF-HMAC"  # Authorization: RLHF-HMAC ts=..., nonce=..., mac=...
WINDOW_S = 300  # how far a request's time may be from the server's clock (clusters' clocks drift a little)
ROLES = ("triton", "rollout")
_HEADER = re.compile(r"^RLHF-HMAC ts=(\d{1,12}), nonce=([0-9a-f]{32}), mac=([0-9a-f]{64})$")
_CHALLENGE = re.compile(r"^[0-9a-f]{32}$")


class ServerNotProven(Exception):
    """A server at a client's address did not prove that it holds the run's secret: nothing was sent to it."""


def _key(secret: str, label: bytes) -> bytes:
    return hmac.new(secret.encode(), b"rlhf-flows " + label, hashlib.sha256).digest()


class RunKeys:
    """The keys derived from a run's secret: `server` proves servers, `client` signs requests."""

    def __init__(self, secret: str):
        self.server = _key(secret, b"server proof v1")
        self.client = _key(secret, b"client request v1")

    def proof(self, role: str, challenge: str) -> str:
        """The answer a server of the run gives to `challenge` in `role`."""
        return hmac.new(self.server, f"proof\n{role}\n{challenge}".encode(), hashlib.sha256).hexdigest()

    def mac(self, method: str, path: str, ts: str, nonce: str) -> str:
        return hmac.new(self.client, f"request\n{method.upper()}\n{path}\n{ts}\n{nonce}".encode(),
                        hashlib.sha256).hexdigest()


def request_headers(keys: RunKeys, method: str, path: str) -> dict[str, str]:
    """The header that signs one request (`path` without its query string); a fresh nonce each time."""
    ts, nonce = str(int(time.time())), secrets.token_hex(16)
    return {"authorization": f"{SCHEME} ts={ts}, nonce={nonce}, mac={keys.mac(method, path, ts, nonce)}"}


class RequestAuth(httpx.Auth):
    """httpx: sign every request of a client with the run's client key."""

    def __init__(self, keys: RunKeys):
        self.keys = keys

    def auth_flow(self, request: httpx.Request):
        request.headers.update(request_headers(self.keys, request.method, request.url.path))
        yield request


class Verifier:
    """A server's check of signed requests: the MAC, the time, and each nonce once (remembered for 2 x WINDOW_S, at
    most `capacity` of them: past that the oldest are forgotten first)."""

    def __init__(self, keys: RunKeys, capacity: int = 1 << 20):
        self.keys, self.capacity = keys, capacity
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, method: str, path: str, authorization: Optional[str], now: Optional[float] = None
              ) -> Optional[tuple[int, str]]:
        """None when the request is the run's; else (401 or 403, why), naming the header."""
        if not authorization or not authorization.startswith(f"{SCHEME} "):
            return 401, (f"authorization: this server serves one run: sign each request with the run's key "
                         f"('Authorization: {SCHEME} ts=..., nonce=..., mac=...', components/handshake.py)")
        found = _HEADER.match(authorization.strip())
        if not found:
            return 401, (f"authorization: malformed {SCHEME} header (expected ts=<seconds>, nonce=<32 hex>, "
                         f"mac=<64 hex>)")
        ts, nonce, mac = found.groups()
        if not hmac.compare_digest(mac, self.keys.mac(method, path, ts, nonce)):
            return 403, "authorization: not signed with this run's key"
        now = time.time() if now is None else now
        if abs(now - int(ts)) > WINDOW_S:
            return 403, f"authorization: ts={ts} is more than {WINDOW_S}s from this server's clock ({int(now)})"
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= self.capacity):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return 403, "authorization: this request was sent before (a nonce is used once)"
            self._seen[nonce] = now + 2 * WINDOW_S
        return None


def answer_proof(keys: Optional[RunKeys], role: str, challenge: Optional[str]) -> tuple[int, dict[str, str], str]:
    """A server's answer to GET /rlhf/proof: (status, headers, detail)."""
    if keys is None:
        return 404, {}, "proof: this server holds no run secret (open mode)"
    if not challenge or not _CHALLENGE.match(challenge):
        return 400, {}, f"{CHALLENGE_HEADER}: expected 32 hex digits"
    return 200, {PROOF_HEADER: keys.proof(role, challenge)}, "proved"


# ---------------------------------------------------------------- the client's side: prove each new connection

class _Handshake:
    """One connection's proof: the request to send, then the answer read as it arrives (at most 64 KiB of it)."""

    LIMIT = 1 << 16

    def __init__(self, keys: RunKeys, role: str, host: str, port: int):
        self.keys, self.role, self.where = keys, role, f"{host}:{port}"
        self.challenge = secrets.token_hex(16)
        self.conn = h11.Connection(h11.CLIENT)
        self.response: Optional[h11.Response] = None
        self.received = 0

    def request(self) -> bytes:
        head = h11.Request(method="GET", target=PROOF_PATH, headers=[
            ("host", self.where), (CHALLENGE_HEADER, self.challenge), (ROLE_HEADER, self.role),
            ("content-length", "0")])
        return self.conn.send(head) + self.conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> bool:
        """Take what arrived (b"": the peer closed); True once the answer is whole (then checked: ServerNotProven)."""
        self.received += len(data)
        if self.received > self.LIMIT:
            raise ServerNotProven(f"the server at {self.where} answered GET {PROOF_PATH} with more than "
                                  f"{self.LIMIT} bytes: not a server of this run; nothing was sent to it")
        try:
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.Response):
                    self.response = event
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    self.check()
                    return True
        except h11.ProtocolError as exc:
            raise ServerNotProven(f"the server at {self.where} did not answer GET {PROOF_PATH} in HTTP/1.1 "
                                  f"({exc}): not a server of this run; nothing was sent to it") from None
        return False

    def check(self) -> None:
        if self.response is None:  # a server going away (or not yet there): a connection failure, not an impostor
            raise httpcore.RemoteProtocolError(f"the server at {self.where} closed the connection before answering "
                                               f"GET {PROOF_PATH}")
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in self.response.headers}
        proof, status = headers.get(PROOF_HEADER, ""), self.response.status_code
        if status != 200 or not hmac.compare_digest(proof, self.keys.proof(self.role, self.challenge)):
            said = f"answered {status}" + (" with a wrong proof" if status == 200 else "")
            raise ServerNotProven(f"the server at {self.where} did not prove it holds the run's secret ({said} to "
                                  f"GET {PROOF_PATH}): not a {self.role} server of this run; nothing was sent to it")
        if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
            raise httpcore.RemoteProtocolError(f"the server at {self.where} proved itself, then closed the "
                                               f"connection (it is stopping)")


class _ProvingBackend(httpcore.NetworkBackend):
    def __init__(self, keys: RunKeys, role: str):
        self.inner, self.keys, self.role = httpcore.SyncBackend(), keys, role

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            handshake = _Handshake(self.keys, self.role, host, port)
            stream.write(handshake.request(), timeout)
            while not handshake.feed(stream.read(65536, timeout)):
                pass
            return stream
        except BaseException:
            stream.close()
            raise

    def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise ServerNotProven(f"{path}: a run's servers are reached over TCP")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class _AsyncProvingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, keys: RunKeys, role: str):
        self.inner, self.keys, self.role = httpcore.AnyIOBackend(), keys, role

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = await self.inner.connect_tcp(host, port, timeout, local_address, socket_options)
        try:
            handshake = _Handshake(self.keys, self.role, host, port)
            await stream.write(handshake.request(), timeout)
            while not handshake.feed(await stream.read(65536, timeout)):
                pass
            return stream
        except BaseException:
            await stream.aclose()
            raise

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise ServerNotProven(f"{path}: a run's servers are reached over TCP")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role: one of {ROLES}, got {role!r}")


def proving_transport(keys: RunKeys, role: str, limits: httpx.Limits = httpx.Limits()) -> httpx.HTTPTransport:
    """An httpx transport whose every new connection is proven (the server answers the run's challenge for `role`)
    before a request goes out on it."""
    _check_role(role)
    transport = httpx.HTTPTransport(limits=limits)
    transport._pool = httpcore.ConnectionPool(  # httpx's own pool, with the proving backend (httpx takes none)
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, network_backend=_ProvingBackend(keys, role))
    return transport


def async_proving_transport(keys: RunKeys, role: str,
                            limits: httpx.Limits = httpx.Limits()) -> httpx.AsyncHTTPTransport:
    """As `proving_transport`, for httpx.AsyncClient (an OpenAI client's)."""
    _check_role(role)
    transport = httpx.AsyncHTTPTransport(limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(  # as above
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, network_backend=_AsyncProvingBackend(keys, role))
    return transport


def run_client(secret: Optional[str], role: str, limits: httpx.Limits = httpx.Limits(), **kwargs) -> httpx.Client:
    """An httpx client of a run's `role` server: with the run's secret, every connection proven and every request
    signed; without one (None or "": a server in open mode), a plain client."""
    if not secret:
        return httpx.Client(limits=limits, **kwargs)
    keys = RunKeys(secret)
    return httpx.Client(transport=proving_transport(keys, role, limits), auth=RequestAuth(keys), **kwargs)


def run_async_client(secret: str, role: str, limits: httpx.Limits = httpx.Limits(), **kwargs) -> httpx.AsyncClient:
    """As `run_client`, asynchronous (an OpenAI client's `http_client`)."""
    keys = RunKeys(secret)
    return httpx.AsyncClient(transport=async_proving_transport(keys, role, limits), auth=RequestAuth(keys), **kwargs)
