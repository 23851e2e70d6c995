"""Child processes and ports: the one place that starts, watches and stops the processes of this project.

A `ChildProcess` runs a command in a session (process group) of its own, logging to a file; it tells its exit code,
whether it and its group are alive, the tail of its log, and why it exited (`exit_description`). `stop()` sends
SIGTERM to the whole group, SIGKILL after a grace period, and returns only when no member of the group is left (a
server's tritonserver and stubs, a rank's helpers). A process recorded in a pid file by an earlier command (`rlhf up`)
is stopped the same way by pid (`stop_group`). Built on psutil: liveness and group membership are read from the
process table, never parsed by hand.

A `ServerProcess` is the one class every server of a run is started with (critic, reward, rollout): a `ChildProcess`
with a URL, one readiness wait over a probe of its kind (`Health`: Triton's model readiness, the rollout server's
/health), and one death description (`death()`: exited with code and log tail, or alive but unhealthy). The same
readiness wait serves a server that is not our child (a deployment's), given its probe.

Also here: ports (`free_port`: the preferred port, else a free one) and `wait_for`, the one poll-until-true loop.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, TypeVar

import psutil

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PARENT_PID_ENV = "RLHF_PARENT_PID"  # a child that must not outlive its parent (exit_with_parent) reads it here
OWN_DIR_ENV = "RLHF_OWN_DIR"  # a directory its parent made for this child alone: the child removes it if orphaned
T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: Optional[float], poll_s: float = 0.1) -> T:
    """Call `condition()` every `poll_s` seconds until it returns something truthy, and return that; after `timeout`
    seconds (None: no limit) return its last, falsy, answer. An exception it raises ends the wait (a fatal state)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return value
        time.sleep(poll_s if left is None else min(poll_s, left))


# ---------------------------------------------------------------- processes

def alive(pid: int) -> bool:
    """Whether a process with this pid runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[psutil.Process]:
    """The live (not zombie) processes of process group `pgid`."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (psutil.Error, OSError):
            continue
    return members


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pid: int) -> None:
    """Collect the exit status of a child of ours that nobody waits for (no zombie left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_group(pgid: int, grace_s: float = 10.0, leader: Optional[subprocess.Popen] = None) -> None:
    """SIGTERM to every process of group `pgid`, SIGKILL to what is left after `grace_s`; returns once no member of
    the group is left. `leader`: the group leader's Popen, waited for first (so its exit code is kept)."""
    signal_group(pgid, signal.SIGTERM)
    if leader is not None:
        try:
            leader.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
            leader.wait()
    if not wait_for(lambda: not group_members(pgid), grace_s, poll_s=0.2):  # e.g. tritonserver outliving the server
        signal_group(pgid, signal.SIGKILL)
        wait_for(lambda: not group_members(pgid), 10.0, poll_s=0.1)
    if leader is None:
        _reap(pgid)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def project_env(extra: Optional[dict] = None) -> dict[str, str]:
    """This environment for a child of ours: the project importable (first on PYTHONPATH), unbuffered output, no
    progress bars (its output goes to a log file)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a child's output goes to a log file: no bars there
    env.update(extra or {})
    return env


class ChildProcess:
    """`argv` as a child process logging (stdout and stderr) to `log_path`; in a session and process group of its own
    unless `own_group=False` (then it shares ours: whoever stops our group stops it too)."""

    def __init__(self, argv: Sequence[str], log_path: str | Path, env: Optional[dict] = None, own_group: bool = True):
        self.argv, self.own_group = list(argv), own_group
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=own_group)  # same cwd: relative paths work
        self.pid = self.popen.pid
        self._stopped = False

    def poll(self) -> Optional[int]:
        """The exit code, or None while it runs."""
        return self.popen.poll()

    def group_members(self) -> list[psutil.Process]:
        """Live processes of its group (it, and whatever it started); only itself when it shares our group."""
        if self.own_group:
            return group_members(self.pid)
        return [psutil.Process(self.pid)] if alive(self.pid) else []

    def tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def exit_description(self, name: str, where: str = "", lines: int = 30) -> str:
        """'<name> (pid P[, where]) exited with code C[: its last ERROR line]; last lines of <log>: ...'. The reason
        is searched further back than the tail shown: a server's shutdown messages after it can be many lines."""
        errors = [line.split(" ERROR ", 1)[1] for line in self.tail(400).splitlines() if " ERROR " in line]
        why = f": {errors[-1]}" if errors else ""
        return (f"{name} (pid {self.pid}{', ' + where if where else ''}) exited with code {self.poll()}{why}; "
                f"last lines of {self.log_path}:\n{self.tail(lines)}")

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM (to its group), SIGKILL after `grace_s`, wait until nothing of it is left; returns its exit code.
        Safe to call twice."""
        if self.own_group:
            if self.popen.poll() is None or self.group_members():
                stop_group(self.pid, grace_s, leader=self.popen)
        elif self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if not self._stopped:
            self._stopped = True
            with open(self.log_path, "ab") as log:
                log.write(f"--- stopped with code {self.popen.returncode}\n".encode())
        return self.popen.returncode


# ---------------------------------------------------------------- servers

class ServerNotReady(RuntimeError):
    """A server did not become ready; `reason` is one of not_listening, not_ready, process_exited, timeout,
    wrong_server."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Health:
    """What one look at a server saw: `ok` (it serves), what it saw (`status`, for messages), why not (`reason`,
    as ServerNotReady's), and what a healthy server answered (`info`). A probe raises ServerNotReady for a state that
    waiting cannot mend (a model whose load failed, another server at the address)."""

    ok: bool
    status: str
    reason: str = "not_ready"
    info: dict = field(default_factory=dict)


