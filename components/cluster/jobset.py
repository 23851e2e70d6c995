"""`JobSetNodes`: the actor's node groups as one JobSet on the cluster (components/launch/nodes.py's `NodeGroups`).

The run's controller (its flow run's pod) creates the JobSet (components/cluster/objects.jobset) after the two
NetworkPolicies that let its node groups reach each other (components/cluster/network_policy.py: the node pods carry
the controller's rlhf/run) and the Secret its pods mount (the run's secret, which the ranks prove to each other),
watches it through `status()`, reads a failed group's log and deletes the JobSet, then the Secret and the policies,
in its `finally`; all are also owned by the controller's Job, so a deleted or cancelled flow run's pod takes them with
it. What `status()` reads:
- the JobSet's conditions: Completed (succeeded), Failed (failed: the failed node group named with its pod, its
  container's exit code and reason, and the last lines of its log), Suspended (Kueue has not admitted it yet: with
  the reason its Workload gives, e.g. not enough quota in the ClusterQueue);
- `status.restarts`: the attempts restarted so far (failurePolicy.maxRestarts bounds them: each attempt resumes
  from the run's last checkpoint);
- its pods, while it runs: what a pod that is not running waits for (unschedulable: the scheduler's message; an
  image pull; a container being created).
"""

from __future__ import annotations

import os
from typing import Optional

from components.cluster.kube import Kube
from components.cluster.network_policy import KubeAPI, RunPolicies, own_job
from components.cluster.objects import QUEUE_LABEL, RunIdentity, Site, jobset, nodes_secret
from components.launch.nodes import NodeSpec, NodeStatus
from models.config import RLHFConfig
from models.deploy import ClusterPlacement

API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def condition(obj: dict, kind: str) -> Optional[dict]:
    """The object's status condition of type `kind` when it is True."""
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind and c.get("status") == "True"), None)


def _index(pod: dict) -> Optional[int]:
    meta = pod.get("metadata") or {}
    value = (meta.get("labels") or {}).get(INDEX_LABEL) or (meta.get("annotations") or {}).get(INDEX_LABEL)
    return int(value) if value is not None and str(value).isdigit() else None


def _terminated(pod: dict) -> Optional[dict]:
    """The main container's terminated state (now or last), if it ended."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            if state.get("terminated"):
                return state["terminated"]
    return None


def pod_exit(pod: dict) -> Optional[str]:
    """'exited with code C (reason)' for a pod whose container ended other than with 0, else None."""
    ended = _terminated(pod)
    if ended and ended.get("exitCode", 0) != 0:
        return f"exited with code {ended['exitCode']}" + (f" ({ended['reason']})" if ended.get("reason") else "")
    status = pod.get("status") or {}
    if status.get("phase") == "Failed":
        return f"failed: {status.get('reason') or 'no reason given'}" + (f": {status['message']}"
                                                                         if status.get("message") else "")
    return None


def pod_wait(pod: dict) -> Optional[str]:
    """What a pod that does not run yet waits for (None when it runs or ended)."""
    status = pod.get("status") or {}
    name = pod["metadata"]["name"]
    if status.get("phase") in ("Running", "Succeeded", "Failed"):
        return None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"pod {name} is not scheduled: {cond.get('reason')}: {cond.get('message') or 'no message'}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting:
            return f"pod {name}: container {container['name']} {waiting.get('reason')}" + (
                f": {waiting['message']}" if waiting.get("message") else "")
    return f"pod {name} is {status.get('phase') or 'being created'}"


def read_status(obj: Optional[dict], pods: list[dict], nnodes: int, admission: Optional[str] = None) -> NodeStatus:
    """Where a JobSet is, from the object, its pods and (suspended) why Kueue has not admitted it: a pure function
    of what the API answered."""
    if obj is None:
        return NodeStatus("failed", message="the JobSet is gone (deleted outside the run)")
    name = obj["metadata"]["name"]
    restarts = int((obj.get("status") or {}).get("restarts") or 0)
    current = [p for p in pods
               if (p["metadata"].get("labels") or {}).get(ATTEMPT_LABEL, str(restarts)) == str(restarts)]
    if condition(obj, "Completed"):
        return NodeStatus("succeeded", restarts, f"JobSet {name} completed")
    if failed := condition(obj, "Failed"):
        why = f"JobSet {name} failed after {restarts} restart(s): {failed.get('reason')}: {failed.get('message')}"
        broken = [(p, exit_) for p in current or pods if (exit_ := pod_exit(p))]
        if not broken:
            return NodeStatus("failed", restarts, why)
        # the first to fail, not the groups stopped because of it (SIGTERM: 143), by when their containers ended
        pod, exit_ = min(broken, key=lambda b: ((_terminated(b[0]) or {}).get("exitCode") == 143,
                                                (_terminated(b[0]) or {}).get("finishedAt") or "~",
                                                _index(b[0]) if _index(b[0]) is not None else 1 << 30))
        group = _index(pod)
        return NodeStatus("failed", restarts, f"node group {group} (pod {pod['metadata']['name']}) {exit_}; {why}",
                          failed_group=group)
    if suspended := condition(obj, "Suspended"):
        queue = (obj["metadata"].get("labels") or {}).get(QUEUE_LABEL)
        because = admission or f"{suspended.get('reason')}: {suspended.get('message')}"
        return NodeStatus("pending", restarts, f"waiting for Kueue admission (queue {queue}): {because}")
    waits = [w for p in sorted(current, key=lambda p: _index(p) or 0) if (w := pod_wait(p))]
    running = sum((p.get("status") or {}).get("phase") == "Running" for p in current)
    if running >= nnodes and not waits:
        return NodeStatus("running", restarts, f"{running} of {nnodes} node groups running")
    if not current:
        return NodeStatus("pending", restarts, f"JobSet {name}: waiting for its pods to be created")
    return NodeStatus("pending", restarts, f"{running} of {nnodes} node groups running; " + "; ".join(waits[:3]))


def admission_reason(workloads: list[dict]) -> Optional[str]:
    """Why Kueue has not admitted a workload yet: its QuotaReserved condition's message (e.g. insufficient quota)."""
    for workload in workloads:
        for cond in (workload.get("status") or {}).get("conditions") or []:
            if (cond.get("type") in ("QuotaReserved", "Admitted") and cond.get("status") == "False"
                    and cond.get("message")):
                return cond["message"]
    return None


