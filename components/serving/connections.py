"""How a run's server holds its TCP connections (uvicorn's protocol, bounded), so that connections a stranger opens and
leaves idle, or feeds a request head byte by byte, never keep the run's own callers or /health from being served.

- Connections are not what is limited: uvicorn's own `limit_concurrency` counts open connections, so 64 idle ones of
  anyone's made it answer 503 to every request, /health included. What is limited is the run's requests in flight
  (`InFlight`, after the caller is known: components/serving/rollout/app.py's Guard, the Triton front).
- A connection with no request in progress (none yet, or none since the last answer) for `idle_s` is closed, however
  much of a request head it has sent (uvicorn alone waits forever for a first request).
- At most `max_connections` are open: one more closes the one that has been idle longest (a request in progress is
  never cut); when every connection has a request in progress, the new one is closed instead. The process may open
  that many files (its soft limit is raised towards the hard one).

Imports nothing of the project: the rollout server (.venv-vllm) uses it as the Triton front does.
"""

from __future__ import annotations

import resource
import socket
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

MAX_CONNECTIONS = 1024  # open connections at most; past it, the longest idle one is closed
IDLE_S = 30.0  # a connection without a request in progress this long is closed


def bounded_protocol(max_connections: int = MAX_CONNECTIONS, idle_s: float = IDLE_S) -> type:
    """uvicorn's HTTP protocol (`uvicorn.Config(http=...)`) with the bounds above."""

    class Bounded(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # answers go out as written: a head and a body written apart otherwise wait ~40 ms for the client's
                # delayed ACK (Nagle), as every POST through the Triton front did
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._idle_timer = None
            self._arm()
            if len(self.connections) > max_connections:
                idle = [c for c in self.connections if c is not self and not c.in_progress()]
                (min(idle, key=lambda c: c.idle_since) if idle else self).transport.close()

        def in_progress(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self.idle_since = time.monotonic()
            self._idle_timer = self.loop.call_later(idle_s, self._idle)

        def _idle(self) -> None:
            self._idle_timer = None
            if not self.in_progress() and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            super().connection_lost(exc)

    return Bounded


def allow_open_files(wanted: int) -> int:
    """Raise this process's soft limit of open files towards `wanted` (at most the hard limit); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


class InFlight:
    """The run's requests served at once (`limit`); `enter()` is False past it (answer 503), `leave()` after each."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def enter(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1
