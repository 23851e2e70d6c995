"""launch=kubernetes: a server kind of the run as a LeaderWorkerSet the run creates on its cluster
(components/cluster/servers.py: KubeServers, a StartedServer), its pods looked at through the same probes as a local
server's (components/serving/launcher.py).

The pods hold the run's secret from a Kubernetes Secret of the run; a critic uploads each save to the run's
checkpoint store and starts from the critic of the checkpoint the run resumes (components/serving/pod.py); a rollout
server sets up weight transfers with this pod's address only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from components.cluster.servers import KubeServers, start_servers
from components.serving.launcher import advertised_host, probe_at
from models.config import RLHFConfig

if TYPE_CHECKING:  # an annotation only
    from components.tracking.run import RunPlace


def start(kind: str, cfg: RLHFConfig, place: RunPlace, secret: str) -> KubeServers:
    """`kind`'s servers for this run as a LeaderWorkerSet (not waited for), owned by the Job this process runs in."""
    args = {}
    if kind == "critic":
        args = {"checkpoint_uri": place.store_uri, "restore_iteration": place.critic_restore_iteration}
    if kind == "rollout":
        args = {"trainer_host": advertised_host()}
    return start_servers(kind, cfg, secret, probe_at(kind, cfg, secret), place.run_name, **args)
