"""Where a run's parts run: the deployment settings, apart from what a run trains (models/config.py).

A deployment sets these once: prefect.yaml on a cluster (placement cluster: the servers as LeaderWorkerSets the run
creates, checkpoints in S3), `rlhf up` locally (placement local), `rlhf train` for one process (placement in_process).
A run's own config never needs to name a host, a port, an interpreter or a bucket, and a flow run given a partial
config keeps its deployment's settings (the flows deep-merge what a run is given over what its deployment says:
components/tasks.py). A placement (`PLACEMENTS`) is a named set of values for what the deployment leaves unset.

Ports: None (the default) = a free port picked when the server starts (the OS's choice, so runs started together on
one machine never race for one); a number = that port, or a free one when it is busy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from models.sections import Section, default_state_dir

Launch = Literal["in_process", "local", "kubernetes"]
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
# what every pod of a run copies from its controller's environment by default (deploy.cluster.env_from_controller)
CONTROLLER_ENV = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION", "RLHF_S3_BUCKET",
                  "RLHF_S3_PREFIX", "RLHF_STORE_SIGNER_ARN", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY")


def refuse_deployment_launch(value):
    """launch='deployment' (a server as a Prefect deployment of its own) was removed: refused naming what replaces
    it."""
    if value == "deployment":
        raise ValueError("launch='deployment' was removed: on a cluster use 'kubernetes' (the run creates its servers "
                         "as a LeaderWorkerSet: docs/cluster.md), else 'local'")
    return value


READY_TIMEOUT_S = 900.0  # a server's readiness wait: a cold GPU node joins in 3-6 min, then pulls the image, then loads


class ActorPlacement(Section):
    """How many processes train the actor, and how they talk. One node: rank 0 is the flow run (or `rlhf train`) and
    starts ranks 1..N-1 itself. Several nodes: the flow run (or `rlhf train`) is the run's controller and starts
    `nnodes` node groups (torchrun each) where `launch` says; node group 0's rank 0 runs the run, the others follow."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "max_restarts", "backend", "fsdp", "master_addr", "master_port", "collective_timeout_s",
    )

    nproc_per_node: PositiveInt = Field(1, description="Actor ranks per node (one per GPU).")
    nnodes: PositiveInt = Field(
        1,
        description="Node groups of the actor; over one, the flow run is the run's controller (docs/distributed.md).")
    launch: Literal["local", "jobset"] = Field(
        "local",
        description="Where node groups run when nnodes > 1: local torchrun processes, or a JobSet on Kubernetes.")
    max_restarts: NonNegativeInt = Field(
        2, le=100, description="With nnodes > 1: restarts of every node group after one fails, each from a checkpoint.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto = nccl with CUDA, gloo on CPU.")
    fsdp: Literal["auto", "off"] = Field(
        "auto", description="auto shards a full fine-tune with FSDP2 when the world size is over 1; off replicates it.")
    master_addr: str = Field(
        "127.0.0.1", description="Address of rank 0 for the ranks it starts itself (torchrun sets its own).")
    master_port: Optional[int] = Field(
        None, ge=1024, le=65535, description="Port of rank 0's rendezvous; None = a free one (29500 on a JobSet).")
    collective_timeout_s: float = Field(
        300.0, gt=0, description="A collective that waits longer than this (a rank died or hangs) fails the run.")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class ServerPlacement(Section):
    """Where a PyTriton server of the run (critic or reward) runs and how it is reached."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "host", "port", "max_queue_delay_us", "torch_threads", "ready_timeout_s", "request_timeout_s",
    )

    launch: Launch = Field("local", description="Where the server runs: in_process (no server), local or kubernetes.")
    host: str = Field(
        "127.0.0.1", description="Interface the server binds (and the client connects to for launch=local).")
    port: Optional[int] = Field(
        None, ge=1, le=65535, description="HTTP port of the server; None = a free port picked at start.")
    max_queue_delay_us: int = Field(
        2000, ge=0, description="Dynamic-batching queue delay of the server's batched models.")
    torch_threads: Optional[PositiveInt] = Field(
        None, description="torch intra-op threads of the server; None = 1 on a CPU-only host, else torch's default.")
    ready_timeout_s: float = Field(
        READY_TIMEOUT_S, gt=0,
        description="How long to wait for the server (and, launched elsewhere, its start) to become ready.")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one request.")
    auth: Literal["secret", "none"] = Field(
        "secret", description="Who may call: secret = the run's own requests only (docs/security.md); none = anyone.")

    _launch = field_validator("launch", mode="before")(refuse_deployment_launch)


class CriticPlacement(ServerPlacement):
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "host", "port", "max_queue_delay_us", "torch_threads", "ready_timeout_s", "request_timeout_s",
        "max_train_rows",
    )
    max_train_rows: PositiveInt = Field(
        4096, description="Largest critic_train batch (rows) the server accepts; a bigger one is refused.")
    nproc_per_node: PositiveInt = Field(
        1, description="Ranks of the critic server (one node), each holding an FSDP2 shard of the critic.")


class RolloutPlacement(Section):
    """The vLLM rollout server (components/serving/rollout/; rollout.engine=vllm): its own process and
    environment (.venv-vllm; on a cluster its own pod), with its own copy of the actor's weights; `replicas` of them."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "python", "host", "port", "max_model_len", "kv_cache_gib", "gpu_memory_utilization", "enforce_eager",
        "threads", "cpu_cores", "ready_timeout_s", "request_timeout_s", "max_request_sequences",
        "max_request_tokens", "max_body_mib", "weight_transfer",
    )

    launch: Literal["local", "kubernetes"] = Field("local", description="Where the servers run: local or kubernetes.")
    python: str = Field(
        ".venv-vllm/bin/python",
        description="Interpreter of the server's environment (`make vllm-venv`), relative to the project root.")
    host: str = Field(
        "127.0.0.1", description="Interface the server binds (and the client connects to for launch=local).")
    port: Optional[int] = Field(
        None, ge=0, le=65535,
        description="HTTP port of the server (replica i: port + i); None or 0 = a free one picked at start.")
    replicas: PositiveInt = Field(
        1, description="Independent rollout servers, each with its own weights, sharing each batch's prompts.")
    tensor_parallel_size: PositiveInt = Field(
        1, description="GPUs each replica shards the model over (vLLM's tensor parallelism).")
    max_model_len: Optional[PositiveInt] = Field(
        None, description="Longest prompt + response the engine accepts; None = the model's own limit.")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache space in GiB on a CPU host (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights and KV cache) on a GPU host.")
    enforce_eager: bool = Field(
        True, description="Run without CUDA graphs or torch.compile (starts in seconds); off for long GPU runs.")
    threads: Optional[PositiveInt] = Field(
        None, description="CPU threads of the engine (OMP_NUM_THREADS); None = every core on a CPU-only host.")
    cpu_cores: Optional[str] = Field(
        None, coerce_numbers_to_str=True, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
        description="CPU cores the server runs on, a Linux core list such as '2-3'; None = every core.")
    ready_timeout_s: float = Field(
        READY_TIMEOUT_S, gt=0, description="How long to wait for every replica to load the model and answer /health.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generate or weight-update request.")
    max_request_sequences: PositiveInt = Field(
        4096, description="Largest /generate request in sequences (prompts x samples); a bigger one is refused.")
    max_request_tokens: PositiveInt = Field(
        1 << 23, description="Largest /generate request in new tokens (prompts x samples x max_new_tokens).")
    max_body_mib: PositiveInt = Field(
        32, description="Largest JSON request body in MiB (a weight upload is bounded by the model's size).")
    weight_transfer: Literal["http", "dist"] = Field(
        "dist", description="How weights reach each replica after an update: dist (a process group) or http.")

    _launch = field_validator("launch", mode="before")(refuse_deployment_launch)

    @model_validator(mode="after")
    def _tensor_parallel_needs_dist(self):
        if self.tensor_parallel_size > 1 and self.weight_transfer == "http":
            raise ValueError(f"deploy.rollout.tensor_parallel_size={self.tensor_parallel_size} needs "
                             f"deploy.rollout.weight_transfer='dist': an HTTP body reaches the server's process, not "
                             f"the GPU workers that hold the model's shards")
        return self


