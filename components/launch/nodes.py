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
`failurePolicy.maxRestarts`); each attempt resumes from the run's last checkpoint. A group whose exit code is
NO_RESTART_EXIT_CODE (its rank 0 met a failure a restart cannot mend) fails the set at once. The controller deletes
the groups in a `finally` (and, on Kubernetes, owner references delete them with the controller's pod).

Every node group runs the same command, `node_argv(spec)`: this module's `main`, which starts torchrun for its node
(its node rank from JOB_COMPLETION_INDEX, rank 0's address from MASTER_ADDR or else JobSet's DNS name, waited for
until it resolves) with `spec.command` after it, and passes on the exit code of the first rank that failed. Every
group is given the run's secret, which its ranks prove to each other (models/rendezvous.py), never in `spec` (a pod's
spec is readable): in a local group's environment, in a JobSet's pods as a mounted Secret. The ranks meet through
rank 0's own store at MASTER_PORT + 1 (models/distributed.rendezvous_address), listening on rank 0's address alone;
torchrun's agents keep theirs at MASTER_PORT.

This file is the seam between the two backends: the dataclasses and the protocol below (and `node_argv`).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Protocol

from components.launch.followers import SECRET_ENV
from components.launch.processes import (PARENT_PID_ENV, ChildProcess, exit_with_parent, project_env, signal_group,
                                         wait_for)

Phase = Literal["pending", "running", "succeeded", "failed"]

# the environment JobSet's controller gives every pod (sigs.k8s.io/jobset: pkg/constants), which LocalNodes gives its
# node groups too
JOBSET_ENV = ("JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX")
NODE_JOB = "node"  # the replicated job's name: node group i is pod <jobset>-node-0-<i>
NO_RESTART_EXIT_CODE = 78  # a rank's exit code for a failure no restart mends (sysexits' EX_CONFIG): fail the set now
NODE_CPUS_ENV = "RLHF_NODE_CPUS"  # a local group's share of this machine's cores (a pod has its own node's)
STATE_DIR_ENV = "RLHF_STATE_DIR"  # as models/sections.py: each local group gets a state directory of its own
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # what torchrun sets: never inherited by a group (torchrun sets it)


@dataclass(frozen=True)
class NodeSpec:
    """What every node group runs: torchrun with these ranks, then `command` (argv after torchrun's own arguments),
    in `env` (the same on every group; never a secret: it is visible in the pod's spec). The ranks use
    `master_port` (torchrun's agents) and `master_port` + 1 (the ranks' own rendezvous)."""

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


# ---------------------------------------------------------------- what every node group runs

def node_argv(spec: NodeSpec, python: str = sys.executable) -> list[str]:
    """The command of every node group (a LocalNodes child, a JobSet pod's container): `main` below with the ranks
    of `spec`, then `spec.command`. The node's own place comes from its environment (JOBSET_ENV, MASTER_ADDR)."""
    return [python, "-m", "components.launch.nodes", "--nnodes", str(spec.nnodes), "--nproc-per-node",
            str(spec.nproc_per_node), "--master-port", str(spec.master_port), "--", *spec.command]


def rank0_address(env=os.environ) -> str:
    """Where node group 0's rank 0 listens: MASTER_ADDR when set (LocalNodes: loopback), else pod 0 of the JobSet's
    replicated job in the JobSet's own DNS (its headless Service): <jobset>-<job>-<job index>-0.<jobset>."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    name = env["JOBSET_NAME"]
    return f"{name}-{env['REPLICATED_JOB_NAME']}-{env['JOB_INDEX']}-0.{name}"


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except OSError:
        return False


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m components.launch.nodes --nnodes N --nproc-per-node P --master-port PORT -- COMMAND...`: this
    node group's torchrun (static rendezvous at rank 0's address, no restarts of its own: the set restarts whole).
    A local group dies with its controller ($RLHF_PARENT_PID) and its ranks with it; its cores are $RLHF_NODE_CPUS."""
    parser = argparse.ArgumentParser(description="one node group of the actor: torchrun for this node")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--resolve-timeout-s", type=float, default=600.0,
                        help="How long rank 0's name may take to resolve (JobSet's DNS records can lag the pods).")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    exit_with_parent()  # a local group: gone within seconds of its controller, ranks and all
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the ranks are torchrun's children: they watch this process
    if os.environ.get(NODE_CPUS_ENV):
        os.sched_setaffinity(0, {int(c) for c in os.environ[NODE_CPUS_ENV].split(",")})
    master, node_rank = rank0_address(), int(os.environ.get("JOB_COMPLETION_INDEX", "0"))
    if not wait_for(lambda: resolves(master), args.resolve_timeout_s, poll_s=1.0):
        print(f"node group {node_rank}: rank 0's address {master} did not resolve within "
              f"{args.resolve_timeout_s:.0f}s", file=sys.stderr, flush=True)
        return 1
    from torch.distributed.elastic.multiprocessing.api import SignalException  # heavy: torch, in the node only
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # heavy: as above
    from torch.distributed.run import main as torchrun  # heavy: as above

    try:
        torchrun([f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}", f"--node-rank={node_rank}",
                  f"--master-addr={master}", f"--master-port={args.master_port}", "--max-restarts=0", *command])
    except ChildFailedError as exc:
        code = exc.get_first_failure()[1].exitcode
        return code if 0 < code < 256 else 1  # a signal (killed): a failure a restart may mend
    except SignalException as exc:  # stopped (SIGTERM): torchrun stopped its ranks
        return 128 + int(exc.sigval)
    return 0


