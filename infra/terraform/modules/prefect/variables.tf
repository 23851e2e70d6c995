variable "actor_pool_name" {
  type        = string
  description = "Name of the Prefect work pool for the actor flows (ppo, reinforce)."
  default     = "actor-gpu"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,62}$", var.actor_pool_name))
    error_message = "actor_pool_name must be lowercase letters, digits and hyphens."
  }
}

variable "critic_pool_name" {
  type        = string
  description = "Name of the Prefect work pool for the critic and reward servers."
  default     = "critic-gpu"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,62}$", var.critic_pool_name))
    error_message = "critic_pool_name must be lowercase letters, digits and hyphens."
  }
}

variable "image" {
  type        = string
  description = "Default container image of both pools (a deployment may set job_variables.image)."

  validation {
    condition     = length(trimspace(var.image)) > 0 && !can(regex("\\s", var.image))
    error_message = "image must be a non-empty image reference without whitespace."
  }
}

variable "namespace" {
  type        = string
  description = "Kubernetes namespace of the flow-run jobs (fixed: not a job variable)."

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a valid Kubernetes namespace name."
  }
}

variable "actor_service_account_name" {
  type        = string
  description = "Service account of the actor pool's jobs (bound to the actor IRSA role; fixed: not a job variable)."

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.actor_service_account_name))
    error_message = "actor_service_account_name must be a valid Kubernetes name."
  }
}

variable "critic_service_account_name" {
  type        = string
  description = "Service account of the critic pool's jobs (bound to the critic IRSA role; fixed: not a job variable)."

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.critic_service_account_name))
    error_message = "critic_service_account_name must be a valid Kubernetes name."
  }
}

variable "actor_resources" {
  type = object({
    gpu_count = number
    cpu       = string
    memory    = string
    shm_size  = optional(string, "2Gi")
  })
  description = "Default resources of actor jobs. Must fit the allocatable capacity of one actor node (defaults fit a g5.xlarge)."
  default = {
    gpu_count = 1
    cpu       = "3"
    memory    = "12Gi"
  }

  validation {
    condition     = var.actor_resources.gpu_count >= 1 && var.actor_resources.gpu_count <= 8 && can(regex("^[0-9]+(\\.[0-9]+|m)?$", var.actor_resources.cpu)) && can(regex("^[0-9]+(Mi|Gi)$", var.actor_resources.memory))
    error_message = "actor_resources: gpu_count 1-8, cpu like 3 or 3500m, memory like 12Gi."
  }
}

variable "critic_resources" {
  type = object({
    gpu_count = number
    cpu       = string
    memory    = string
    shm_size  = optional(string, "2Gi")
  })
  description = "Default resources of critic/reward server jobs. Must fit one critic node (defaults fit a g5.xlarge)."
  default = {
    gpu_count = 1
    cpu       = "3"
    memory    = "12Gi"
  }

  validation {
    condition     = var.critic_resources.gpu_count >= 1 && var.critic_resources.gpu_count <= 8 && can(regex("^[0-9]+(\\.[0-9]+|m)?$", var.critic_resources.cpu)) && can(regex("^[0-9]+(Mi|Gi)$", var.critic_resources.memory))
    error_message = "critic_resources: gpu_count 1-8, cpu like 3 or 3500m, memory like 12Gi."
  }
}

variable "env" {
  type        = map(string)
  description = "Default environment variables of every job (e.g. MLFLOW_TRACKING_URI, RLHF_S3_BUCKET, AWS_REGION)."
  default     = {}
}

variable "pod_watch_timeout_seconds" {
  type        = number
  description = "Default seconds the worker waits for a pod to start; scale-from-zero GPU nodes need several minutes."
  default     = 900

  validation {
    condition     = var.pod_watch_timeout_seconds >= 60
    error_message = "pod_watch_timeout_seconds must be at least 60."
  }
}

variable "concurrency_limits" {
  type        = map(number)
  description = "Optional concurrency limit per pool name (e.g. { \"actor-gpu\" = 2 }); pools not listed are unlimited."
  default     = {}

  validation {
    condition     = alltrue([for v in values(var.concurrency_limits) : v >= 1])
    error_message = "Concurrency limits must be >= 1."
  }
}

variable "workspace_id" {
  type        = string
  description = "Prefect Cloud workspace ID; null uses the provider's workspace (or a self-hosted server)."
  default     = null
}

variable "paused" {
  type        = bool
  description = "Create the work pools paused (no flow runs are picked up)."
  default     = false
}

variable "backoff_limit" {
  type        = number
  description = "Times Kubernetes starts a flow-run pod again after a disruption (eviction, preemption, a node drained or reclaimed: the pod condition DisruptionTarget); the flow run goes on in the new pod (Prefect's worker then sets PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=relinquish) and a training run resumes from its last checkpoint. A pod that exits non-zero fails its Job at once (podFailurePolicy). 0 would make Prefect reschedule a disrupted run as a new flow run, without bound."
  default     = 2

  validation {
    condition     = var.backoff_limit >= 1 && var.backoff_limit <= 10 && floor(var.backoff_limit) == var.backoff_limit
    error_message = "backoff_limit must be an integer from 1 to 10 (0 turns on Prefect's unbounded rescheduling)."
  }
}

variable "state_dir" {
  type        = string
  description = "Where every flow-run pod keeps its own state (RLHF_STATE_DIR: logs, local copies): an emptyDir mounted there, gone with the pod. Checkpoints live in S3."
  default     = "/var/lib/rlhf"

  validation {
    condition     = startswith(var.state_dir, "/")
    error_message = "state_dir must be an absolute path."
  }
}

variable "cache_mount" {
  type        = string
  description = "Where every flow-run pod mounts the shared Hugging Face cache volume (HF_HOME=<this>/huggingface)."
  default     = "/cache"

  validation {
    condition     = startswith(var.cache_mount, "/")
    error_message = "cache_mount must be an absolute path."
  }
}

variable "cache_claim" {
  type        = string
  description = "PersistentVolumeClaim (ReadWriteMany, EFS) of the shared Hugging Face cache, in the jobs' namespace."
  default     = "rlhf-cache"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.cache_claim))
    error_message = "cache_claim must be a valid Kubernetes name."
  }
}
