"""The run's controller: with the actor on several nodes (`deploy.actor.nnodes` > 1), `rlhf train` or the training
flow run is not a rank of the actor but the run's controller (components/runs.train hands the run to `control`):

    hold the run's lease (one writer per run name) for all its attempts
    hand the run over through the run's store (control/handoff.json: the config, the lease's holder id, who runs it;
        the run's reward files stored there too), never through a local directory: the node groups share nothing
        else with this process or with each other
    start the node groups where deploy.actor.launch says (components/launch/nodes.py: LocalNodes, or a JobSet), each
        rank running `python -m components.runs --store URI`: node group 0's rank 0 runs the run, the others follow
    watch them: relay node group 0's rank 0's messages, tables and progress to this process's steps (the flow run's
        log and artifacts, or the console), say every ~30 s what the groups wait for (pods pending, Kueue admission),
        and say each restart of the whole set (the groups restart it themselves, at most deploy.actor.max_restarts
        times, each attempt resuming from the run's last checkpoint)
    return the run's summary, which node group 0's rank 0 writes to the store (control/result.json)
    delete the groups on the way out, whatever happened (success, failure, cancellation)

The relay: rank 0's steps (`RelaySteps`) print each message, table and progress as one line
`rlhf-relay <controller's token>.<attempt id> <n> <json>` in its output, which the groups' logs keep (a pod's log on
Kubernetes); the controller reads the last lines of node group 0's log every second and passes each line of its own
token on once, in order (`Relay`): an earlier run's lines in the same log are not its own.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from components.cluster.jobset import JobSetNodes
from components.launch.nodes import LocalNodes, NodeGroups, NodeSpec, NodeStatus
from components.launch.processes import free_port
from components.launch.followers import BACKEND_ENV, TIMEOUT_ENV
from components.serving.auth import ranks_secret
from components.storage.store import CheckpointStore
from components.storage.lease import acquire as acquire_lease
from components.tracking.run import checkpoint_uri, default_tracking_uri, store_reward_files
from models import distributed
from models.config import RLHFConfig, merge, run_name_for
from models.loop import Steps

HANDOFF, RESULT = "control/handoff.json", "control/result.json"  # keys in the run's store
RELAY = "rlhf-relay"
RELAY_LINE = re.compile(rf"{RELAY} ([0-9a-f]+)\.([0-9a-f]+) (\d+) (.*)$")
RELAY_LINES = 500  # lines of node group 0's log read per look: far more than rank 0 says in a second
JOBSET_PORT = 29500  # rank 0's rendezvous port in a JobSet's pods (each pod has its own network namespace)
POLL_S, REPORT_S = 1.0, 30.0


class NodesFailed(RuntimeError):
    """The run's node groups failed and their restarts are spent; the message names the group and why."""


def controls(cfg: RLHFConfig) -> bool:
    """Whether this process is the run's controller: the actor is on several nodes and this process is no rank (a
    process torchrun started, as the actor's pods once did, is rank 0 of the run itself)."""
    return cfg.deploy.actor.nnodes > 1 and not distributed.from_env().active


def control(cfg: RLHFConfig, steps: Steps) -> dict:
    """Run the prepared config `cfg` on its node groups, from start (or resume) to its summary."""
    name = run_name_for(cfg)
    actor = cfg.deploy.actor
    base = cfg.deploy.checkpoint.uri or (cfg.resolved_state_dir() / "checkpoints").as_uri()
    tracking = default_tracking_uri(cfg)
    if actor.launch == "jobset":
        shared_by_pods(base, tracking)
    store = CheckpointStore.from_uri(checkpoint_uri(cfg, name), s3_endpoint_url=cfg.deploy.checkpoint.s3_endpoint_url)
    tags = steps.tags()
    lease = acquire_lease(store, name, timeout_s=cfg.deploy.checkpoint.lease_timeout_s, log=steps.log,
                          flow_run_id=tags.get("prefect.flow_run_id") or None, what=f"run_name={name!r}")
    try:
        store.fence(lease.token)  # every attempt's rank 0 commits under this lease's token only
        cfg, _ = store_reward_files(cfg, store)  # a reward file on this machine only reaches rank 0 through the store
        handed = merge(cfg, {"run_name": name, "deploy.state_dir": None, "deploy.checkpoint.uri": base,
                             "deploy.tracking.uri": tracking})  # a node's state directory is its own
        token = secrets.token_hex(4)
        store.put_json(HANDOFF, {"config": handed.model_dump(mode="json"), "lease_holder": lease.holder.id,
                                 "tags": tags, "relay": token})
        store.put_json(RESULT, {"state": "pending"})
        spec = node_spec(cfg, name, store.uri)
        nodes = node_groups(spec, cfg, cfg.resolved_state_dir() / "runs" / name, ranks_secret())
        try:
            steps.log(f"run {name}: the actor on {actor.nnodes} node groups x {actor.nproc_per_node} rank(s) "
                      f"({actor.launch} {spec.name}, up to {actor.max_restarts} restart(s)); this process controls "
                      f"them, node group 0's rank 0 runs the run")
            steps("start-actor-nodes", nodes.start)
            return watch(nodes, store, steps, Relay(steps, token))
        finally:
            nodes.delete()
            steps.log(f"actor node groups {spec.name} deleted")
    finally:
        lease.release()


