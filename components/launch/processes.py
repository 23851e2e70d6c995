"""Child processes and ports: the one place that starts, watches and stops the processes of this project.

A `ChildProcess` runs a command in a session (process group) of its own, logging to a file; it tells its exit code,
whether it and its group are alive, and the tail of its log. `stop()` sends SIGTERM to the whole group, SIGKILL
after a grace period, and returns only when no member of the group is left (a server's tritonserver and stubs, a
rank's helpers). A process recorded in a pid file by an earlier command (`rlhf up`) is stopped the same way by pid
(`stop_group`). Built on psutil: liveness and group membership are read from the process table, never parsed by hand.

Also here: ports (`can_bind`, `port_block_free`, `find_free_ports`) and `wait_for`, the one poll-until-true loop.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

import psutil

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PARENT_PID_ENV = "RLHF_PARENT_PID"  # a child that must not outlive its parent (exit_with_parent) reads it here
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
    """This environment for a child of ours: the project importable (first on PYTHONPATH), unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
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


def exit_with_parent() -> None:
    """In a child started with $RLHF_PARENT_PID: end this process when that parent is gone (killed without a chance
    to stop us)."""
    parent = int(os.environ.get(PARENT_PID_ENV, "0"))
    if not parent:
        return

    def watch():
        wait_for(lambda: os.getppid() != parent, None, poll_s=1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


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


def find_free_ports(host: str = "127.0.0.1", count: int = 3, start: int = 20000, stop: int = 32000) -> int:
    """A base port P with P..P+count-1 free, outside the ephemeral range and away from 5000/8000-8002."""
    rng = secrets.SystemRandom()
    for _ in range(200):
        port = rng.randrange(start, stop - count)
        if port_block_free(host, port, count):
            return port
    raise RuntimeError(f"no block of {count} free ports found on {host} in [{start}, {stop})")