class JobSetNodes:
    """The node groups of `spec` as one JobSet (`NodeGroups`), its pods given the run's `secret` (a Secret)."""

    def __init__(self, spec: NodeSpec, cluster: ClusterPlacement, site: Site, identity: RunIdentity, kube: Kube,
                 secret: str):
        self.spec, self.kube, self.queue = spec, kube, cluster.queue
        self.manifest = jobset(spec, cluster, site, identity)
        self.secret = nodes_secret(spec, identity, secret)
        self.name = spec.name
        self.uid: Optional[str] = None
        # the node groups' policies, when the controller runs in a Job (their pods carry its rlhf/run)
        self.job = identity.run_label if identity.owner else None
        self.policies = RunPolicies(api_factory=lambda: KubeAPI(kube)) if self.job else None
        self.holds_policies = False

    @classmethod
    def for_run(cls, spec: NodeSpec, cfg: RLHFConfig, secret: str, kube: Optional[Kube] = None, environ=os.environ,
                job: Optional[str] = None) -> "JobSetNodes":
        """The node groups of `spec` on the cluster this process reaches (its pod's service account, else a
        kubeconfig), placed as cfg.deploy.cluster says, owned by the Job this process runs in (`job`: the flow run's
        own, found from its pod)."""
        cluster = cfg.deploy.cluster
        kube = kube or Kube(cluster.namespace)
        job = job or own_job(environ)
        found = kube.get("batch/v1", "Job", job) if job else None
        owner = {"name": job, "uid": found["metadata"]["uid"]} if found else None
        identity = RunIdentity(spec.name, job or spec.name, owner)
        return cls(spec, cluster, Site.of(cluster, environ, kube.namespace), identity, kube, secret)

    def start(self) -> None:
        """Create the node groups' NetworkPolicies (once), the Secret, then the JobSet (the Secret deleted again if
        the JobSet cannot be created)."""
        if self.policies is not None and not self.holds_policies:
            self.policies.acquire(self.job)
            self.holds_policies = True
        self.kube.create(self.secret)
        try:
            self.uid = self.kube.create(self.manifest)["metadata"].get("uid")
        except BaseException:
            self.kube.delete("v1", "Secret", self.secret["metadata"]["name"])
            raise

    def _pods(self) -> list[dict]:
        return self.kube.pods({JOBSET_LABEL: self.name})

    def status(self) -> NodeStatus:
        obj = self.kube.get(API, "JobSet", self.name)
        pods = self._pods() if obj is not None else []
        admission = None
        if obj is not None and condition(obj, "Suspended") and self.queue:
            admission = admission_reason(self.kube.list(KUEUE_API, "Workload",
                                                        {"kueue.x-k8s.io/job-uid": obj["metadata"]["uid"]}))
        status = read_status(obj, pods, self.spec.nnodes, admission)
        if status.phase == "failed" and status.failed_group is not None:
            tail = self.logs(status.failed_group)
            status = NodeStatus("failed", status.restarts, f"{status.message}; last lines of its log:\n{tail}",
                                status.failed_group)
        return status

    def logs(self, group: int, lines: int = 50) -> str:
        """The log tail of node group `group`'s pod in the latest attempt (torchrun prints every local rank's)."""
        pods = [p for p in self._pods() if _index(p) == group]
        if not pods:
            return f"(no pod of node group {group} exists)"
        pod = max(pods, key=lambda p: int((p["metadata"].get("labels") or {}).get(ATTEMPT_LABEL, 0)))
        return self.kube.log(pod["metadata"]["name"], lines)

    def delete(self) -> None:
        """Delete the JobSet (Kubernetes deletes its Jobs and their pods with it), then its Secret and its policies
        (idempotent)."""
        try:
            self.kube.delete(API, "JobSet", self.name)
            self.kube.delete("v1", "Secret", self.secret["metadata"]["name"])
        finally:
            if self.holds_policies:
                self.policies.release()
                self.holds_policies = False