Probe = Callable[[], Health]


REPORT_EVERY_S = 30.0  # how often a readiness wait says what it waits for


def wait_until_ready(probe: Probe, timeout: float, name: str, url: str, process: Optional[ChildProcess] = None,
                     poll_s: float = 0.25, report: Optional[Callable[[str], None]] = None,
                     report_every_s: float = REPORT_EVERY_S) -> Health:
    """Look at the server through `probe` until it serves, and return what it answered; raise ServerNotReady naming
    what was seen last after `timeout`, at once if `process` (the server, when it is our child) exits first. Every
    `report_every_s` of waiting, `report` is told what is awaited and for how long already ('waiting for the
    rollout server at URL: nothing listening at ... (30 s of 900 s)'): a cold node takes minutes."""
    last = [Health(False, f"nothing seen at {url} yet", "not_listening")]
    started = time.monotonic()
    said = [started]

    def ready() -> Optional[Health]:
        if process is not None and (code := process.poll()) is not None:
            raise ServerNotReady(f"{name} exited with code {code} before {url} was ready; last lines of "
                                 f"{process.log_path}:\n{process.tail()}", "process_exited")
        try:
            last[0] = probe()
        except ServerNotReady as exc:  # a state waiting cannot mend: with our child's log tail
            tail = f"; last lines of {process.log_path}:\n{process.tail()}" if process is not None else ""
            raise ServerNotReady(f"{exc}{tail}", exc.reason) from None
        now = time.monotonic()
        if not last[0].ok and report is not None and now - said[0] >= report_every_s:
            said[0] = now
            report(f"waiting for the {name} at {url}: {last[0].status} ({now - started:.0f} s of {timeout:.0f} s)")
        return last[0] if last[0].ok else None

    found = wait_for(ready, timeout, poll_s)
    if found:
        return found
    raise ServerNotReady(f"timed out after {timeout:.0f}s waiting for {name} at {url}: {last[0].status}",
                         last[0].reason)