class TrackingPlacement(Section):
    uri: Optional[str] = Field(
        None,
        description="MLflow tracking URI; None = $MLFLOW_TRACKING_URI, the local stack's, else sqlite in state_dir.")
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory system metrics with the run.")


class CheckpointPlacement(Section):
    advanced: ClassVar[tuple[str, ...]] = ("lease_timeout_s",)  # --describe --all
    uri: Optional[str] = Field(
        None, description="Checkpoint store (file:///dir, a path, s3://bucket/prefix); None = <state_dir>/checkpoints.")
    s3_endpoint_url: Optional[str] = Field(
        None, description="Endpoint of an S3-compatible store for checkpoints, models and data (None = AWS).")
    lease_timeout_s: float = Field(
        60.0, ge=5, description="Another run of the same name takes over a lease left unrenewed this long.")


class CachePlacement(Section):
    """How this deployment's processes bring models and data that are not local paths onto their machine
    (models/resolve.py): s3:// sources into a cache directory, hub ids into the Hugging Face cache."""

    dir: Optional[str] = Field(
        None,
        description="Where s3:// models and data are fetched on each machine; None = $RLHF_CACHE_DIR, else HF_HOME's.")
    hub_downloads: bool = Field(
        False, description="Download a hub id missing from the Hugging Face cache at run time (else: refused).")


