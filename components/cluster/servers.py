"""launch=kubernetes: a server kind of the run as one LeaderWorkerSet of `replicas` server pods the run creates
through the API, found through the LeaderWorkerSet's own headless Service (components/cluster/objects.py), and
answering what every started server of a run answers (a StartedServer: components/serving/started.py): `urls`,
`wait_until_ready(timeout)`, `death()`, `stop(grace_s)`, `describe()`.

Ready means both: each replica's pod runs and passes its readiness probe (Kubernetes' view), and our own probe of
the replica's URL answers healthy (the run's view, through the NetworkPolicies and with the run's secret). While it
waits, it says what for: Kueue admission (the pods' scheduling gate), a node (unschedulable: the autoscaler brings
one up), the image pull, the model loading. A pod whose container exited or restarted is a dead server (a restarted
critic or rollout server lost its state): the run fails naming the replica, its pod, its exit code and its log
tail. `stop()` deletes the LeaderWorkerSet and the Secret; both are also owned by the Job the run runs in, so
Kubernetes deletes them with it if the run dies first: no lease to watch, nothing to poll.

The servers hold the run's secret from a Kubernetes Secret of the run (mounted into their pods, never in a spec), and
take traffic from the run's own pods only (its NetworkPolicies: components/cluster/network_policy.py). A critic
uploads each save to the run's checkpoint store (the next checkpoint adopts it), and a resumed run tells it which
iteration's critic to start from (components/serving/pod.py).
"""

from __future__ import annotations

import os
import secrets as _secrets
import time
from typing import Callable, Optional

from components.cluster.jobset import pod_wait
from components.cluster.kube import Kube
from components.cluster.network_policy import RUN_POLICIES, own_job
from components.cluster.objects import RunIdentity, Site, server_objects, server_replicas, server_urls
from components.launch.processes import Health, Probe, ServerNotReady, wait_for, wait_until_ready
from models.config import RLHFConfig

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"


def pod_death(pod: dict) -> Optional[str]:
    """How a server pod's container ended or restarted ('exited with code C (reason)', restarts), else None."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        ended = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get("terminated")
        restarts = status.get("restartCount") or 0
        if ended or restarts:
            code = f"exited with code {ended.get('exitCode')}" \
                + (f" ({ended['reason']})" if ended.get("reason") else "") \
                if ended else "was restarted"
            return f"{code}" + (f", restarted {restarts} time(s)" if restarts else "")
    if (pod.get("status") or {}).get("phase") == "Failed":
        return f"failed: {pod['status'].get('reason')}: {pod['status'].get('message')}"
    return None


def pod_ready(pod: dict) -> bool:
    """Whether the pod's Ready condition is True (its readiness probe passes)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


