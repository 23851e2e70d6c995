"""The actor on several nodes: node groups, started, watched and deleted by the run's controller (the flow run, or
`rlhf train`).

With `deploy.actor.nnodes` = N > 1 the actor runs as N node groups, each one torchrun of `nproc_per_node` ranks. Node
group 0's rank 0 runs the run (components/runs.py) and the other ranks follow its commands, as on one node. Where the
groups run is a backend of this protocol:
- `LocalNodes` (this module): N torchrun processes on this machine over loopback, each given the environment JobSet
  gives its pods (JOBSET_NAME, REPLICATED_JOB_NAME, JOB_INDEX, JOB_COMPLETION_INDEX; rank 0's address), so CI runs
  the multi-node code;
- `JobSetNodes` (components/cluster/jobset.py): one JobSet (jobset.x-k8s.io/v1alpha2) created through the Kubernetes
  API, one replicated job of N pods, queued in Kueue so its pods are admitted together or not at all.

Both restart the whole set of groups after a failure, at most `NodeSpec.max_restarts` times (JobSet's
`failurePolicy.maxRestarts`); each attempt resumes from the run's last checkpoint. The controller deletes the groups
in a `finally` (and, on Kubernetes, owner references delete them with the controller's pod).

This file is the seam between the two backends: the dataclasses and the protocol below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol

Phase = Literal["pending", "running", "succeeded", "failed"]

# the environment JobSet's controller gives every pod (sigs.k8s.io/jobset: pkg/constants), which LocalNodes gives its
# node groups too
JOBSET_ENV = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX")
NODE_JOB = "node"  # the replicated job's name: node group i is pod <jobset>-node-0-<i>


@dataclass(frozen=True)
class NodeSpec:
    """What every node group runs: torchrun with these ranks, then `command` (argv after torchrun's own arguments),
    in `env` (the same on every group; never a secret: it is visible in the pod's spec)."""

    name: str  # a DNS-1035 label: the JobSet's name (and the local groups' log prefix)
    nnodes: int
    nproc_per_node: int
    master_port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0


@dataclass(frozen=True)
class NodeStatus:
    phase: Phase
    restarts: int = 0  # attempts restarted so far
    message: str = ""  # why (pending: what it waits for; failed: the group that failed, its exit code and log tail)
    failed_group: Optional[int] = None


class NodeGroups(Protocol):
    spec: NodeSpec

    def start(self) -> None:
        """Create the groups (not waited for)."""

    def status(self) -> NodeStatus:
        """Where the groups are now; `failed` only once the restarts are spent."""

    def logs(self, group: int, lines: int = 50) -> str:
        """The last lines of a group's output (its rank-0 process's on Kubernetes: the pod's log)."""

    def delete(self) -> None:
        """Stop and remove every group (idempotent): nothing of them is left running."""
