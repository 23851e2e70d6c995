"""The one door to a critic or reward server's Triton: the server's address (host:P) is this front, in the server's
own process; Triton itself listens on a Unix socket in the server's private workspace (a 0700 directory), which no
other user of the machine can open.

Why: Triton takes its access token on its command line only (`--http-restricted-api`), which every local user can
read (/proc/<pid>/cmdline); with it, the model-repository API loads a python-backend model, i.e. runs code as the
run. So Triton gets no token at all (nobody else can reach it), and the front decides who may do what:

    GET  /rlhf/proof                                  anyone: the server's proof of the run's secret (wire.py)
    GET  /v2/health/live, /v2/health/ready,           anyone: liveness and readiness
         /v2/models/<m>[/versions/<v>]/ready
    POST /v2/models/<m>[/versions/<v>]/infer,         the run (a request signed with its key, wire.py); in open mode
    GET  /v2/models/<m>[/versions/<v>][/config], /v2  (deploy.<kind>.auth=none, NeMo-Aligner's client) anyone
    GET  /v2/models[/<m>[/versions/<v>]]/stats,       the run only, also in open mode
         /rlhf/models (the repository's models, their state and why a load failed)
    anything else (model load and unload, the repository index, shared memory, trace and logging settings):
         refused (403), whoever asks, whatever the token. Only the server's own PyTriton (it binds the models) uses
         them, with a token that exists in this process only (`internal_token`).

Every request is bounded: a POST needs a Content-Length (411) of at most `max_body` (413, Triton's own 64 MB limit);
at most `max_in_flight` requests at once are forwarded (503 beyond); connections as components/serving/connections.py
bounds them. Refusals carry Triton's error shape (`{"error": ...}`), so tritonclient reports them as Triton's own.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import socket
import threading
from pathlib import Path
from typing import Optional

import httpx
import uvicorn

from components.launch.processes import wait_for
from components.serving.connections import InFlight, allow_open_files, bounded_protocol
from components.handshake import CHALLENGE_HEADER, PROOF_PATH, SCHEME, RunKeys, Verifier, answer_proof

LOG = logging.getLogger("rlhf.server")

INTERNAL_HEADER = b"triton-access-token"  # what PyTriton sends with its own token (pytriton.client.auth)
MODELS_PATH = "/rlhf/models"
MAX_BODY = 64 << 20  # Triton's own limit on a request body
_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
OPEN = re.compile(rf"^(/v2/health/(live|ready)|{_MODEL}/ready)$")
SERVING = {"POST": re.compile(rf"^{_MODEL}/infer$"), "GET": re.compile(rf"^(/v2|{_MODEL}|{_MODEL}/config)$")}
RUN_ONLY = re.compile(rf"^(/v2/models/stats|{_MODEL}/stats|{MODELS_PATH})$")
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"proxy-connection", b"host",
       b"authorization", INTERNAL_HEADER}


class Front:
    """The front of one Triton server (an ASGI app, served by `start` in a thread of its own)."""

    def __init__(self, host: str, port: int, triton_socket: Path, secret: Optional[str], open_mode: bool,
                 internal_token: str, max_body: int = MAX_BODY, max_in_flight: int = 256, kind: str = "critic"):
        self.host, self.port, self.triton_socket = host, port, Path(triton_socket)
        self.keys = RunKeys(secret) if secret else None
        self.verifier = Verifier(self.keys) if self.keys else None
        self.open_mode, self.internal = open_mode, internal_token.encode()
        self.max_body, self.in_flight, self.kind = max_body, InFlight(max_in_flight), kind
        self._client: Optional[httpx.AsyncClient] = None
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None

    # -- the process's side
    def start(self, timeout_s: float = 30.0) -> None:
        """Bind host:port (an error naming it when taken) and serve in a thread until `stop`."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"port: cannot bind {self.host}:{self.port}: {exc.strerror or exc}") from None
        allow_open_files(2048)
        config = uvicorn.Config(self, log_level="warning", http=bounded_protocol(), lifespan="off",
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name=f"{self.kind}-front")
        self._thread.start()
        if not wait_for(lambda: self._server.started or not self._thread.is_alive(), timeout_s, poll_s=0.05):
            raise TimeoutError(f"{self.kind} server: its front did not start at {self.host}:{self.port}")
        if not self._server.started:
            raise RuntimeError(f"{self.kind} server: its front at {self.host}:{self.port} exited while starting")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the requests' side
    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        if (method, path) == ("GET", PROOF_PATH):
            challenge = headers.get(CHALLENGE_HEADER.encode(), b"").decode("latin-1")
            status, extra, detail = answer_proof(self.keys, "triton", challenge)
            return await _answer(send, status, {"detail": detail} if status == 200 else {"error": detail}, extra)
        internal = hmac.compare_digest(headers.get(INTERNAL_HEADER, b""), self.internal)
        if not internal:
            refused = self.refusal(method, path, headers)
            if refused:
                status, why, extra = refused
                return await _answer(send, status, {"error": why}, extra)
        if method in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length", b"")
            if not length.isdigit():
                return await _answer(send, 411, {"error": "content-length: required (a body of known size)"})
            if int(length) > self.max_body:
                return await _answer(send, 413, {"error": f"content-length: {int(length)} bytes exceed this server's "
                                                          f"limit of {self.max_body}"})
        if path == MODELS_PATH:
            return await self.models(send)
        if internal or OPEN.match(path):
            return await self.forward(scope, receive, send)
        if not self.in_flight.enter():
            return await _answer(send, 503, {"error": f"busy: {self.in_flight.limit} requests in flight; try again"},
                                 {"retry-after": "1"})
        try:
            return await self.forward(scope, receive, send)
        finally:
            self.in_flight.leave()

    def refusal(self, method: str, path: str, headers: dict) -> Optional[tuple[int, str, dict]]:
        """Why a request that is not the server's own may not pass (status, why, headers), None when it may."""
        if method == "GET" and OPEN.match(path):
            return None
        run_only = method == "GET" and RUN_ONLY.match(path)  # first: /v2/models/stats would pass for a model's metadata
        serving = not run_only and method in SERVING and SERVING[method].match(path)
        if not serving and not run_only:
            return 403, (f"{method} {path}: not served by this {self.kind} server: Triton's admin APIs (model "
                         f"loading, the repository, shared memory, trace and logging settings) are closed to every "
                         f"caller, with or without a token"), {}
        if serving and self.open_mode:
            return None
        if self.verifier is None:
            return 403, f"{method} {path}: this server holds no run secret (open mode): only inference, model " \
                        f"config and metadata are served", {}
        refused = self.verifier.check(method, path, headers.get(b"authorization", b"").decode("latin-1") or None)
        if refused:
            status, why = refused
            return status, why, ({"www-authenticate": SCHEME} if status == 401 else {})
        return None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # created on the serving loop, which it belongs to
            # no connection kept open to Triton between requests: on stop, Triton waits for its open connections
            limits = httpx.Limits(max_keepalive_connections=0)
            self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.triton_socket),
                                                                                limits=limits),
                                             base_url="http://triton", timeout=httpx.Timeout(None, connect=5.0))
        return self._client

    async def models(self, send) -> None:
        """The repository's models, their state and why a load failed (Triton's repository index, read here)."""
        try:
            answer = await self.client().post("/v2/repository/index", json={})
        except httpx.TransportError as exc:
            return await _answer(send, 503, {"error": f"Triton is not answering ({type(exc).__name__})"})
        return await _answer(send, answer.status_code, answer.json() if answer.content else [])

    async def forward(self, scope, receive, send) -> None:
        """Triton's answer to the request, streamed back. The body is read whole first (at most max_body, from a
        caller already let in): Triton reads it whole too, and a body streamed on to it waited ~40 ms a request."""
        body = b""
        if scope["method"] in ("POST", "PUT", "PATCH"):
            parts, more = [], True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                parts.append(message.get("body", b""))
                more = message.get("more_body", False)
            body = b"".join(parts)
        target = scope["raw_path"].decode("latin-1") + (f"?{scope['query_string'].decode('latin-1')}"
                                                        if scope["query_string"] else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        request = self.client().build_request(scope["method"], target, headers=headers, content=body or None)
        try:
            response = await self.client().send(request, stream=True)
        except httpx.TransportError as exc:
            return await _answer(send, 503, {"error": f"Triton is not answering ({type(exc).__name__}): it is "
                                                      f"starting or stopping"})
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _answer(send, status: int, body, headers: Optional[dict] = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *((k.encode(), v.encode()) for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": data})