class PodPlacement(Section):
    """Where the pods of one kind that a run creates on its cluster land, and what each asks of its node."""
    advanced: ClassVar[tuple[str, ...]] = ("shm_size", "node_selector", "tolerations")  # --describe --all

    cpu: str = Field(
        "3", pattern=r"^[0-9]+(\.[0-9]+|m)?$",
        description="CPU request of each pod (a Kubernetes quantity that fits one node of its pool).")
    memory: str = Field("12Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Memory request and limit of each pod.")
    shm_size: str = Field(
        "2Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Size of each pod's in-memory /dev/shm (counts against memory).")
    gpus_per_node: PositiveInt = Field(
        1, le=8, description="GPUs of one node of the pool (g5.xlarge 1, g5.12xlarge 4, p4d.24xlarge 8).")
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="nodeSelector of each pod: the pool's node label (infra/terraform: rlhf/role).")
    tolerations: list[dict] = Field(
        default_factory=lambda: [dict(GPU_TOLERATION)],
        description="Tolerations of each pod (the GPU pools' taint nvidia.com/gpu=true:NoSchedule).")


class ActorPods(PodPlacement):
    """The actor's node pods: the actor-gpu pool."""

    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"rlhf/role": "actor"}, description="nodeSelector of each pod: the actor pool's label.")


class ServerPods(PodPlacement):
    """The server pods: the critic-gpu pool."""

    node_selector: dict[str, str] = Field(
        default_factory=lambda: {"rlhf/role": "critic"},
        description="nodeSelector of each pod: the critic pool's label.")


