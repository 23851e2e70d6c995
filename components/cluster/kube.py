"""The few Kubernetes API calls a run makes, through the `kubernetes` client: create, get and delete an object, list
pods, read a pod's log. Objects are plain dicts (the manifests components/cluster/objects.py builds); the API's errors
become `KubeError`s naming the object, what was asked, and what usually causes that answer.

Credentials: inside a pod, its service account (the token and CA Kubernetes mounts; RBAC in infra/terraform lets the
actor's service account manage the run's objects in its namespace only, and its admission policy only the objects of
the run whose pod holds the token); elsewhere a kubeconfig ($KUBECONFIG or ~/.kube/config, or `config_file`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Optional

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_NAMESPACE = "rlhf"  # what infra/terraform creates (terraform output namespace)

# apiVersion/kind -> the resource's plural (namespaced kinds only); core kinds live under /api/v1, the rest /apis/...
PLURALS = {
    ("v1", "Secret"): "secrets",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("batch/v1", "Job"): "jobs",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobsets",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("kueue.x-k8s.io/v1beta2", "Workload"): "workloads",
}
CONTROLLERS = {"JobSet": "JobSet (sigs.k8s.io/jobset)", "LeaderWorkerSet": "LeaderWorkerSet (sigs.k8s.io/lws)"}


class KubeError(RuntimeError):
    """The Kubernetes API refused or failed a call; the message names the object and the cause."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


def own_namespace(account: Path = ACCOUNT) -> Optional[str]:
    """The namespace of the pod this process runs in (its service account's mount), None off the cluster."""
    try:
        return (account / "namespace").read_text().strip() or None
    except OSError:
        return None


def in_cluster(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and (ACCOUNT / "token").exists()


def _explain(exc, verb: str, kind: str, name: str, namespace: str) -> KubeError:
    try:
        message = json.loads(exc.body or "{}").get("message") or exc.reason
    except (TypeError, ValueError):
        message = (exc.body or exc.reason or "")[:500]
    what = f"{verb} {kind} {name!r} in namespace {namespace!r}"
    hint = ""
    if exc.status == 403:
        hint = (f": this service account may not {verb} {kind} objects there, or not this one (RBAC: "
                f"infra/terraform envs/dev grants the actor's service account what a run needs; its admission policy "
                f"lets a run's pod create and delete only its own run's objects, and says which rule refused)")
    elif exc.status == 404 and kind in CONTROLLERS and verb == "create":
        hint = f": is {CONTROLLERS[kind]} installed on the cluster (infra/terraform installs it with Helm)?"
    elif exc.status == 409:
        hint = ": an object of that name exists already (a run's earlier attempt that is still being deleted?)"
    elif exc.status == 422:
        hint = ": the API server refused the object as invalid"
    return KubeError(f"Kubernetes API: {what}: {exc.status} {message}{hint}", exc.status)


class Kube:
    """A namespace of a cluster, as this process's credentials reach it."""

    def __init__(self, namespace: Optional[str] = None, config_file: Optional[str] = None):
        from kubernetes import client, config  # loaded by a run that talks to a cluster, not by every import

        configuration = client.Configuration()
        if config_file is None and in_cluster():
            config.load_incluster_config(client_configuration=configuration)
        else:
            # $KUBECONFIG read now, not when the client was imported
            config.load_kube_config(config_file=config_file or os.environ.get("KUBECONFIG"),
                                    client_configuration=configuration)
        self.api = client.ApiClient(configuration)
        self.namespace = namespace or own_namespace() or DEFAULT_NAMESPACE

    def _path(self, api_version: str, kind: str, name: Optional[str] = None, sub: str = "") -> str:
        if (api_version, kind) not in PLURALS:
            raise ValueError(f"{api_version} {kind}: not a kind a run manages ({sorted(k for _, k in PLURALS)})")
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        path = f"{base}/namespaces/{self.namespace}/{PLURALS[(api_version, kind)]}"
        return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    def _call(self, method: str, path: str, verb: str, kind: str, name: str, body=None, query=None, raw=False):
        from kubernetes.client.exceptions import ApiException  # as in __init__: loaded with the client

        try:
            response = self.api.call_api(path, method, query_params=list((query or {}).items()), body=body,
                                         header_params={"Accept": "application/json",
                                                        "Content-Type": "application/json"},
                                         auth_settings=["BearerToken"], _preload_content=False, _request_timeout=30)
        except ApiException as exc:
            raise _explain(exc, verb, kind, name, self.namespace) from None
        data = response.data
        return data.decode("utf-8", "replace") if raw else json.loads(data or b"{}")

    def create(self, obj: dict) -> dict:
        """Create `obj` in this namespace; returns the object as stored (with its uid)."""
        meta = obj["metadata"]
        body = {**obj, "metadata": {**meta, "namespace": self.namespace}}
        return self._call("POST", self._path(obj["apiVersion"], obj["kind"]), "create", obj["kind"], meta["name"], body)

    def get(self, api_version: str, kind: str, name: str) -> Optional[dict]:
        """The object, None when it does not exist."""
        try:
            return self._call("GET", self._path(api_version, kind, name), "get", kind, name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, name: str) -> bool:
        """Delete the object and, in the background, what it owns (its Jobs, pods, Services); False when it was
        gone already."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            self._call("DELETE", self._path(api_version, kind, name), "delete", kind, name, body)
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def list(self, api_version: str, kind: str, selector: Mapping[str, str]) -> list[dict]:
        """The objects of a kind carrying every label of `selector`."""
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        return self._call("GET", self._path(api_version, kind), "list", kind, labels,
                          query={"labelSelector": labels}).get("items") or []

    def pods(self, selector: Mapping[str, str]) -> list[dict]:
        """The pods carrying every label of `selector`."""
        return self.list("v1", "Pod", selector)

    def log(self, pod: str, lines: int = 50, previous: bool = False) -> str:
        """The last `lines` lines of a pod's log (`previous`: of its container's run before its last restart)."""
        query = {"tailLines": lines, **({"previous": "true"} if previous else {})}
        return self._call("GET", self._path("v1", "Pod", pod, "log"), "read the log of", "Pod", pod, query=query,
                          raw=True)
