"""Ranks 1..N-1 of one node as child processes of rank 0 (the actor's, or a critic server's): started with the
standard environment and the secret the ranks prove to each other (models/rendezvous.py: in their environment,
never on a command line), watched, named when one dies, stopped. Apart from components/launch/ranks.py, which builds
what the ranks run, so that a process that only starts followers (a critic server) does not import the actor's code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from components.launch.processes import PARENT_PID_ENV, ChildProcess, free_port, project_env, wait_for

if TYPE_CHECKING:
    from models.config import RLHFConfig

BACKEND_ENV, TIMEOUT_ENV = "RLHF_DIST_BACKEND", "RLHF_DIST_TIMEOUT_S"
SECRET_ENV = "RLHF_RUN_SECRET"  # the run's secret, as components/serving/auth.py (a follower gets it in this variable)


class Follower(ChildProcess):
    """Rank r (> 0) as a child process of rank 0, logging to a file; in a process group of its own, or in rank 0's
    (a server's followers: whoever stops the server's group stops them too)."""

    def __init__(self, rank: int, argv: list[str], env: dict, log_path: Path, own_group: bool = True):
        self.rank = rank
        super().__init__(argv, log_path, env, own_group)


class Followers:
    """Ranks 1..N-1 of one node, started and watched by rank 0 (of the actor, or of a critic server), which meets them
    at `address` (rank 0's store listens there: models/distributed.init) and proves `secret` to them."""

    def __init__(self, name: str, world: int, host: str, port: int, argv: list[str], env: dict, log_dir: Path,
                 secret: str, own_group: bool = True):
        self.name, self.world = name, world
        port = free_port(host, port)
        self.address = (host, port)
        base = project_env({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": host,
                            "MASTER_PORT": str(port), PARENT_PID_ENV: str(os.getpid()), **env, SECRET_ENV: secret})
        self.ranks = [Follower(r, argv, {**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                               log_dir / f"{name}-rank{r}.log", own_group) for r in range(1, world)]

    @classmethod
    def for_actor(cls, cfg: RLHFConfig, log_dir: Path, secret: str) -> "Followers":
        actor = cfg.deploy.actor
        return cls("actor", actor.world_size, actor.master_addr, actor.master_port,
                   [sys.executable, "-m", "components.launch.ranks"],
                   {BACKEND_ENV: actor.backend, TIMEOUT_ENV: str(actor.collective_timeout_s)}, log_dir, secret)

    def exited(self) -> Optional[str]:
        """'<name> rank R (pid) exited with code C; last lines of its log' for the first follower that exited."""
        for f in self.ranks:
            if f.poll() is not None:
                return f.exit_description(f"{self.name} rank {f.rank}", lines=20)
        return None

    def describe_failure(self, settle_s: float = 5.0) -> Optional[str]:
        """Why a collective failed, as far as the followers tell: the first that exited (rank, code, log tail), or
        the ranks that still run (then they went silent)."""
        # a killed peer may close its sockets a moment before its exit is seen
        wait_for(lambda: any(f.poll() is not None for f in self.ranks), settle_s)
        return self.exited() or (f"{self.name} ranks {[f.rank for f in self.ranks]} are alive but did not answer a "
                                 f"collective (hung, or slower than the collective timeout)")

    def stop(self) -> dict[int, Optional[int]]:
        return {f.rank: f.stop() for f in self.ranks}