class KubeServers:
    """One server kind of the run as a LeaderWorkerSet (see the module's docstring)."""

    def __init__(self, kind: str, kube: Kube, objects: list[dict], urls: list[str],
                 probe_for: Callable[[str], Probe], policies=None):
        self.name, self.kube, self.objects, self.urls = kind, kube, objects, urls
        self.url = urls[0]
        self.lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")["metadata"]["name"]
        self.probes = [probe_for(url) for url in urls]
        self.policies, self.created = policies, []
        self.poll_s = 2.0  # how often readiness looks at the pods and the servers

    def start(self) -> None:
        """Create the Secret, then the LeaderWorkerSet (undone if one fails)."""
        try:
            for obj in self.objects:
                self.kube.create(obj)
                self.created.append(obj)
        except BaseException:
            self.stop()
            raise

    def describe(self) -> str:
        return (f"LeaderWorkerSet {self.lws} ({len(self.urls)} replica(s), namespace {self.kube.namespace}): "
                f"{', '.join(self.urls)}")

    def _pods(self) -> dict[int, dict]:
        pods = {}
        for pod in self.kube.pods({LWS_LABEL: self.lws}):
            group = (pod["metadata"].get("labels") or {}).get(GROUP_LABEL)
            if group is not None and str(group).isdigit():
                pods[int(group)] = pod
        return pods

    def _dead(self, replica: int, pod: dict) -> Optional[str]:
        if not (how := pod_death(pod)):
            return None
        name = pod["metadata"]["name"]
        restarted = any(c.get("restartCount") for c in (pod.get("status") or {}).get("containerStatuses") or [])
        try:
            tail = self.kube.log(name, 30, previous=restarted)  # a restarted container: the one that ended
        except Exception as exc:  # noqa: BLE001 - the log is what we add, the death stands without it
            tail = f"(its log could not be read: {exc})"
        return (f"{self.name} server replica {replica} (pod {name}, {self.urls[replica]}) {how}; "
                f"last lines of its log:\n{tail}")

    def _replica_probe(self, replica: int) -> Probe:
        def probe() -> Health:
            pod = self._pods().get(replica)
            if pod is None:
                return Health(False, f"waiting for {self.lws} to create the pod of replica {replica}")
            if death := self._dead(replica, pod):
                raise ServerNotReady(death, "process_exited")
            if wait := pod_wait(pod):
                return Health(False, wait)
            if not pod_ready(pod):
                return Health(False, f"pod {pod['metadata']['name']} runs; its readiness probe has not passed yet")
            return self.probes[replica]()
        return probe

    def wait_until_ready(self, timeout: float, report: Optional[Callable[[str], None]] = None) -> Health:
        """Every replica's pod runs and its server answers healthy; raises ServerNotReady naming what was seen last
        (one timeout for all: a cold pool's node start and image pull count); `report` is told every ~30 s what is
        awaited."""
        deadline = time.monotonic() + timeout
        health = Health(False, "not looked at yet")
        for replica, url in enumerate(self.urls):
            health = wait_until_ready(self._replica_probe(replica), max(1.0, deadline - time.monotonic()),
                                      f"{self.name} server replica {replica}", url, poll_s=self.poll_s, report=report)
        return health

    def death(self, settle_s: float = 20.0) -> Optional[str]:
        """Why a replica cannot serve (its LeaderWorkerSet is gone, a pod exited or restarted, or it answers
        unhealthy for `settle_s`), else None."""
        if self.kube.get(LWS_API, "LeaderWorkerSet", self.lws) is None:
            return f"{self.name} server: LeaderWorkerSet {self.lws} is gone (deleted outside the run)"
        pods = self._pods()
        for replica in range(len(self.urls)):
            if replica in pods and (death := self._dead(replica, pods[replica])):
                return death
        for replica, probe in enumerate(self.probes):
            if not probe().ok and not wait_for(lambda: probe().ok, settle_s, poll_s=1.0):
                return f"{self.name} server replica {replica} ({self.urls[replica]}) is not healthy: {probe().status}"
        return None

    def stop(self, grace_s: float = 0.0) -> str:
        """Delete what was created (the LeaderWorkerSet first: its pods go with it), then release the run's
        NetworkPolicies; says what was deleted. The pods get their own termination grace period (Kubernetes'), not
        `grace_s`."""
        deleted = [f"{obj['kind']} {obj['metadata']['name']}" for obj in reversed(self.created)]
        try:
            for obj in reversed(self.created):
                self.kube.delete(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])
            self.created = []
        finally:
            if self.policies is not None:
                self.policies.release()
                self.policies = None
        return f"deleted {', '.join(deleted)}" if deleted else "nothing left to delete"


def start_servers(kind: str, cfg: RLHFConfig, secret: str, probe_for: Callable[[str], Probe], run_name: str,
                  kube: Optional[Kube] = None, environ=os.environ, job: Optional[str] = None, **args) -> KubeServers:
    """Create `kind`'s LeaderWorkerSet for this run (not waited for): owned by and labelled as the Job this process
    runs in (`job`: found from its pod), with the run's NetworkPolicies; `args` for the server (checkpoint_uri,
    restore_iteration, trainer_host)."""
    kube = kube or Kube(cfg.deploy.cluster.namespace)
    job = job or own_job(environ)
    found = kube.get("batch/v1", "Job", job) if job else None
    owner = {"name": job, "uid": found["metadata"]["uid"]} if found else None
    identity = RunIdentity.of(run_name, _secrets.token_hex(4), run_label=job, owner=owner)
    site = Site.of(cfg.deploy.cluster, environ, kube.namespace)
    objects = server_objects(kind, cfg, site, identity, secret_value=secret, **args)
    policies = None
    if job:
        RUN_POLICIES.acquire(job)
        policies = RUN_POLICIES
    server = KubeServers(kind, kube, objects, server_urls(identity, kind, kube.namespace, server_replicas(kind, cfg)),
                         probe_for, policies)
    server.start()
    return server
