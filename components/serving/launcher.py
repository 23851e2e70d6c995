"""Start a critic/reward server as a child process, wait until it is ready, and stop it without leaving anything behind.

The child runs `python -m components.serving.main --spec <ServerSpec JSON>` in its own session (process group), logging
to a file: a `ChildProcess` of launch/processes.py, whose `stop()` sends SIGTERM to the whole group (the server,
tritonserver and the python-backend stubs), then SIGKILL after a grace period, and waits until no process of the group
is left. The launcher adds readiness, and handles the environment traps:
- PyTriton's "one script per machine" known issue: two PyTriton servers on one machine collide on the default ports
  8000-8002, and could share python-backend shared-memory names and workspaces. Each child gets its own ports
  (HTTP P, gRPC P+1, metrics P+2), its own PYTRITON_HOME (a fresh temp dir, removed on stop); PyTriton 0.7 already
  makes the shared-memory prefix unique per process.
- Security: PyTriton 0.7 protects the repository/statistics/trace/logging/shared-memory endpoints with an access token
  (health, metadata, model config and inference stay open). The launcher chooses the token and hands it to the child
  in the environment, so readiness checks can read the repository index (a model's state and failure reason).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence
from urllib.parse import urlparse

from components.launch.processes import ChildProcess, project_env, wait_for
from components.serving.servers import ACCESS_HEADER, TOKEN_ENV, ServerSpec, model_state_summary, triton_client


class ServerNotReady(RuntimeError):
    """The server did not become ready; `reason` is one of not_listening, model_not_ready, process_exited, timeout."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def child_env(pytriton_home: Path, access_token: str, extra: Optional[dict] = None) -> dict[str, str]:
    """Environment of a server child: own PYTRITON_HOME, token, project importable (the child itself puts this
    interpreter's libpython first on LD_LIBRARY_PATH for Triton: servers.prepare_environment)."""
    return project_env({"PYTRITON_HOME": str(pytriton_home), TOKEN_ENV: access_token,
                        "DO_NOT_TRACK": os.environ.get("DO_NOT_TRACK", "1"), **(extra or {})})


class ServerProcess(ChildProcess):
    """A server child process in its own process group; a context manager that stops it on exit.

    Attributes: url, pid, log_path, models (names to wait for), access_token.
    """

    def __init__(self, argv: Sequence[str], host: str, port: int, models: Iterable[str], log_path: str | Path,
                 env: Optional[dict] = None, name: str = "server"):
        self.name, self.host, self.port, self.models = name, host, port, tuple(models)
        self.url = f"http://{host}:{port}"
        self.access_token = secrets.token_urlsafe(32)
        self._home = Path(tempfile.mkdtemp(prefix=f"rlhf-{name}-"))  # short: unix socket paths live in here
        try:
            super().__init__(argv, log_path, child_env(self._home, self.access_token, env))
        except BaseException:
            shutil.rmtree(self._home, ignore_errors=True)
            raise

    def wait_until_ready(self, timeout: float = 180.0) -> "ServerProcess":
        wait_until_ready(self.url, self.models, timeout, process=self)
        return self

    def stop(self, grace_s: float = 20.0) -> Optional[int]:
        """SIGTERM to the group, SIGKILL after `grace_s`; returns the server's exit code. Safe to call twice."""
        code = super().stop(grace_s)
        shutil.rmtree(self._home, ignore_errors=True)
        # python-backend shared memory is named after the server's pid; a killed Triton cannot remove it itself
        for leftover in Path("/dev/shm").glob(f"pytrtion{self.pid}-*"):
            leftover.unlink(missing_ok=True)
        return code

    def log_tail(self, lines: int = 30) -> str:
        return self.tail(lines)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess({self.name}, url={self.url}, pid={self.pid}, log={self.log_path})"


# ---------------------------------------------------------------- readiness