def shared_by_pods(checkpoints: str, tracking: str) -> None:
    """On Kubernetes the node groups are pods that share no disk with the controller: the run's store and its MLflow
    must be reachable over the network."""
    if not checkpoints.startswith("s3://"):
        raise ValueError(f"deploy.checkpoint.uri: {checkpoints} is a local directory; with deploy.actor.launch=jobset "
                         f"the node groups' pods reach the run's store over the network: an s3:// URI")
    if not tracking.startswith(("http://", "https://", "databricks")):
        raise ValueError(f"deploy.tracking.uri: {tracking} is local to this pod; with deploy.actor.launch=jobset rank "
                         f"0 logs from another pod: an MLflow server's http(s) URI")


def spec_name(run_name: str) -> str:
    """A DNS-1035 label for the node groups of `run_name` (a JobSet's name: its pods' hostnames derive from it),
    unique per run name: 'rlhf-' + the name's first letters and digits + a digest of the whole name."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:20].strip("-")
    return f"rlhf-{slug + '-' if slug else ''}{hashlib.sha256(run_name.encode()).hexdigest()[:6]}"


def node_spec(cfg: RLHFConfig, name: str, store_uri: str) -> NodeSpec:
    """What every node group runs: torchrun with the actor's ranks, each rank `python -m components.runs --store
    <the run's store>` (rank 0 reads the hand-off there). `rlhf cluster manifests` builds it too, before any run."""
    actor = cfg.deploy.actor
    # torchrun's agents at the port, the ranks' own rendezvous at the next one (models/distributed.rendezvous_address)
    port = actor.master_port or (JOBSET_PORT if actor.launch == "jobset" else free_port("127.0.0.1", 0, count=2))
    endpoint = cfg.deploy.checkpoint.s3_endpoint_url
    command = ["-m", "components.runs", "--store", store_uri] + (["--s3-endpoint-url", endpoint] if endpoint else [])
    return NodeSpec(spec_name(name), actor.nnodes, actor.nproc_per_node, port, command,
                    {BACKEND_ENV: actor.backend, TIMEOUT_ENV: str(actor.collective_timeout_s)}, actor.max_restarts)


def node_groups(spec: NodeSpec, cfg: RLHFConfig, local_dir: Path, secret: str) -> NodeGroups:
    """The node groups of `spec` where deploy.actor.launch says: on this machine (their logs and state directories in
    the run's local directory), or as a JobSet; every group given the run's `secret`, which its ranks prove."""
    if cfg.deploy.actor.launch == "local":
        return LocalNodes(spec, local_dir / "logs", local_dir / "nodes", secret)
    return JobSetNodes.for_run(spec, cfg, secret)


def watch(nodes: NodeGroups, store: CheckpointStore, steps: Steps, relay: "Relay", poll_s: float = POLL_S,
          report_s: float = REPORT_S) -> dict:
    """Follow the node groups to their end: relay rank 0, say what they wait for and each restart; the run's summary
    once they succeeded, NodesFailed naming the group and why once they failed for good."""
    restarts, started = 0, time.monotonic()
    said, running = 0.0, False
    while True:
        status = nodes.status()
        relay.take(nodes.logs(0, RELAY_LINES))
        if status.restarts > restarts:
            restarts, running = status.restarts, False
            steps.log(f"actor attempt {restarts} failed: {status.message}\nrestarting every node group from the "
                      f"run's last checkpoint (restart {restarts} of {nodes.spec.max_restarts})")
        waited = time.monotonic() - started
        if status.phase == "pending" and (not said or waited - said >= report_s):
            said = waited
            steps.log(f"waiting for the actor's {nodes.spec.nnodes} node groups: {status.message} ({waited:.0f} s)")
        elif status.phase == "running" and not running:
            running = True
            steps.log(f"actor node groups running (attempt {restarts + 1}, {waited:.0f} s after the start)")
        elif status.phase == "succeeded":
            relay.take(nodes.logs(0, RELAY_LINES))
            result = store.get_json(RESULT) or {}
            if result.get("state") != "succeeded":
                raise NodesFailed(f"the actor's node groups succeeded, but rank 0 left no summary in "
                                  f"{store.uri}/{RESULT} ({result.get('state', 'nothing')})")
            return result["summary"]
        elif status.phase == "failed":
            relay.take(nodes.logs(0, RELAY_LINES))
            raise NodesFailed(failure(status, store))
        time.sleep(poll_s)


