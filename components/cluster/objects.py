"""Every Kubernetes object a run creates on its cluster, as plain manifests: pure functions of the run's config and
its identity, so the live path (components/cluster/jobset.py, servers.py) and `rlhf cluster manifests` build the
same objects.

- The actor's node groups (deploy.actor.nnodes > 1, actor.launch=jobset): one JobSet (jobset.x-k8s.io/v1alpha2), one
  replicated job `node` of nnodes pods (Indexed: parallelism = completions = nnodes), each running torchrun with
  nproc_per_node ranks and node rank = its completion index (components/launch/nodes.py's node command, the same
  LocalNodes runs). Rank 0's address comes from JobSet's own DNS: the pod <jobset>-node-0-0 in the JobSet's headless
  Service (subdomain <jobset>), published before the pods are ready; every pod first waits until that name resolves
  (the early-DNS trap: a pod that starts before the record exists fails its first lookup), then starts torchrun.
  failurePolicy.maxRestarts restarts all groups together; the job's backoffLimit 0 fails it at the first failed pod;
  a group exiting NO_RESTART_EXIT_CODE fails the JobSet at once.
- A server kind with launch=kubernetes (critic, reward, rollout): one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1)
  of `replicas` groups of one pod each (the rollout server: deploy.rollout.replicas; tensor parallelism inside the
  pod, tensor_parallel_size GPUs of one node), found through the LeaderWorkerSet's own headless Service: replica i
  is http://<lws>-<i>.<lws>.<namespace>:8000. Each pod runs `python -m components.serving.pod KIND`, which starts
  the server as a local run would (components/serving/local.local_server).
- The run's secret: a Secret per server kind, named after the run's Job (<job>-<8 hex>-<kind>: the one name pattern
  the admission policy lets the run's pods mount), mounted read-only into its pods (RLHF_RUN_SECRET_FILE), never a
  value in a spec; manifests written for review carry a placeholder instead.
- The run's two NetworkPolicies (components/cluster/network_policy.py): its pods talk to its own pods only.

The pods meet the restricted Pod Security Standard (the namespace enforces it): not root, no privilege escalation,
no capabilities, the runtime's seccomp profile, only emptyDir, downwardAPI, secret and persistentVolumeClaim
volumes. Server pods get no Kubernetes API token (they never call the API); node pods do (node group 0's rank 0
creates the run's servers).

Every object is labelled as the run's (rlhf/run: the Job the pod that creates it runs in, whose pods the
NetworkPolicies let in), carries the Kueue queue label (deploy.cluster.queue: a JobSet's pods are admitted together or
not at all), and is owned by that Job (ownerReferences): a cancelled or deleted flow run's pod takes them with it. The
namespace's admission policy (infra/terraform modules/admission) refuses a run's object that is not so labelled and
owned, or whose pods run other images or service accounts, or mount what is not the run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

import yaml

from components.cluster.network_policy import PODINFO_DIR, RUN_LABEL, policies
from components.launch.nodes import NO_RESTART_EXIT_CODE, NODE_JOB, NodeSpec, node_argv
from models.algorithms import ALGORITHMS
from models.config import RLHFConfig, merge
from models.deploy import ClusterPlacement, PodPlacement
from models.engines import ENGINES

PART_OF = {"app.kubernetes.io/part-of": "rlhf-flows"}
PART_LABEL = "rlhf/part"  # which part of the run an object is: actor-nodes, critic, reward, rollout
ROLE_LABEL = "rlhf/role"  # actor or critic: the pool the pod runs on (the namespace's actor-to-actor policy)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SERVER_PORT = 8000  # every server pod serves HTTP here
READY_PATHS = {"critic": "/v2/health/ready", "reward": "/v2/health/ready", "rollout": "/health"}
SECRET_DIR, SECRET_KEY = "/var/run/rlhf", "secret"
TRAINER_PLACEHOLDER = "<the IP of the pod that runs the run: known when it starts>"
SECRET_PLACEHOLDER = "<the run's secret: generated when the run starts, never written to a file>"
# JobSet annotates its pods; Kubernetes adds JOB_COMPLETION_INDEX
JOBSET_ENV = {"JOBSET_NAME": "jobset.sigs.k8s.io/jobset-name",
              "REPLICATED_JOB_NAME": "jobset.sigs.k8s.io/replicatedjob-name",
              "JOB_INDEX": "jobset.sigs.k8s.io/job-index"}


@dataclass(frozen=True)
class RunIdentity:
    """Who a run's objects belong to: `name` prefixes them (a DNS-1035 label, short enough for pod hostnames);
    `run_label` is the value of their rlhf/run label (the Job the run builder runs in); `owner`, that Job
    ({name, uid}), owns them when known."""

    name: str
    run_label: str
    owner: Optional[dict] = None

    @classmethod
    def of(cls, run_name: str, attempt: str, run_label: Optional[str] = None,
           owner: Optional[dict] = None) -> "RunIdentity":
        """`rlhf-<run name, slugged>-<hash of run name and attempt>`: runs and attempts never share a name."""
        slug = re.sub(r"[^a-z0-9]+", "-", run_name.lower()).strip("-")[:24].strip("-") or "run"
        digest = hashlib.sha256(f"{run_name}/{attempt}".encode()).hexdigest()[:6]
        name = f"rlhf-{slug}-{digest}"
        return cls(name, run_label or name, owner)

    def owner_references(self) -> list[dict]:
        if not self.owner:
            return []
        return [{"apiVersion": "batch/v1", "kind": "Job", "name": self.owner["name"], "uid": self.owner["uid"],
                 "blockOwnerDeletion": False}]

    def metadata(self, name: str, part: str, queue: Optional[str] = None) -> dict:
        labels = {**PART_OF, RUN_LABEL: self.run_label, PART_LABEL: part, **({QUEUE_LABEL: queue} if queue else {})}
        meta = {"name": name, "labels": labels}
        if self.owner:
            meta["ownerReferences"] = self.owner_references()
        return meta


@dataclass(frozen=True)
class Site:
    """deploy.cluster resolved where the run runs: the namespace, the images, and the controller's environment the
    pods copy (deploy.cluster.env_from_controller)."""

    namespace: str
    image: str
    vllm_image: str
    controller_env: dict

    @classmethod
    def of(cls, cluster: ClusterPlacement, environ: Mapping[str, str] = os.environ,
           own_namespace: Optional[str] = None) -> "Site":
        image = cluster.image or environ.get("RLHF_IMAGE")
        vllm_image = cluster.vllm_image or environ.get("RLHF_VLLM_IMAGE")
        if not image:
            raise ValueError("deploy.cluster.image: no image for the run's pods: set it, or $RLHF_IMAGE (prefect.yaml "
                             "gives every flow pod the image `make image` pushed)")
        return cls(cluster.namespace or own_namespace or "rlhf", image, vllm_image or "",
                   {k: environ[k] for k in cluster.env_from_controller if environ.get(k)})


# ------------------------------------------------------------------------------------------------ pods
def pod_env(cluster: ClusterPlacement, site: Site, extra: Mapping[str, str] = ()) -> list[dict]:
    """The environment of every pod of the run: the controller's (env_from_controller), deploy.cluster.env, its own
    state directory and the shared Hugging Face cache, `extra`; then the secretKeyRefs of secret_env."""
    values = {**site.controller_env, **cluster.env, "RLHF_STATE_DIR": cluster.state_dir,
              **({"HF_HOME": f"{cluster.cache_mount}/huggingface"} if cluster.cache_claim else {}), **dict(extra)}
    env = [{"name": k, "value": str(v)} for k, v in values.items()]
    for name, ref in cluster.secret_env.items():
        secret, key = ref.split("/", 1)
        env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env


def pod_template(cluster: ClusterPlacement, placement: PodPlacement, labels: dict, *, image: str, args: list[str],
                 env: list[dict], gpus: int, service_account: str, restart_policy: str, ports: dict[str, int],
                 api_token: bool, readiness: Optional[str] = None, secret: Optional[str] = None) -> dict:
    """A pod template of the run: one container `main` running `args` (the image has no entrypoint), `gpus` GPUs,
    the pool's node selector and tolerations, /dev/shm, its own state directory, the shared cache, its own labels
    (the downward API, at PODINFO_DIR: the Job it runs in) and (`secret`) the run's secret mounted read-only; the
    service account's API token only with `api_token`. The restricted Pod Security Standard: not root, no privilege
    escalation, no capabilities, the runtime's seccomp profile."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "state", "mountPath": cluster.state_dir},
              {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": placement.shm_size}},
               {"name": "state", "emptyDir": {"sizeLimit": cluster.state_size}},
               {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels",
                                                              "fieldRef": {"fieldPath": "metadata.labels"}}]}}]
    if cluster.cache_claim:
        mounts.append({"name": "cache", "mountPath": cluster.cache_mount})
        volumes.append({"name": "cache", "persistentVolumeClaim": {"claimName": cluster.cache_claim}})
    if secret:
        mounts.append({"name": "run-secret", "mountPath": SECRET_DIR, "readOnly": True})
        volumes.append({"name": "run-secret", "secret": {"secretName": secret, "defaultMode": 0o440}})
        env = env + [{"name": "RLHF_RUN_SECRET_FILE", "value": f"{SECRET_DIR}/{SECRET_KEY}"}]
    requests = {"cpu": placement.cpu, "memory": placement.memory}
    limits = {"memory": placement.memory}
    if gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpus)
    container = {"name": "main", "image": image, "imagePullPolicy": cluster.image_pull_policy, "args": args,
                 "env": env, "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
                 "resources": {"requests": requests, "limits": limits}, "volumeMounts": mounts,
                 "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}
    if readiness:
        container["readinessProbe"] = {"httpGet": {"path": readiness, "port": "http"}, "periodSeconds": 5,
                                       "failureThreshold": 3}
    spec = {"restartPolicy": restart_policy, "serviceAccountName": service_account,
            "automountServiceAccountToken": api_token,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "nodeSelector": dict(placement.node_selector), "tolerations": [dict(t) for t in placement.tolerations],
            "containers": [container], "volumes": volumes}
    return {"metadata": {"labels": labels}, "spec": spec}


# ------------------------------------------------------------------------------------------------ the actor's nodes
def nodes_secret(spec: NodeSpec, identity: RunIdentity, value: str = SECRET_PLACEHOLDER) -> dict:
    """The run's secret for the node groups' pods, which their ranks prove to each other (a placeholder for manifests
    written for review)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": identity.metadata(secret_name(identity, "nodes"), "actor-nodes"),
            "stringData": {SECRET_KEY: value}}


def jobset(spec: NodeSpec, cluster: ClusterPlacement, site: Site, identity: RunIdentity) -> dict:
    """The JobSet of the actor's node groups (see the module's docstring), its pods given `nodes_secret`."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", spec.name):
        raise ValueError(f"node groups {spec.name!r}: a JobSet's name must be a DNS-1035 label of at most 40 "
                         f"characters (its pods' hostnames are <name>-{NODE_JOB}-0-<index>)")
    if spec.nproc_per_node > cluster.actor.gpus_per_node:
        raise ValueError(f"deploy.actor.nproc_per_node={spec.nproc_per_node}: a node pod cannot have more GPUs than "
                         f"one node of its pool (deploy.cluster.actor.gpus_per_node={cluster.actor.gpus_per_node})")
    labels = {**PART_OF, RUN_LABEL: identity.run_label, PART_LABEL: "actor-nodes", ROLE_LABEL: "actor"}
    env = pod_env(cluster, site, spec.env)
    env += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{a}']"}}}
            for k, a in JOBSET_ENV.items()]
    template = pod_template(cluster, cluster.actor, labels, image=site.image, args=node_argv(spec, "python"), env=env,
                            gpus=spec.nproc_per_node, service_account=cluster.actor_service_account,
                            restart_policy="Never",
                            ports={"rendezvous": spec.master_port, "ranks": spec.master_port + 1},
                            secret=secret_name(identity, "nodes"), api_token=True)
    # a group that exits NO_RESTART_EXIT_CODE met a failure no restart mends: its Job fails by its pod failure
    # policy, and that reason fails the JobSet without a restart; any other failure restarts every group
    job = {"completionMode": "Indexed", "parallelism": spec.nnodes, "completions": spec.nnodes, "backoffLimit": 0,
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
               "containerName": "main", "operator": "In", "values": [NO_RESTART_EXIT_CODE]}}]},
           "template": template}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": identity.metadata(spec.name, "actor-nodes", cluster.queue),
            "spec": {"failurePolicy": {"maxRestarts": spec.max_restarts, "rules": [
                         {"name": "no-restart", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                     "replicatedJobs": [{"name": NODE_JOB, "replicas": 1, "template": {"spec": job}}]}}


# ------------------------------------------------------------------------------------------------ servers
def server_name(identity: RunIdentity, kind: str) -> str:
    return f"{identity.name}-{kind}"


def server_urls(identity: RunIdentity, kind: str, namespace: str, replicas: int) -> list[str]:
    """Replica i's leader through the LeaderWorkerSet's headless Service (what LWS_LEADER_ADDRESS names)."""
    lws = server_name(identity, kind)
    return [f"http://{lws}-{i}.{lws}.{namespace}:{SERVER_PORT}" for i in range(replicas)]


def server_replicas(kind: str, cfg: RLHFConfig) -> int:
    return cfg.deploy.rollout.replicas if kind == "rollout" else 1


def server_gpus(kind: str, cfg: RLHFConfig) -> int:
    """GPUs of one server pod: the critic's ranks, the rollout server's tensor-parallel size, 1 for a reward model
    server, 0 for a reward function (it scores text on CPU)."""
    if kind == "critic":
        gpus = cfg.deploy.critic.nproc_per_node
    elif kind == "rollout":
        gpus = cfg.deploy.rollout.tensor_parallel_size
    else:
        gpus = 1 if cfg.reward.source == "model" else 0
    if gpus > cfg.deploy.cluster.servers.gpus_per_node:
        field = {"critic": "deploy.critic.nproc_per_node", "rollout": "deploy.rollout.tensor_parallel_size"}[kind]
        raise ValueError(f"{field}={gpus}: a {kind} server runs in one pod, on one node of the server pool, which has "
                         f"{cfg.deploy.cluster.servers.gpus_per_node} GPUs (deploy.cluster.servers.gpus_per_node); a "
                         f"group across nodes is not supported")
    return gpus


def server_config(kind: str, cfg: RLHFConfig) -> RLHFConfig:
    """The config a server pod runs with: bound to every interface on SERVER_PORT, its state in the pod's own
    directory."""
    return merge(cfg, {f"deploy.{kind}.host": "0.0.0.0", f"deploy.{kind}.port": SERVER_PORT,
                       "deploy.state_dir": cfg.deploy.cluster.state_dir})


def server_args(kind: str, cfg: RLHFConfig, checkpoint_uri: Optional[str] = None,
                restore_iteration: Optional[int] = None, trainer_host: Optional[str] = None) -> list[str]:
    args = ["python", "-m", "components.serving.pod", kind, "--config-json",
            server_config(kind, cfg).model_dump_json(exclude_defaults=True)]
    if checkpoint_uri:
        args += ["--checkpoint-uri", checkpoint_uri]
    if restore_iteration is not None:
        args += ["--restore-iteration", str(restore_iteration)]
    if trainer_host:
        args += ["--trainer-host", trainer_host]
    return args


def secret_name(identity: RunIdentity, kind: str) -> str:
    """<the run's Job>-<8 hex of the servers' name>-<kind>: tied to the Job, as the admission policy requires of a
    Secret a run creates or mounts (nothing another run's Job could name)."""
    return f"{identity.run_label}-{hashlib.sha256(identity.name.encode()).hexdigest()[:8]}-{kind}"


def secret(identity: RunIdentity, kind: str, value: str = SECRET_PLACEHOLDER) -> dict:
    """The run's secret for one server kind's pods (a placeholder for manifests written for review)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": identity.metadata(secret_name(identity, kind), kind),
            "stringData": {SECRET_KEY: value}}


def leader_worker_set(kind: str, cfg: RLHFConfig, site: Site, identity: RunIdentity, args: list[str]) -> dict:
    """The LeaderWorkerSet of one server kind (see the module's docstring)."""
    cluster = cfg.deploy.cluster
    name = server_name(identity, kind)
    image = site.vllm_image if kind == "rollout" else site.image
    if not image:
        raise ValueError("deploy.cluster.vllm_image: no image for the rollout servers: set it, or $RLHF_VLLM_IMAGE")
    labels = {**PART_OF, RUN_LABEL: identity.run_label, PART_LABEL: kind, ROLE_LABEL: "critic"}
    ports = {"http": SERVER_PORT}  # Triton's only address is its front (HTTP): no gRPC or metrics port
    template = pod_template(cluster, cluster.servers, labels, image=image, args=args, env=pod_env(cluster, site),
                            gpus=server_gpus(kind, cfg), service_account=cluster.server_service_account,
                            restart_policy="Always", ports=ports, api_token=False, readiness=READY_PATHS[kind],
                            secret=secret_name(identity, kind))
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": identity.metadata(name, kind, cluster.queue),
            "spec": {"replicas": server_replicas(kind, cfg), "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": {"size": 1, "workerTemplate": template}}}


def server_objects(kind: str, cfg: RLHFConfig, site: Site, identity: RunIdentity,
                   secret_value: str = SECRET_PLACEHOLDER,
                   **args) -> list[dict]:
    """[the kind's Secret, its LeaderWorkerSet], in the order they are created."""
    return [secret(identity, kind, secret_value),
            leader_worker_set(kind, cfg, site, identity, server_args(kind, cfg, **args))]


# ------------------------------------------------------------------------------------------------ a whole run
def kubernetes_servers(cfg: RLHFConfig) -> list[str]:
    """The server kinds of the run that run on Kubernetes (launch=kubernetes), in the order a run starts them."""
    kinds = []
    if not ENGINES[cfg.rollout.engine].shares_actor_weights:
        kinds.append("rollout")
    if ALGORITHMS[cfg.algorithm].needs_critic:
        kinds.append("critic")
    if not (ALGORITHMS[cfg.algorithm].needs_critic and cfg.critic_carries_reward):
        kinds.append("reward")
    return [k for k in kinds if getattr(cfg.deploy, k).launch == "kubernetes"]


def run_manifests(cfg: RLHFConfig, site: Site, identity: RunIdentity, nodes: Optional[NodeSpec] = None) -> list[dict]:
    """Every object the run creates on its cluster: its JobSet and its pods' Secret (`nodes`: the node groups' spec,
    for nnodes > 1) with the controller's two NetworkPolicies (the node groups' rendezvous and collectives: their pods
    carry the controller's rlhf/run), each Kubernetes server's Secret (a placeholder value) and LeaderWorkerSet, and
    their two NetworkPolicies. With node groups, node group 0's rank 0 runs the run and creates the servers: they and
    their policies belong to its Job (<jobset>-node-0, every node pod's Job)."""
    objects, servers = [], identity
    if nodes is not None:
        objects += [nodes_secret(nodes, identity), jobset(nodes, cfg.deploy.cluster, site, identity)]
        objects += policies(identity.run_label, site.namespace, (identity.owner or {}).get("uid"))
        servers = RunIdentity(identity.name, f"{nodes.name}-{NODE_JOB}-0")
    kinds = kubernetes_servers(cfg)
    for kind in kinds:
        extra = {"trainer_host": TRAINER_PLACEHOLDER} if kind == "rollout" else {}
        objects += server_objects(kind, cfg, site, servers, **extra)
    if kinds:
        objects += policies(servers.run_label, site.namespace, (servers.owner or {}).get("uid"))
    for obj in objects:
        obj["metadata"]["namespace"] = site.namespace
    return objects


def dumps(objects: list[dict]) -> str:
    """The objects as one multi-document YAML stream."""
    return "".join("---\n" + yaml.safe_dump(json.loads(json.dumps(o)), sort_keys=False) for o in objects)