class ClusterPlacement(Section):
    """The Kubernetes side of a run's own pods (the actor's node groups as a JobSet, servers as LeaderWorkerSets with
    launch=kubernetes): everything their specs need that the run's config does not say. The defaults fit what
    infra/terraform makes; None = read from the environment of the pod the run's controller runs in."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "image_pull_policy", "actor_service_account", "server_service_account", "cache_claim", "cache_mount",
        "state_dir", "state_size", "env_from_controller", "env", "secret_env",
    )

    namespace: Optional[str] = Field(
        None, pattern=DNS_LABEL,
        description="Namespace of the run's objects; None = that of the pod the run runs in, else 'rlhf'.")
    image: Optional[str] = Field(
        None, description="Image of the actor's node pods and the critic and reward servers; None = $RLHF_IMAGE.")
    vllm_image: Optional[str] = Field(
        None, description="Image of the rollout servers (docker/vllm.Dockerfile); None = $RLHF_VLLM_IMAGE.")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="imagePullPolicy of the run's pods.")
    actor_service_account: str = Field(
        "rlhf-actor", pattern=DNS_LABEL,
        description="Service account of the actor's node pods (terraform: actor_service_account_name).")
    server_service_account: str = Field(
        "rlhf-critic", pattern=DNS_LABEL,
        description="Service account of the server pods (terraform: critic_service_account_name).")
    queue: Optional[str] = Field(
        "rlhf", pattern=DNS_LABEL,
        description="Kueue LocalQueue of the run's JobSet and LeaderWorkerSets; None = no Kueue.")
    cache_claim: Optional[str] = Field(
        "rlhf-cache", pattern=DNS_LABEL,
        description="PersistentVolumeClaim of the shared Hugging Face cache every pod mounts; None = none.")
    cache_mount: str = Field("/cache", pattern=r"^/", description="Where every pod of the run mounts the shared cache.")
    state_dir: str = Field(
        "/var/lib/rlhf", pattern=r"^/",
        description="RLHF_STATE_DIR of every pod: an emptyDir of its own, shared with no other pod.")
    state_size: str = Field("50Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Size limit of each pod's state directory.")
    actor: ActorPods = Field(
        default_factory=ActorPods, description="The actor's node pods (one per node group): the actor-gpu pool.")
    servers: ServerPods = Field(
        default_factory=ServerPods, description="The critic, reward and rollout server pods: the critic-gpu pool.")
    env_from_controller: list[str] = Field(
        default_factory=lambda: list(CONTROLLER_ENV),
        description="Environment variables every pod copies from the controller's (never a secret).")
    env: dict[str, str] = Field(
        default_factory=dict, description="More environment variables of every pod (never a secret: use secret_env).")
    secret_env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables from Kubernetes Secrets: NAME -> '<secret>/<key>'.")

    @field_validator("env_from_controller", "env")
    @classmethod
    def _no_secrets(cls, value, info):
        names = value if isinstance(value, list) else list(value)
        if bad := [n for n in names if SECRET_NAME.search(n)]:
            raise ValueError(f"{info.field_name}: {bad} look like secrets, whose values a pod's spec would show: give "
                             f"them through deploy.cluster.secret_env (NAME -> '<secret>/<key>', a secretKeyRef)")
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_refs(cls, value: dict[str, str]):
        for name, ref in value.items():
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/[-._a-zA-Z0-9]+", ref):
                raise ValueError(f"secret_env.{name}: {ref!r} is not '<secret>/<key>' (a Kubernetes Secret's name and "
                                 f"one of its keys)")
        return value


# The named placements (deploy.placement): where a run's parts run, as values under what the deployment gives
# (docs/reference/config.md lists them, generated from here)
PLACEMENTS: dict[str, dict] = {
    # every part on this machine, each server a child process of the run (the field defaults; `rlhf up`'s deployments)
    "local": {},
    # the critic and the reward model in the actor's process, no server to start (`rlhf train`, `rlhf pipeline`)
    "in_process": {"critic.launch": "in_process", "reward.launch": "in_process"},
    # Kubernetes: the servers as LeaderWorkerSets the run creates, the actor's node groups (nnodes > 1) as a JobSet,
    # the rollout server in the vLLM image, hub models downloaded once into the pods' shared cache (prefect.yaml,
    # `rlhf cluster manifests`)
    "cluster": {"actor.launch": "jobset", "critic.launch": "kubernetes", "reward.launch": "kubernetes",
                "rollout.launch": "kubernetes", "rollout.python": "/opt/vllm/bin/python", "cache.hub_downloads": True},
}


class DeployConfig(Section):
    """Where a run's parts run: processes, devices, hosts, ports, interpreters, cores, timeouts, tracking and storage
    URIs. Set by the deployment (prefect.yaml, `rlhf up`, `rlhf train`); a run's config never needs them."""
    advanced: ClassVar[tuple[str, ...]] = ("reference_device",)  # --describe --all
    named: ClassVar[str] = "placement"
    named_values: ClassVar[dict[str, dict]] = PLACEMENTS

    placement: Literal[tuple(PLACEMENTS)] = Field(
        "local", description="Named values for the fields below that are not given: local, in_process or cluster.")

    state_dir: Optional[str] = Field(
        None, description="Local state (logs, checkpoints, the local stack); None = $RLHF_STATE_DIR, else ./.rlhf.")
    device: str = Field(
        "auto", description="auto (cuda if available, else cpu), cpu or cuda[:N]; with several ranks, each rank's GPU.")
    reference_device: Literal["auto", "actor", "cpu"] = Field(
        "auto", description="Where a full fine-tune's frozen reference lives: actor, cpu, or auto (actor if it fits).")
    actor: ActorPlacement = Field(default_factory=ActorPlacement, description="Actor processes (data parallel, FSDP2).")
    critic: CriticPlacement = Field(
        default_factory=CriticPlacement, description="The critic server (algorithms with a critic).")
    reward: ServerPlacement = Field(
        default_factory=ServerPlacement,
        description="The reward server (no critic, or a critic that does not carry the reward model).")
    rollout: RolloutPlacement = Field(
        default_factory=RolloutPlacement, description="The vLLM rollout server (rollout.engine=vllm).")
    tracking: TrackingPlacement = Field(default_factory=TrackingPlacement, description="The MLflow tracking server.")
    checkpoint: CheckpointPlacement = Field(
        default_factory=CheckpointPlacement,
        description="The checkpoint store (its s3_endpoint_url also serves s3:// models and data).")
    cluster: ClusterPlacement = Field(
        default_factory=ClusterPlacement,
        description="The run's own pods on Kubernetes: a JobSet for the actor, LeaderWorkerSets for servers.")
    cache: CachePlacement = Field(
        default_factory=CachePlacement,
        description="Models and data that are not local paths: s3:// sources and hub ids.")

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir).absolute() if self.state_dir else default_state_dir()