def failure(status: NodeStatus, store: CheckpointStore) -> str:
    """Why the node groups failed, first line first: rank 0's own error when node group 0 failed with one."""
    after = f" after {status.restarts} restart(s)" if status.restarts else ""
    result = store.get_json(RESULT) or {}
    if status.failed_group == 0 and result.get("state") == "failed":
        return f"actor node group 0 failed{after}: {result['error']}\n{status.message}"
    return f"actor node groups failed{after}: {status.message or 'no reason given'}"


# ---------------------------------------------------------------- rank 0's side: the hand-off, the result, the relay

def handoff(store: CheckpointStore) -> dict:
    """What the controller handed over: {config, lease_holder, tags}."""
    handed = store.get_json(HANDOFF)
    if handed is None:
        raise FileNotFoundError(f"{store.uri}/{HANDOFF}: no run handed over (node groups start from `rlhf train` or a "
                                f"training flow run with deploy.actor.nnodes > 1)")
    return handed


def report(store: CheckpointStore, state: str, **fields) -> None:
    """Rank 0's result for the controller: running, succeeded (with the summary), failed (with the error)."""
    store.put_json(RESULT, {"state": state, **fields})


class RelaySteps(Steps):
    """Rank 0's steps in a node group: each step runs here; each message, table and progress is a relay line of
    its output, which the controller passes to its own steps (the flow run's log and artifacts, the console). The
    run's record is tagged with the controller's `tags` (its flow run)."""

    def __init__(self, token: str, tags: Optional[dict] = None, out=None):
        self.source, self.count = f"{token}.{secrets.token_hex(3)}", itertools.count()
        self._tags, self.out, self._lock = dict(tags or {}), out, threading.Lock()

    def send(self, event: dict) -> None:
        with self._lock:
            line = f"{RELAY} {self.source} {next(self.count)} {json.dumps(event, default=str)}"
            print(line, file=self.out or sys.stdout, flush=True)

    def log(self, message: str) -> None:
        self.send({"log": message})

    def table(self, key: str, rows: list[dict], description: str) -> None:
        self.send({"table": {"key": key, "rows": rows, "description": description}})

    def progress(self, done: int, total: int, what: str) -> None:
        self.send({"progress": [done, total, what]})

    def tags(self) -> dict[str, str]:
        return dict(self._tags)


class Relay:
    """The relay lines of `token` in rank 0's output to `steps`, each once and in order (a look sees the last lines
    again); one that went missing (more lines than a look reads, or a line cut by another rank's output) is said."""

    def __init__(self, steps: Steps, token: str):
        self.steps, self.token = steps, token
        self.seen: dict[str, int] = {}  # attempt id -> the last line number passed on

    def take(self, text: str) -> None:
        for line in text.splitlines():
            found = RELAY_LINE.search(line)
            if found is None or found.group(1) != self.token:
                continue
            source, n = found.group(2), int(found.group(3))
            last = self.seen.get(source, -1)
            if n <= last:
                continue
            try:
                event = json.loads(found.group(4))
            except ValueError:
                continue
            if n > last + 1:
                self.steps.log(f"({n - last - 1} message(s) of node group 0 were not relayed: see its log)")
            self.seen[source] = n
            self.dispatch(event)

    def dispatch(self, event: dict) -> None:
        try:
            if "log" in event:
                self.steps.log(event["log"])
            elif "table" in event:
                self.steps.table(**event["table"])
            elif "progress" in event:
                self.steps.progress(*event["progress"])
        except Exception as exc:  # noqa: BLE001 - a UI that hiccuped must not end the run: said, and the run goes on
            self.steps.log(f"could not relay {sorted(event)} of node group 0: {type(exc).__name__}: {exc}")
