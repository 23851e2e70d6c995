"""On Kubernetes, a run's pods talk to that run's pods only (NetworkPolicies, enforced by the VPC CNI's network policy
agent: infra/terraform).

What Terraform sets once per namespace (envs/dev): no pod takes or opens a connection unless a policy allows it, in
either direction; every pod may resolve names (kube-dns), reach addresses outside the VPC but the link-local range
(the instance metadata service), and the Kubernetes API. What a run sets for itself, here, while it has pods of its
own (servers it created, or node groups):
- its Job is the one the pod that creates them runs in (the flow run's own Job; with node groups, the JobSet's Job
  <jobset>-node-0, whose pods are every node group, creates the servers): every pod of a Job carries
  `batch.kubernetes.io/job-name: <job>`, which the pod reads from its own labels (the downward API's labels file at
  PODINFO_DIR, mounted by the work pools' job templates and the run's own pod templates), whatever its hostname;
- the pods of the objects it creates are labelled `rlhf/run: <job>` (its servers' LeaderWorkerSets, its node groups'
  JobSet: the admission policy in infra/terraform refuses any other value from a run); a flow run's own pod cannot
  give itself this label (the work pools' job templates fix its labels: no job variable sets one);
- two NetworkPolicies named after the job, both ways (ingress and egress): `rlhf-<job>-run`, the run's pods talk to
  the job's pods and to each other (a server group across pods; the node groups' rendezvous and collectives), and
  `rlhf-<job>-job`, the job's pods talk to the run's pods (the trainer calls its servers; the rollout server joins the
  trainer's weight-transfer group).
  Both are owned by the Job (ownerReferences): if the run is killed before it deletes them, Kubernetes removes them
  with the Job. A pod of another run, or anything else in the cluster, can neither reach the run's pods nor be
  reached from them.

The REST calls use the pod's service account through components/cluster/kube.py (RBAC and the admission policy in
envs/dev: create/delete the run's own NetworkPolicies, get Jobs, in the namespace only). Off the cluster (no
$KUBERNETES_SERVICE_HOST), or with RLHF_NETWORK_POLICY=off, nothing is done (on infra/terraform's cluster a run's
pods then reach nothing of each other, and the admission policy refuses objects owned by no Job).
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
        raise RuntimeError(f"on Kubernetes, this pod has no labels file {path} ({exc.strerror}): its template must "
                           "mount the downward API's metadata.labels there (the work pools' and the run's own "
                           f"templates do), or set {SWITCH_ENV}=off to run without per-run policies") from None
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
    """The run's two NetworkPolicies (pure manifests), each both ways: `rlhf-<job>-run`, the run's pods (rlhf/run)
    with the job's pods and each other; `rlhf-<job>-job`, the job's pods with the run's pods."""
    owner = ([{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": job_uid, "blockOwnerDeletion": False}]
             if job_uid else [])

    def policy(name: str, target: dict, *peers: dict) -> dict:
        selectors = [{"podSelector": {"matchLabels": peer}} for peer in peers]
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": name, "namespace": namespace, "ownerReferences": owner,
                             "labels": {"app.kubernetes.io/part-of": "rlhf-flows", RUN_LABEL: job}},
                "spec": {"podSelector": {"matchLabels": target}, "policyTypes": ["Ingress", "Egress"],
                         "ingress": [{"from": selectors}], "egress": [{"to": selectors}]}}

    return [policy(f"rlhf-{job}-run", {RUN_LABEL: job}, {JOB_LABEL: job}, {RUN_LABEL: job}),
            policy(f"rlhf-{job}-job", {JOB_LABEL: job}, {RUN_LABEL: job})]


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
    """The run's policies, created when its first server (or its node groups) starts and deleted after its last one
    stops."""

    def __init__(self, api_factory=KubeAPI):
        self.api_factory, self.lock, self.users, self.created = api_factory, threading.Lock(), 0, []
        self.api: Optional[KubeAPI] = None

    def acquire(self, job: str) -> None:
        with self.lock:
            if self.users == 0:
                api = self.api_factory()
                manifests, made = policies(job, api.namespace, api.job_uid(job)), []
                try:
                    for manifest in manifests:
                        api.create(manifest)
                        made.append(manifest)
                except BaseException:
                    for manifest in made:  # none of the run's policies is left behind by a start that failed
                        api.delete(manifest["metadata"]["name"])
                    raise
                self.api, self.created = api, manifests
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0 or self.api is None:
                return
            for manifest in self.created:
                self.api.delete(manifest["metadata"]["name"])
            self.created, self.api = [], None


RUN_POLICIES = RunPolicies()
