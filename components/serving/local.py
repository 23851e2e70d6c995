"""launch=local: a server kind of the run as child processes of this one (components/launch/processes.ServerProcess;
components/serving/launcher.py says how each kind starts and is probed).

Each process runs in a process group of its own, stopped with its run, and exits with its parent
(processes.exit_with_parent: a SIGKILLed run leaves no server behind). A critic or a reward server is one process;
the rollout server is one per replica (`deploy.rollout.replicas`, each on its own port, logging to
rollout-server-<i>.log). Together they are one StartedServer (components/serving/started.py): ready when every
replica serves, dead when one is (named: 'rollout server replica 1 (pid, url) exited ...'), stopped together.

A server pod of a cluster run (components/serving/pod.py) starts its server through `local_server` too: the same
launcher, ports, probes and checks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from components.launch.processes import Health, ServerProcess, free_port
from components.serving.launcher import launch, launch_rollout
from components.serving.started import section
from components.serving.triton.contract import ServerSpec
from models.config import RLHFConfig

if TYPE_CHECKING:  # an annotation only: a server pod runs no run's record
    from components.tracking.run import RunPlace


def _threads(placement) -> Optional[int]:
    """One torch thread for a server on a CPU-only host unless configured: it usually shares the cores with the
    actor."""
    if placement.torch_threads:
        return placement.torch_threads
    return 1 if not torch.cuda.is_available() else None


def server_spec(kind: str, cfg: RLHFConfig, **fields) -> ServerSpec:
    """The spec of a critic/reward server: its section's host, a free port, its thread count."""
    s = section(kind, cfg)
    return ServerSpec(kind=kind, config=cfg, host=s.host, port=free_port(s.host, s.port),
                      torch_threads=_threads(s), **fields)


def local_server(kind: str, cfg: RLHFConfig, log_path: Path, secret: str, trainer_host: Optional[str] = None,
                 replica: Optional[int] = None, **spec_fields) -> ServerProcess:
    """The `kind` server as a child process of this one (not waited for), holding the run's `secret`; a rollout
    server sets up weight transfers with `trainer_host` only (None: this machine), `replica` its index among the
    run's replicas; `spec_fields` for a critic (checkpoint_dir, checkpoint_uri, restore_iteration)."""
    if kind == "rollout":
        return launch_rollout(cfg, log_path, secret=secret, trainer_host=trainer_host or "127.0.0.1", replica=replica)
    return launch(server_spec(kind, cfg, **spec_fields), log_path, wait=False, secret=secret)


class LocalServers:
    """One server kind of the run as child processes of this one (see the module's docstring)."""

    def __init__(self, name: str, processes: list[ServerProcess]):
        self.name, self.processes = name, processes

    @property
    def urls(self) -> list[str]:
        return [process.url for process in self.processes]

    @property
    def url(self) -> str:
        return self.processes[0].url

    def wait_until_ready(self, timeout: float, report: Optional[Callable[[str], None]] = None) -> Health:
        """Wait for each replica in turn, within one `timeout` for all (they start together); what each answered
        (the one replica's answer for a single server)."""
        deadline = time.monotonic() + timeout
        seen = [p.wait_until_ready(max(1.0, deadline - time.monotonic()), report) for p in self.processes]
        if len(seen) == 1:
            return seen[0]
        return Health(True, "ready", info={p.title: health.info for p, health in zip(self.processes, seen)})

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """Why a replica cannot serve (the first that cannot, named), else None."""
        return next((why for process in self.processes if (why := process.death(settle_s))), None)

    def stop(self, grace_s: float) -> str:
        """SIGTERM to each replica's process group, SIGKILL after `grace_s`; says how each ended."""
        return "; ".join(f"{p.title} (pid {p.pid}): exit code {p.stop(grace_s)}" for p in self.processes)

    def describe(self) -> str:
        return "; ".join(f"{p.title}: pid {p.pid}, {p.url}, log {p.log_path}" for p in self.processes)


def start(kind: str, cfg: RLHFConfig, place: RunPlace, secret: str) -> LocalServers:
    """`kind`'s servers for this run as child processes (not waited for), holding the run's `secret`: a critic saves
    into the run's critic directory; the rollout server's `deploy.rollout.replicas`, each logging to a file of its
    own. What started is stopped again when one fails to start."""
    count = cfg.deploy.rollout.replicas if kind == "rollout" else 1
    fields = {"checkpoint_dir": str(place.critic_dir)} if kind == "critic" and place.critic_dir else {}
    processes: list[ServerProcess] = []
    try:
        for i in range(count):
            log = place.log_dir / (f"{kind}-server.log" if count == 1 else f"{kind}-server-{i}.log")
            processes.append(local_server(kind, cfg, log, secret, replica=i if count > 1 else None, **fields))
    except BaseException:
        LocalServers(kind, processes).stop(0.0)
        raise
    return LocalServers(kind, processes)