def _model_state(client, name: str, access_token: Optional[str]) -> tuple[str, bool]:
    """(description, failed) of a model that is not ready.

    With the access token, the repository index names a model whose load failed (state UNAVAILABLE + reason: our
    servers register a model that cannot load its weights there). PyTriton loads healthy models from outside the
    repository, so they never appear in the index; the model config endpoint then tells 'not found' (not bound yet,
    weights loading) from 'no available versions' (Triton is loading it, or its load failed).
    """
    from tritonclient.utils import InferenceServerException  # heavy: tritonclient, only while waiting for a server

    if access_token:
        try:
            index = client.get_model_repository_index(headers={ACCESS_HEADER: access_token})
        except InferenceServerException:
            index = []
        summary = model_state_summary(index, name)
        if summary is not None:
            return f"state {summary}", summary.startswith("UNAVAILABLE") and "unloaded" not in summary
    try:
        client.get_model_config(name)
        return "state unknown: its config is served but it is not ready", False
    except InferenceServerException as exc:
        error = exc.message() or str(exc)
    if "no available versions" in error:
        return "state UNAVAILABLE: loading, or its load failed (see the server log)", False
    if "not found" in error:
        return "state not loaded: the server is still loading weights", False
    return f"state unknown: {error}".strip(), False


def wait_until_ready(url: str, models: Iterable[str], timeout: float, process: Optional[ServerProcess] = None,
                     access_token: Optional[str] = None, poll_s: float = 0.25) -> None:
    """Poll server liveness, each model's readiness and server readiness (tritonclient) until all `models` are ready,
    else raise ServerNotReady.

    The error tells apart: nothing listening at host:port; server up but model X not ready (state ...); server process
    exited with code N (+ log tail); a server that accepts connections but does not answer (timeout). A model whose load
    failed raises at once instead of waiting out the timeout.
    """
    parsed = urlparse(url if "://" in url else f"http://{url}")
    base = f"{parsed.scheme}://{parsed.netloc}"
    where = parsed.netloc
    token = access_token or (process.access_token if process is not None else None)
    models = tuple(models)
    deadline = time.monotonic() + timeout
    last = [f"nothing listening at {where}", "not_listening"]  # what the last check saw, and its reason

    def ready() -> bool:
        if process is not None and (code := process.poll()) is not None:
            raise ServerNotReady(f"server process exited with code {code} before {base} was ready; "
                                 f"last lines of {process.log_path}:\n{process.log_tail()}", "process_exited")
        client = triton_client(base, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        try:
            live = client.is_server_live()
            pending = [m for m in models if not client.is_model_ready(m)]
            if live and not pending and client.is_server_ready():
                return True
            if pending:
                state, failed = _model_state(client, pending[0], token)
                last[:] = f"server up at {where} but model {pending[0]} not ready ({state})", "model_not_ready"
                if failed:
                    tail = f"; last lines of {process.log_path}:\n{process.log_tail()}" if process is not None else ""
                    raise ServerNotReady(last[0] + tail, last[1])
            else:
                last[:] = f"server up at {where} but not ready (live={live})", "model_not_ready"
        except ConnectionRefusedError as exc:
            last[:] = f"nothing listening at {where} ({exc.strerror or exc})", "not_listening"
        except (TimeoutError, socket.timeout) as exc:
            last[:] = f"server at {where} accepted the connection but did not answer ({exc or 'timeout'})", "timeout"
        except OSError as exc:  # reset, unreachable: the network said no
            last[:] = f"cannot reach {where}: {exc}", "not_listening"
        finally:
            client.close()
        return False

    if not wait_for(ready, timeout, poll_s):
        raise ServerNotReady(f"timed out after {timeout:.0f}s waiting for {base} ({', '.join(models)}): {last[0]}",
                             last[1])


# ---------------------------------------------------------------- the servers of a run

def server_argv(spec: ServerSpec) -> list[str]:
    """Command line of a server child: the whole ServerSpec as one JSON document."""
    return [sys.executable, "-m", "components.serving.main", "--spec", spec.model_dump_json()]


def launch(spec: ServerSpec, log_path: str | Path, wait: bool = True) -> ServerProcess:
    """Start the server of `spec` as a child process and, by default, wait until it is ready (stopping it if not).

    The child resolves model paths against the same state directory as this process (made explicit in the spec).
    """
    cfg = spec.config
    spec = spec.model_copy(update={"config": cfg.model_copy(update={"state_dir": str(cfg.resolved_state_dir())})})
    proc = ServerProcess(server_argv(spec), spec.host, spec.port, spec.models, log_path, name=spec.kind)
    if not wait:
        return proc
    try:
        return proc.wait_until_ready(spec.section.ready_timeout_s)
    except BaseException:
        proc.stop()
        raise
