"""On Kubernetes, a run's server pods take traffic from that run's actor pods only (NetworkPolicies, enforced by the VPC
CNI's network policy agent: infra/terraform).

What Terraform sets once per namespace (envs/dev): no pod takes ingress unless a policy allows it; actor pods take
ingress from actor pods (the ranks' rendezvous and collectives, which start before any flow code runs). What a run
sets for itself, here, while it has servers on Kubernetes (launch=kubernetes):
- its training Job is the one the pod that runs the run is in (the flow run's own Job; with node groups, the
  JobSet's Job <jobset>-node-0, whose pods are every node group): every pod of a Job carries
  `batch.kubernetes.io/job-name: <job>`, which the pod reads from its own labels (the downward API's labels file at
  PODINFO_DIR, mounted by the work pools' job templates and the run's own pod templates), whatever its hostname;
- its servers' pods are labelled `rlhf/run: <job>` (the labels of the LeaderWorkerSets it creates: a flow run's
  own pod cannot choose this label, the work pools' job templates fix it);
- two NetworkPolicies named after the job: the run's server pods take ingress from the job's pods and from each
  other only, and the job's pods take ingress from the run's server pods (the rollout server joins the trainer's
  weight-transfer group).
  Both are owned by the training Job (ownerReferences): if the run is killed before it deletes them, Kubernetes
  removes them with the Job. A pod of another run, or anything else in the cluster, cannot open a connection to them.

The REST calls use the pod's service account through components/cluster/kube.py (RBAC in envs/dev: create/delete
NetworkPolicies, get Jobs, in the namespace only). Off the cluster (no $KUBERNETES_SERVICE_HOST), or with RLHF_NETWORK_POLICY=off, nothing is done.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Optional

from components.cluster.kube import Kube, KubeError

RUN_LABEL = "rlhf/run"
JOB_LABEL = "batch.kubernetes.io/job-name"
SWITCH_ENV = "RLHF_NETWORK_POLICY"
PODINFO_DIR = "/etc/podinfo"  # where every pod of a run mounts its own labels (the downward API)
PODINFO_ENV = "RLHF_PODINFO_DIR"  # another directory holding that `labels` file


def own_job(env=os.environ, labels_file: Optional[str] = None) -> Optional[str]:
    """The Kubernetes Job this process's pod runs in, read from the pod's own labels (the downward API's labels file
    every pod of the run mounts at PODINFO_DIR: Kubernetes labels every pod of a Job with its name); None off the
    cluster, or when switched off. On the cluster without it: a RuntimeError naming why (rather than objects owned by
    nothing and policies that select no pod)."""
    if not env.get("KUBERNETES_SERVICE_HOST") or env.get(SWITCH_ENV, "on") == "off":
        return None
    path = labels_file or os.path.join(env.get(PODINFO_ENV, PODINFO_DIR), "labels")
    try:
        labels = pod_labels(open(path).read())
    except OSError as exc:
        raise RuntimeError(f"on Kubernetes, this pod has no labels file {path} ({exc.strerror}): its template must mount "
                           f"the downward API's metadata.labels there (the work pools' and the run's own templates "
                           f"do), or set {SWITCH_ENV}=off to run without per-run policies") from None
    job = labels.get(JOB_LABEL) or labels.get("job-name")
    if not job:
        raise RuntimeError(f"on Kubernetes, this pod's labels ({path}) name no Job ({JOB_LABEL}): a run's controller "
                           f"runs in a Job's pod (a work pool's flow run, a JobSet's node group)")
    return job


def pod_labels(text: str) -> dict[str, str]:
    """The downward API's labels file: one `key="value"` per line, the value quoted and escaped as a Go string."""
    labels = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            labels[key.strip()] = json.loads(value) if value.startswith('"') else value
    return labels


def policies(job: str, namespace: str, job_uid: Optional[str] = None) -> list[dict]:
    """The run's two NetworkPolicies (pure manifests): servers <- the job's pods and the run's other servers (a
    server group across pods), the job's pods <- servers."""
    owner = ([{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": job_uid, "blockOwnerDeletion": False}]
             if job_uid else [])

    def policy(name: str, target: dict, *sources: dict) -> dict:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": name, "namespace": namespace, "ownerReferences": owner,
                             "labels": {"app.kubernetes.io/part-of": "rlhf-flows", RUN_LABEL: job}},
                "spec": {"podSelector": {"matchLabels": target}, "policyTypes": ["Ingress"],
                         "ingress": [{"from": [{"podSelector": {"matchLabels": source}} for source in sources]}]}}

    return [policy(f"rlhf-{job}-servers"[:253], {RUN_LABEL: job}, {JOB_LABEL: job}, {RUN_LABEL: job}),
            policy(f"rlhf-{job}-trainer"[:253], {JOB_LABEL: job}, {RUN_LABEL: job})]


class KubeAPI:
    """The few Kubernetes API calls a run's policies need, as its pod's service account (components/cluster/kube.py)."""

    def __init__(self, kube: Optional[Kube] = None):
        kube = kube or Kube()
        self.kube, self.namespace = kube, kube.namespace

    def job_uid(self, job: str) -> Optional[str]:
        found = self.kube.get("batch/v1", "Job", job)
        return found["metadata"]["uid"] if found else None

    def create(self, manifest: dict) -> None:
        try:
            self.kube.create(manifest)
        except KubeError as exc:
            if exc.status != 409:  # 409: it exists already (a retried start)
                raise

    def delete(self, name: str) -> None:
        self.kube.delete("networking.k8s.io/v1", "NetworkPolicy", name)


class RunPolicies:
    """The run's policies, created when its first server on Kubernetes starts and deleted after its last one stops."""

    def __init__(self, api_factory=KubeAPI):
        self.api_factory, self.lock, self.users, self.created = api_factory, threading.Lock(), 0, []
        self.api: Optional[KubeAPI] = None

    def acquire(self, job: str) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1:
                return
            self.api = self.api_factory()
            self.created = policies(job, self.api.namespace, self.api.job_uid(job))
            for manifest in self.created:
                self.api.create(manifest)

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0 or self.api is None:
                return
            for manifest in self.created:
                self.api.delete(manifest["metadata"]["name"])
            self.created, self.api = [], None


RUN_POLICIES = RunPolicies()
