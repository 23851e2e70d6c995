"""Where a run's parts run: the deployment settings, apart from what a run trains (models/config.py).

A deployment sets these once: prefect.yaml on a cluster (critic and rollout servers as deployments on their own GPU
nodes, checkpoints in S3), `rlhf up` locally, `rlhf train` for one process. A run's own config never needs to name a
host, a port, an interpreter or a bucket, and a flow run given a partial config keeps its deployment's settings (the
flows deep-merge what a run is given over what its deployment says: components/runs.py).

Ports: None (the default) = a free port picked when the server starts (the OS's choice, so runs started together on
one machine never race for one); a number = that port, or a free one when it is busy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar, Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveInt, field_validator, model_validator

from models.sections import Section, default_state_dir

Launch = Literal["in_process", "local", "deployment", "kubernetes"]
SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}


READY_TIMEOUT_S = 900.0  # a server's readiness wait: a cold GPU node joins in 3-6 min, then pulls the image, then loads


class ActorPlacement(Section):
    """How many processes train the actor, and how they talk. One node: rank 0 is the flow run (or `rlhf train`) and
    starts ranks 1..N-1 itself. Several nodes: the flow run (or `rlhf train`) is the run's controller and starts
    `nnodes` node groups (torchrun each) where `launch` says; node group 0's rank 0 runs the run, the others follow."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "max_restarts", "backend", "fsdp", "master_addr", "master_port", "collective_timeout_s",
    )

    nproc_per_node: PositiveInt = Field(1, description="Actor ranks per node (one per GPU; on CPU, each gets its cores / ranks threads).")
    nnodes: PositiveInt = Field(1, description="Node groups of the actor; more than one makes the flow run (or `rlhf train`) the run's controller: it starts the groups where `launch` says, relays rank 0's log, restarts them after a failure (`max_restarts`) and returns the run's summary.")
    launch: Literal["local", "jobset"] = Field("local", description="Where the node groups of nnodes > 1 run: 'local' = one torchrun per group on this machine over loopback, each with the environment JobSet gives a pod and a state directory of its own (nothing shared but the run's checkpoint store); 'jobset' = a JobSet on Kubernetes (components/cluster/jobset.py), its pods admitted together by Kueue.")
    max_restarts: NonNegativeInt = Field(2, le=100, description="With nnodes > 1: how many times the whole set of node groups is restarted after one fails (JobSet's failurePolicy.maxRestarts); each restart resumes from the run's last checkpoint. A failure a restart cannot mend (the run's name taken by another run, its lease lost) is not restarted.")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="torch.distributed backend: 'auto' = nccl with CUDA, gloo on CPU.")
    fsdp: Literal["auto", "off"] = Field("auto", description="'auto' shards a full fine-tune with FSDP2 (fully_shard per transformer block) when world size > 1; 'off' replicates it and sums gradients. LoRA always replicates the frozen base and syncs only the adapters.")
    master_addr: str = Field("127.0.0.1", description="Address of rank 0 for ranks started by rank 0 itself (torchrun sets its own).")
    master_port: Optional[int] = Field(None, ge=1024, le=65535, description="Port of rank 0's rendezvous; None = a free one (one node, or launch=local), 29500 on a JobSet; a busy port makes a local rank 0 pick a free one.")
    collective_timeout_s: float = Field(300.0, gt=0, description="A collective (and the rendezvous at start) that waits longer than this, because a rank died or hangs, fails the run.")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class ServerPlacement(Section):
    """Where a PyTriton server of the run (critic or reward) runs and how it is reached."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "host", "port", "max_queue_delay_us", "torch_threads", "ready_timeout_s", "request_timeout_s",
    )

    launch: Launch = Field("local", description="'in_process' = no server (the model runs in the actor's rank 0); 'local' = a PyTriton child process of the run (own process group, stopped with it); 'deployment' = its Prefect deployment (critic-server/default, reward-server/default; on a cluster its own GPU node); 'kubernetes' = a LeaderWorkerSet the run creates on its cluster (deploy.cluster), reached through its pods' DNS names and deleted with the run.")
    host: str = Field("127.0.0.1", description="Interface the server binds (and the client connects to for launch=local).")
    port: Optional[int] = Field(None, ge=1, le=65535, description="HTTP port of the server; None = a free port picked at start.")
    max_queue_delay_us: int = Field(2000, ge=0, description="Dynamic-batching queue delay of the server's batched models.")
    torch_threads: Optional[PositiveInt] = Field(None, description="torch intra-op threads of the server process; None = 1 on a CPU-only host (it usually shares the cores with the actor; 2+2 threads on 2 cores ran ~4x slower), torch's default with CUDA.")
    ready_timeout_s: float = Field(READY_TIMEOUT_S, gt=0, description="How long to wait for the server to become ready; with launch=deployment, also for its flow run to start (a cold GPU node: 3-6 min to join, then the image pull and the model load). The run's log says every ~30 s what it waits for and how long it has waited; a local server that exits fails the wait at once.")
    request_timeout_s: float = Field(300.0, gt=0, description="Timeout of one request.")
    auth: Literal["secret", "none"] = Field("secret", description="'secret' = every request but liveness/readiness must be signed with a key derived from the run's secret (generated per run, handed to the server through its environment, never sent: components/wire.py), others are refused (401/403); 'none' = open mode: inference, model config and metadata answer anyone who reaches the port (NeMo-Aligner's own client sends no credentials); the server says so when it starts.")


class CriticPlacement(ServerPlacement):
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "host", "port", "max_queue_delay_us", "torch_threads", "ready_timeout_s", "request_timeout_s",
        "max_train_rows",
    )
    max_train_rows: PositiveInt = Field(4096, description="Largest critic_train batch (rows) the server accepts; a bigger one is refused naming `tokens` (critic_train is not batched by Triton, so its batch is bounded here).")
    nproc_per_node: PositiveInt = Field(1, description="Ranks of the critic server (one node): rank 0 serves HTTP, every rank holds an FSDP2 shard of the critic and computes its block of each batch (collectives: actor.backend, actor.collective_timeout_s).")


class RolloutPlacement(Section):
    """The vLLM rollout server (components/serving/rollout/; rollout.engine=vllm): its own process and
    environment (.venv-vllm; on a cluster its own pod), with its own copy of the actor's weights; `replicas` of them."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "python", "host", "port", "max_model_len", "kv_cache_gib", "gpu_memory_utilization", "enforce_eager",
        "threads", "cpu_cores", "ready_timeout_s", "request_timeout_s", "max_request_sequences",
        "max_request_tokens", "max_body_mib", "weight_transfer",
    )

    launch: Literal["local", "deployment", "kubernetes"] = Field("local", description="'local' = a child process of the run (own process group, stopped with it); 'deployment' = the rollout-server/default Prefect deployment (its own GPU node on a cluster); 'kubernetes' = a LeaderWorkerSet of `replicas` servers the run creates on its cluster (deploy.cluster; the vLLM image), deleted with the run.")
    python: str = Field(".venv-vllm/bin/python", description="Interpreter of the server's environment (`make vllm-venv`; an image with `vllm` on a cluster). Relative paths resolve against the project root.")
    host: str = Field("127.0.0.1", description="Interface the server binds (and the client connects to for launch=local).")
    port: Optional[int] = Field(None, ge=0, le=65535, description="HTTP port of the server (replica i: port + i); None or 0 = a free one picked at start; a busy port makes a local server pick a free one.")
    replicas: PositiveInt = Field(1, description="Independent rollout servers, each with its own copy of the weights: each iteration's prompts are spread over them at once (in equal shares of whole prompts: a prompt's samples all come from one replica, and are seeded by their place in the batch, so the samples do not depend on the replica count), and every replica is refit after every update.")
    tensor_parallel_size: PositiveInt = Field(1, description="GPUs each replica shards the model over (vLLM's tensor parallelism); more than 1 needs that many GPUs on the server's host (refused on a CPU host; on the cluster at most the GPUs of one server node, deploy.cluster.servers.gpus_per_node) and weight_transfer='dist' (each of the replica's GPU workers joins the weight-transfer group).")
    max_model_len: Optional[PositiveInt] = Field(None, description="Longest prompt + response the engine accepts (its KV cache is sized for it); None = the model's own limit (max_position_embeddings).")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV-cache space in GiB on a CPU host (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="Share of the GPU's memory vLLM may take (weights + KV cache) on a GPU host; the rest is left to a trainer on the same GPU and to NCCL.")
    enforce_eager: bool = Field(True, description="Run without CUDA graphs / torch.compile: starts in seconds instead of ~1 min; turn off for long runs on a GPU.")
    threads: Optional[PositiveInt] = Field(None, description="CPU threads of the engine (OMP_NUM_THREADS); None = every core on a CPU-only host (the actor waits while the server generates, the server idles while the actor trains), vLLM's default otherwise. Set it lower when other work shares the cores.")
    cpu_cores: Optional[str] = Field(None, coerce_numbers_to_str=True, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$", description="CPU cores the server runs on on a CPU host, every thread of its process (and vLLM's OpenMP threads bound to them: VLLM_CPU_OMP_THREADS_BIND), a Linux core list, e.g. '1', '2-3' or '0,4-5'; None = every core, vLLM's default binding. With asynchronous rollouts, keep the server and the actor on cores of their own (as separate pods would be).")
    ready_timeout_s: float = Field(READY_TIMEOUT_S, gt=0, description="How long to wait for every replica to load the model and answer /health; with launch=deployment, also how long its flow run may take to start and publish its address (a cold GPU node: 3-6 min to join, then the image pull and the model load). The run's log says every ~30 s what it waits for and how long it has waited; a local server that exits fails the wait at once.")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generate or weight-update request.")
    max_request_sequences: PositiveInt = Field(4096, description="Largest /generate request: prompts x n sampled sequences; a bigger one is refused (400) naming the fields.")
    max_request_tokens: PositiveInt = Field(1 << 23, description="Largest /generate request in new tokens: prompts x n x max_new_tokens; a bigger one is refused (400) naming the fields.")
    max_body_mib: PositiveInt = Field(32, description="Largest JSON request body (MiB) the server reads, checked from Content-Length before reading (a weight upload is bounded by the model's own size instead); 1,024 prompts of 2,048 tokens take ~13 MiB.")
    weight_transfer: Literal["http", "dist"] = Field("dist", description="How the actor's weights reach every replica after every update: 'dist' = a torch.distributed group per replica (actor rank 0 and the replica's workers; gloo on CPU, NCCL on GPUs), tensors broadcast one at a time and loaded as they arrive; 'http' = a safetensors body streamed to each replica's POST /update_weights (a server the actor cannot reach with a process group: only its HTTP port is open). Either way the replicas receive each tensor at once, gathered once.")

    @model_validator(mode="after")
    def _tensor_parallel_needs_dist(self):
        if self.tensor_parallel_size > 1 and self.weight_transfer == "http":
            raise ValueError(f"deploy.rollout.tensor_parallel_size={self.tensor_parallel_size} needs "
                             f"deploy.rollout.weight_transfer='dist': an HTTP body reaches the server's process, not "
                             f"the GPU workers that hold the model's shards")
        return self


class TrackingPlacement(Section):
    uri: Optional[str] = Field(None, description="MLflow tracking URI; None uses $MLFLOW_TRACKING_URI, else the local stack's server, else sqlite in state_dir.")
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory system metrics with the run.")


class CheckpointPlacement(Section):
    advanced: ClassVar[tuple[str, ...]] = ("lease_timeout_s",)  # --describe --all
    uri: Optional[str] = Field(None, description="file:///dir, a path, or s3://bucket/prefix; None uses <state_dir>/checkpoints. The run name is appended.")
    s3_endpoint_url: Optional[str] = Field(None, description="Endpoint of an S3-compatible store, for the checkpoints and for s3:// models and data (None = AWS or $AWS_ENDPOINT_URL_S3).")
    lease_timeout_s: float = Field(60.0, ge=5, description="One writer per run name: a run holds a lease on its checkpoint store (a file lock locally, a lease object created with a conditional put on S3, renewed every third of this); another run of the same name is refused while the lease is held, and takes a lease over that was not renewed for this long (its holder is gone; logged).")


class CachePlacement(Section):
    """How this deployment's processes bring models and data that are not local paths onto their machine
    (models/resolve.py): s3:// sources into a cache directory, hub ids into the Hugging Face cache."""

    dir: Optional[str] = Field(None, description="Where s3:// models and data and a run's stored reward files are fetched on each machine (once; a later run reuses them while their ETags are unchanged); a volume the run's pods share on a cluster fetches each once for all of them. None = $RLHF_CACHE_DIR, else <HF_HOME>/rlhf-flows (HF_HOME: ~/.cache/huggingface unless set; /cache/huggingface on the cluster's shared volume).")
    hub_downloads: bool = Field(False, description="Download a hub id (model or data set) that is not in the Hugging Face cache into it at run time, one process (or pod) at a time under a lock in the cache, the others waiting for it; false = nothing downloads at run time: a missing one fails naming its field and the `hf download` command. The cluster's deployments set true (the cache on the pods' shared volume); HF_HUB_OFFLINE=1 forbids it either way.")


class PodPlacement(Section):
    """Where the pods of one kind that a run creates on its cluster land, and what each asks of its node."""
    advanced: ClassVar[tuple[str, ...]] = ("shm_size", "tolerations")  # --describe --all

    cpu: str = Field("3", pattern=r"^[0-9]+(\.[0-9]+|m)?$", description="CPU request of each pod (a Kubernetes quantity); it must fit one node of the pool (infra/terraform/node_types.json: a g5.xlarge leaves about 3.8).")
    memory: str = Field("12Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Memory request and limit of each pod (a g5.xlarge leaves about 14.2Gi).")
    shm_size: str = Field("2Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Size of the in-memory /dev/shm of each pod (NCCL, data loaders); counts against memory.")
    gpus_per_node: PositiveInt = Field(1, le=8, description="GPUs of one node of the pool (the instance type's: g5.xlarge 1, g5.12xlarge 4, p4d.24xlarge 8): a pod never asks for more.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of each pod: the pool's node label (infra/terraform: rlhf/role).")
    tolerations: list[dict] = Field(default_factory=lambda: [dict(GPU_TOLERATION)], description="Tolerations of each pod: the GPU pools' taint nvidia.com/gpu=true:NoSchedule.")


class ClusterPlacement(Section):
    """The Kubernetes side of a run's own pods (the actor's node groups as a JobSet, servers as LeaderWorkerSets with
    launch=kubernetes): everything their specs need that the run's config does not say. The defaults fit what
    infra/terraform makes; None = read from the environment of the pod the run's controller runs in."""
    advanced: ClassVar[tuple[str, ...]] = (  # `rlhf config --describe --all` lists them
        "image_pull_policy", "actor_service_account", "server_service_account", "cache_claim", "cache_mount",
        "state_dir", "state_size", "env_from_controller", "env", "secret_env",
    )

    namespace: Optional[str] = Field(None, pattern=DNS_LABEL, description="Namespace of the run's objects; None = the namespace of the pod the run runs in (its service account's mount), else 'rlhf' (terraform output namespace).")
    image: Optional[str] = Field(None, description="Image of the actor's node pods and the critic/reward servers; None = $RLHF_IMAGE (prefect.yaml gives every flow pod the image it pushed).")
    vllm_image: Optional[str] = Field(None, description="Image of the rollout servers (docker/vllm.Dockerfile); None = $RLHF_VLLM_IMAGE.")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field("IfNotPresent", description="imagePullPolicy of the run's pods.")
    actor_service_account: str = Field("rlhf-actor", pattern=DNS_LABEL, description="Service account of the actor's node pods (terraform output actor_service_account_name: its IRSA role writes the run's checkpoints; RBAC lets it create the run's servers).")
    server_service_account: str = Field("rlhf-critic", pattern=DNS_LABEL, description="Service account of the server pods (terraform output critic_service_account_name).")
    queue: Optional[str] = Field("rlhf", pattern=DNS_LABEL, description="Kueue LocalQueue of the run's JobSet and LeaderWorkerSets (label kueue.x-k8s.io/queue-name): a JobSet's pods are admitted together or not at all; None = no Kueue (pods are scheduled one by one).")
    cache_claim: Optional[str] = Field("rlhf-cache", pattern=DNS_LABEL, description="PersistentVolumeClaim (ReadWriteMany, EFS: infra/terraform) mounted at cache_mount in every pod of the run: the Hugging Face cache (HF_HOME=<cache_mount>/huggingface), read-mostly; None = no shared cache.")
    cache_mount: str = Field("/cache", pattern=r"^/", description="Where every pod of the run mounts the shared cache.")
    state_dir: str = Field("/var/lib/rlhf", pattern=r"^/", description="RLHF_STATE_DIR of every pod of the run: an emptyDir of its own (logs, local copies); nothing is shared between pods through it (checkpoints live in the run's store).")
    state_size: str = Field("50Gi", pattern=r"^[0-9]+(Mi|Gi)$", description="Size limit of each pod's state directory.")
    actor: PodPlacement = Field(default_factory=lambda: PodPlacement(node_selector={"rlhf/role": "actor"}), description="The actor's node pods (one per node group, nproc_per_node GPUs each): the actor-gpu pool.")
    servers: PodPlacement = Field(default_factory=lambda: PodPlacement(node_selector={"rlhf/role": "critic"}), description="The critic, reward and rollout server pods: the critic-gpu pool.")
    env_from_controller: list[str] = Field(default_factory=lambda: ["PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_REGION", "AWS_DEFAULT_REGION", "RLHF_S3_BUCKET", "RLHF_S3_PREFIX", "DO_NOT_TRACK", "MLFLOW_DISABLE_TELEMETRY"], description="Environment variables every pod of the run copies from the controller's (those it has); never a secret: a pod's spec shows its values.")
    env: dict[str, str] = Field(default_factory=dict, description="More environment variables of every pod of the run (never a secret: use secret_env).")
    secret_env: dict[str, str] = Field(default_factory=dict, description="Environment variables every pod of the run takes from a Kubernetes Secret: NAME -> '<secret>/<key>' (a secretKeyRef: the value never appears in a spec), e.g. PREFECT_API_KEY -> prefect-api-key/key for Prefect Cloud.")

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


class DeployConfig(Section):
    """Where a run's parts run: processes, devices, hosts, ports, interpreters, cores, timeouts, tracking and storage
    URIs. Set by the deployment (prefect.yaml, `rlhf up`, `rlhf train`); a run's config never needs them."""
    advanced: ClassVar[tuple[str, ...]] = ("reference_device",)  # --describe --all

    state_dir: Optional[str] = Field(None, description="Local state directory (logs, local checkpoints and MLflow store, the local stack); None = $RLHF_STATE_DIR or ./.rlhf.")
    device: str = Field("auto", description="'auto' (cuda if available, else cpu), 'cpu' or 'cuda[:N]'. With several actor ranks, 'auto'/'cuda' mean each rank's own GPU (LOCAL_RANK).")
    reference_device: Literal["auto", "actor", "cpu"] = Field("auto", description="Where the frozen reference of a full fine-tune lives: 'actor' = the actor's device, sharded like the actor; 'cpu' = a CPU copy on every rank; 'auto' = the actor's device when its free memory holds the reference shard with a 20% margin, else CPU. (LoRA has no copy: adapters disabled.)")
    actor: ActorPlacement = Field(default_factory=ActorPlacement, description="Actor processes (data parallel, FSDP2).")
    critic: CriticPlacement = Field(default_factory=CriticPlacement, description="The critic server (algorithms with a critic).")
    reward: ServerPlacement = Field(default_factory=ServerPlacement, description="The reward server (algorithms without a critic, or a critic that does not carry the reward model).")
    rollout: RolloutPlacement = Field(default_factory=RolloutPlacement, description="The vLLM rollout server (rollout.engine=vllm).")
    tracking: TrackingPlacement = Field(default_factory=TrackingPlacement, description="The MLflow tracking server.")
    checkpoint: CheckpointPlacement = Field(default_factory=CheckpointPlacement, description="The checkpoint store (its s3_endpoint_url also serves s3:// models and data).")
    cluster: ClusterPlacement = Field(default_factory=ClusterPlacement, description="The run's own pods on Kubernetes (the actor's node groups with actor.launch=jobset, servers with launch=kubernetes).")
    cache: CachePlacement = Field(default_factory=CachePlacement, description="Models and data that are not local paths: s3:// sources and hub ids (models/resolve.py).")

    def resolved_state_dir(self) -> Path:
        return Path(self.state_dir).absolute() if self.state_dir else default_state_dir()
