"""The actor's ranks as processes: rank 0 is this process (the flow run, or `rlhf train`); the others follow it.

One node (`actor.nproc_per_node` = N > 1, no torchrun around us): rank 0 starts ranks 1..N-1 as child processes in a
process group of their own, with the standard environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), and watches them. Several nodes: every pod runs
`torchrun ... -m components.ranks -- <command of rank 0>`; the process that torchrun makes rank 0 execs the command
(the Prefect flow run), every other rank follows. Either way a follower joins the process group, receives the run's
config from rank 0, builds the same actor, and executes rank 0's commands until told to stop (models/loop.py).

Faults: collectives time out after `actor.collective_timeout_s`; rank 0 names a follower that died (rank, exit code,
log tail) or went silent; followers exit when rank 0 disappears; no process of the run outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from components.launcher import PROJECT_ROOT, find_free_ports, port_block_free
from models.config import RLHFConfig, with_schedule_lengths

if TYPE_CHECKING:
    from models.loop import Leader

BACKEND_ENV, TIMEOUT_ENV = "RLHF_DIST_BACKEND", "RLHF_DIST_TIMEOUT_S"


class Follower:
    """Rank r (> 0) as a child process of rank 0, logging to a file; in a process group of its own, or in rank 0's
    (a server's followers: whoever stops the server's group stops them too)."""

    def __init__(self, rank: int, argv: list[str], env: dict, log_path: Path, own_group: bool = True):
        self.rank, self.log_path, self.own_group = rank, log_path, own_group
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=own_group)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> Optional[int]:
        """SIGTERM (its group), SIGKILL after `grace_s`; returns the exit code."""
        kill = (lambda sig: os.killpg(self.proc.pid, sig)) if self.own_group else self.proc.send_signal
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                kill(sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        if self.own_group:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # anything it started
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Followers:
    """Ranks 1..N-1 of one node, started and watched by rank 0 (of the actor, or of a critic server)."""

    def __init__(self, name: str, world: int, host: str, port: int, argv: list[str], env: dict, log_dir: Path,
                 own_group: bool = True):
        self.name, self.world = name, world
        port = port if port_block_free(host, port, 1) else find_free_ports(host, count=1)
        self.init_method = f"tcp://{host}:{port}"
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), base.get("PYTHONPATH", "")) if p)
        base.update({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": host,
                     "MASTER_PORT": str(port), "RLHF_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1", **env})
        self.ranks = [Follower(r, argv, {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                               log_dir / f"{name}-rank{r}.log", own_group) for r in range(1, world)]

    @classmethod
    def for_actor(cls, cfg: RLHFConfig, log_dir: Path) -> "Followers":
        actor = cfg.actor
        return cls("actor", actor.world_size, actor.master_addr, actor.master_port,
                   [sys.executable, "-m", "components.ranks"],
                   {BACKEND_ENV: actor.backend, TIMEOUT_ENV: str(actor.collective_timeout_s)}, log_dir)

    def exited(self) -> Optional[str]:
        """'<name> rank R (pid) exited with code C; last lines of its log' for the first follower that exited."""
        for f in self.ranks:
            if (code := f.proc.poll()) is not None:
                return (f"{self.name} rank {f.rank} (pid {f.proc.pid}) exited with code {code}; "
                        f"last lines of {f.log_path}:\n{f.tail()}")
        return None

    def describe_failure(self, settle_s: float = 5.0) -> Optional[str]:
        """Why a collective failed, as far as the followers tell: the first that exited (rank, code, log tail), or
        the ranks that still run (then they went silent)."""
        deadline = time.monotonic() + settle_s  # a killed peer may close its sockets a moment before its exit is seen
        while time.monotonic() < deadline and all(f.proc.poll() is None for f in self.ranks):
            time.sleep(0.1)
        return self.exited() or (f"{self.name} ranks {[f.rank for f in self.ranks]} are alive but did not answer a "
                                 f"collective (hung, or slower than the collective timeout)")

    def stop(self) -> dict[int, Optional[int]]:
        return {f.rank: f.stop() for f in self.ranks}


@contextmanager
def actor_ranks(cfg: RLHFConfig, log_dir: Path) -> Iterator["Leader"]:
    """The actor on all its ranks, this process being rank 0; followers are stopped on exit, whatever happened."""
    from models import distributed
    from models.loop import Leader, build_actor

    cfg = with_schedule_lengths(cfg)
    cfg = cfg.model_copy(update={"state_dir": str(cfg.resolved_state_dir())})  # the same path on every rank
    outer = distributed.from_env()  # torchrun (several nodes) made us a rank already
    followers = None
    if outer.active:
        if outer.rank != 0:
            raise RuntimeError(f"the flow run must be actor rank 0, but RANK={outer.rank}")
        if outer.world_size != cfg.actor.world_size:
            raise ValueError(f"actor: torchrun started {outer.world_size} ranks, the config asks for "
                             f"{cfg.actor.world_size} (nnodes x nproc_per_node)")
        me, init_method = outer, None
    elif cfg.actor.world_size > 1:
        if cfg.actor.nnodes > 1:
            raise ValueError("actor.nnodes > 1: start every node under torchrun (the actor-gpu job template does)")
        followers = Followers.for_actor(cfg, log_dir)
        me, init_method = distributed.Dist(0, cfg.actor.world_size, 0, cfg.actor.world_size), followers.init_method
    else:
        me, init_method = distributed.SINGLE, None
    try:
        if me.active:
            device = distributed.local_device(cfg.model.device, me)
            distributed.init(me, distributed.resolve_backend(cfg.actor.backend, device), cfg.actor.collective_timeout_s,
                             device, init_method)
            me.broadcast_object(cfg.model_dump_json())
            distributed.check_shared_directory(me, cfg.resolved_state_dir() / "runs")
        leader = Leader(cfg, build_actor(cfg, me), followers.describe_failure if followers else lambda: None)
        yield leader
        if me.active:
            me.broadcast_object({"op": "stop"})
            distributed.shutdown(me, graceful=True)
    finally:
        if followers is not None:
            followers.stop()
        distributed.shutdown()


# ---------------------------------------------------------------- the follower side

def exit_with_parent() -> None:
    """A follower that rank 0 started ends when rank 0 is gone (killed without a chance to stop us)."""
    parent = int(os.environ.get("RLHF_PARENT_PID", "0"))
    if not parent:
        return

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def follow() -> int:
    """Join the group, receive the config, build the actor, execute rank 0's commands until told to stop."""
    from models import distributed
    from models.config import RLHFConfig
    from models.loop import build_actor, execute

    exit_with_parent()
    me = distributed.from_env()
    device = distributed.local_device("auto", me)
    backend = distributed.resolve_backend(os.environ.get(BACKEND_ENV, "auto"), device)
    distributed.init(me, backend, float(os.environ.get(TIMEOUT_ENV, "300")), device)
    try:
        cfg = RLHFConfig.model_validate_json(me.broadcast_object(None))
        distributed.check_shared_directory(me, cfg.resolved_state_dir() / "runs")
        state = build_actor(cfg, me)
        while (command := me.broadcast_object(None))["op"] != "stop":
            execute(state, cfg, command)
        distributed.shutdown(me, graceful=True)
    finally:
        distributed.shutdown()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m components.ranks [-- COMMAND...]`: a follower; under torchrun, rank 0 execs COMMAND instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if argv and int(os.environ.get("RANK", "0")) == 0:
        os.execvp(argv[0], argv)  # rank 0 becomes the flow run (it keeps torchrun's environment)
    from components.cli import quiet

    quiet()
    return follow()


if __name__ == "__main__":
    sys.exit(main())