class ServerProcess(ChildProcess):
    """A server of a run as a child process in its own process group, logging to a file; a context manager that
    stops it. `probe` looks at it (one kind per server); `on_stop` removes what the server leaves behind when killed
    (e.g. Triton's workspace and shared memory); `title` names it in messages ('<name> server' unless given, e.g.
    'rollout server replica 1')."""

    def __init__(self, name: str, argv: Sequence[str], url: str, log_path: str | Path, probe: Probe,
                 env: Optional[dict] = None, on_stop: Optional[Callable[["ServerProcess"], None]] = None,
                 title: Optional[str] = None):
        self.name, self.url, self.probe, self._on_stop = name, url, probe, on_stop
        self.title = title or f"{name} server"
        super().__init__(argv, log_path, env)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def wait_until_ready(self, timeout: float = 180.0, report: Optional[Callable[[str], None]] = None) -> Health:
        return wait_until_ready(self.probe, timeout, self.title, self.url, self, report=report)

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """Why the server cannot serve, or None while it does (its probe says so): called after a request failed. A
        killed server drops its connections a moment before its exit is seen, and one that lost a rank stops serving
        before it exits: an unhealthy server gets `settle_s` to exit. One that stays up but unhealthy is named with
        what it says. (Whoever asks decides how long a healthy server is watched: RunServices.guard.)"""
        if self.poll() is None:
            health = self.probe()
            if health.ok:
                return None  # alive and serving: the failure was not this server's
            if not wait_for(lambda: self.poll() is not None, settle_s):
                return f"{self.title} (pid {self.pid}, {self.url}) is not healthy: {health.status}"
        return self.exit_description(self.title, self.url)

    def stop(self, grace_s: float = 20.0) -> Optional[int]:
        """SIGTERM to the group, SIGKILL after `grace_s`; returns the server's exit code. Safe to call twice."""
        code = super().stop(grace_s)
        if self._on_stop is not None:
            self._on_stop(self)
        return code

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess({self.name}, url={self.url}, pid={self.pid}, log={self.log_path})"


def remove_own_dir_if_orphaned() -> None:
    """At a child's exit: the directory its parent made for it alone ($RLHF_OWN_DIR), removed when that parent
    ($RLHF_PARENT_PID) is gone (killed without stopping us), since no one else will; a living parent removes it."""
    own, parent = os.environ.get(OWN_DIR_ENV), int(os.environ.get(PARENT_PID_ENV, "0"))
    if own and parent and os.getppid() != parent:
        shutil.rmtree(own, ignore_errors=True)


def exit_with_parent(grace_s: float = 10.0, poll_s: float = 1.0) -> Optional[threading.Thread]:
    """In a child started with $RLHF_PARENT_PID (a run's server, a follower rank): end this process within about
    `poll_s` once that parent is gone (killed without a chance to stop us: SIGKILL, OOM). A watch thread, not
    PR_SET_PDEATHSIG: that signal follows the parent *thread* that forked us, and a flow starts its servers from
    task threads that end long before the run does.

    A process that leads its own process group (a server: it started tritonserver, stubs, ranks) stops its group
    as a stop request would (SIGTERM to the group: the server's handler stops Triton), then kills what is left after
    `grace_s`; any other process exits at once (code 3). Returns the watch thread (None without a parent)."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    if not parent:
        return None

    def watch():
        wait_for(lambda: os.getppid() != parent, None, poll_s=poll_s)
        if os.getpgid(0) != os.getpid():
            os._exit(3)
        signal_group(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        signal_group(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True, name="parent-watch")
    thread.start()
    return thread


# ---------------------------------------------------------------- ports

def can_bind(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR, as servers do: TIME_WAIT leftovers do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_block_free(host: str, port: int, count: int = 3) -> bool:
    """Whether ports port..port+count-1 can all be bound on host right now."""
    return all(can_bind(host, p) for p in range(port, port + count))


def free_port(host: str, preferred: int, count: int = 1) -> int:
    """The preferred port (a block of `count` from it) when free on `host`, else (or for 0) a free block: two runs
    on one machine must not collide. A wildcard host is checked on loopback."""
    bind = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return preferred if preferred and port_block_free(bind, preferred, count) else find_free_ports(bind, count)


def find_free_ports(host: str = "127.0.0.1", count: int = 3, start: int = 20000, stop: int = 32000) -> int:
    """A base port P with P..P+count-1 free, outside the ephemeral range and away from 5000/8000-8002."""
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randrange(start, stop - count)
        if port_block_free(host, port, count):
            return port
    raise RuntimeError(f"no block of {count} free ports found on {host} in [{start}, {stop})")