# ---------------------------------------------------------------- node groups on this machine

def tail(path: Path, lines: int, block: int = 1 << 16) -> str:
    """The last `lines` lines of the file at `path`, reading blocks from its end until they hold that many."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            data, start = b"", end
            while start > 0 and data.count(b"\n") <= lines:
                start = max(0, start - block)
                f.seek(start)
                data = f.read(end - start)
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def core_share(group: int, groups: int, cores: list[int]) -> list[int]:
    """Group `group`'s cores of `cores` (as pods have their own): every groups-th core from its index; a core of its
    own at least (shared round-robin when there are more groups than cores)."""
    return cores[group::groups] or [cores[group % len(cores)]]


class LocalNodes:
    """`NodeGroups` on this machine: group i is `node_argv(spec)` as a child process in a process group of its own
    (torchrun's agent and its ranks), with the environment JobSet gives pod i (rank 0's address: loopback), a state
    directory of its own (`state_dir/<i>`: the groups share nothing but the run's store, as pods do), its share of
    this machine's cores, the run's `secret` in its environment, and its output in `log_dir/node-<i>.log`. The first
    group to fail stops every group, and the
    set is started again, at most `spec.max_restarts` times (JobSet's failurePolicy): `status()` does it when it sees
    the failure. A group dies with this process (exit_with_parent), so a killed controller leaves nothing."""

    def __init__(self, spec: NodeSpec, log_dir: Path, state_dir: Path, secret: str, grace_s: float = 20.0):
        self.spec, self.log_dir, self.state_dir, self.grace_s = spec, Path(log_dir), Path(state_dir), grace_s
        self.secret = secret
        self.groups: list[ChildProcess] = []
        self.restarts = 0
        self.exits: list[tuple[int, int]] = []  # (group, exit code) of the current attempt, in the order they exited
        self.last_restart: Optional[tuple[int, str]] = None  # (group, why) of the last restart
        self.final: Optional[NodeStatus] = None
        self._lock = threading.Lock()

    def log_path(self, group: int) -> Path:
        return self.log_dir / f"node-{group}.log"

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        cores = sorted(os.sched_getaffinity(0))
        base = {k: v for k, v in project_env(self.spec.env).items() if k not in RANK_ENV}
        self.exits, self.groups = [], []
        for i in range(self.spec.nnodes):
            env = {**base, "JOBSET_NAME": self.spec.name, "REPLICATED_JOB_NAME": NODE_JOB, "JOB_INDEX": "0",
                   "JOB_COMPLETION_INDEX": str(i), "MASTER_ADDR": "127.0.0.1", PARENT_PID_ENV: str(os.getpid()),
                   STATE_DIR_ENV: str(self.state_dir / str(i)), SECRET_ENV: self.secret,
                   NODE_CPUS_ENV: ",".join(map(str, core_share(i, self.spec.nnodes, cores)))}
            group = ChildProcess(node_argv(self.spec), self.log_path(i), env)
            self.groups.append(group)
            threading.Thread(target=self._watch, args=(group, i), daemon=True, name=f"node-{i}").start()

    def _watch(self, group: ChildProcess, index: int) -> None:
        code = group.popen.wait()
        with self._lock:
            if index < len(self.groups) and self.groups[index] is group:  # not a group of an earlier attempt
                self.exits.append((index, code))

    def status(self) -> NodeStatus:
        with self._lock:
            if self.final is not None:
                return self.final
            if not self.groups:
                return NodeStatus("pending", message="not started")
            failed = next(((i, code) for i, code in self.exits if code != 0), None)
            if failed is not None:
                group, code = failed
                why = self.groups[group].exit_description(f"node group {group}", lines=30)
                self._stop()
                if code == NO_RESTART_EXIT_CODE or self.restarts >= self.spec.max_restarts:
                    self.final = NodeStatus("failed", self.restarts, why, group)
                    return self.final
                self.restarts += 1
                self.last_restart = (group, why)
                self._start()
            elif len(self.exits) == self.spec.nnodes:
                self.final = NodeStatus("succeeded", self.restarts)
                return self.final
            group, why = self.last_restart or (None, "")
            return NodeStatus("running", self.restarts, why, group)

    def logs(self, group: int, lines: int = 50) -> str:
        """The last `lines` lines of group `group`'s output, read from the end of its log (it grows with the run)."""
        return tail(self.log_path(group), lines)

    def _stop(self) -> None:
        """SIGTERM to every group at once (each gets the whole grace period: a cancelled flow run has 30 s), then
        wait for each, SIGKILL after the grace period."""
        for group in self.groups:
            if group.poll() is None:
                signal_group(group.pid, signal.SIGTERM)
        for group in self.groups:
            group.stop(self.grace_s)

    def delete(self) -> None:
        with self._lock:
            self._stop()
            if self.final is None and self.groups:
                self.final = NodeStatus("failed", self.restarts, "deleted", None)


if __name__ == "__main__":
    sys.exit(main())
