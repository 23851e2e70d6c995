"""What every started server of a run answers, however it was launched: a `StartedServer`.

A server kind of the run (critic, reward, rollout) starts where its section's `launch` says, one module per mode:
- `local` (components/serving/local.py): child processes of the run, one per replica;
- `kubernetes` (components/serving/kubernetes.py, over components/cluster/servers.py): a LeaderWorkerSet the run
  creates on its cluster, one pod per replica, owned by the run's Job.
(`in_process`, for a critic or a reward, is no server: the model runs in the actor's rank 0.)

The run (components/serving/services.py) waits until it is ready, asks it why it cannot serve after a failed step,
and stops it at the end, without knowing how it was launched.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

from components.launch.processes import Health
from models.config import RLHFConfig


@runtime_checkable
class StartedServer(Protocol):
    """One server kind of a run, started (not yet waited for): `replicas` servers answering as one."""

    name: str  # its kind: critic, reward or rollout

    @property
    def urls(self) -> list[str]:
        """Every replica's URL (one for a critic or a reward server)."""

    @property
    def url(self) -> str:
        """The first replica's URL."""

    def wait_until_ready(self, timeout: float, report: Optional[Callable[[str], None]] = None) -> Health:
        """Until every replica serves, within one `timeout` for all; what it answered. Raises ServerNotReady naming
        what was seen last (at once when a replica ends first); `report` is told every ~30 s what is awaited."""

    def death(self) -> Optional[str]:
        """Why it cannot serve (a replica exited or was restarted, or answers unhealthy), naming the replica, its exit
        code and its log tail; None while it serves."""

    def stop(self, grace_s: float) -> str:
        """Stop every replica, `grace_s` to stop by itself before it is killed; returns how it ended. Nothing of it is
        left after; safe to call twice."""

    def describe(self) -> str:
        """Where it runs, for the run's log."""


def section(kind: str, cfg: RLHFConfig):
    """The deployment section of a server kind: its launch mode, host, port, timeouts."""
    return {"critic": cfg.deploy.critic, "reward": cfg.deploy.reward, "rollout": cfg.deploy.rollout}[kind]
