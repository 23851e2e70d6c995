variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster (the autoscaler discovers its node groups by it)."
}

variable "region" {
  type        = string
  description = "AWS region of the cluster."
}

variable "namespace" {
  type        = string
  description = "Namespace of the flow-run jobs: the Prefect workers and the Kueue LocalQueue live there."
}

variable "chart_versions" {
  type = object({
    nvidia_device_plugin = string
    cluster_autoscaler   = string
    jobset               = string
    lws                  = string
    kueue                = string
    prefect_worker       = string
  })
  description = "Pinned chart versions. JobSet, LeaderWorkerSet and Kueue: their objects are validated against these charts' CRDs in tests/infra/crds; change both together."
  default = {
    nvidia_device_plugin = "0.20.0"
    cluster_autoscaler   = "9.59.0"
    jobset               = "0.12.0"
    lws                  = "0.10.0"
    kueue                = "0.19.2"
    prefect_worker       = "2026.8.18172642"
  }

  validation {
    condition     = alltrue([for v in values(var.chart_versions) : can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", v))])
    error_message = "Every chart version must be an exact version (x.y.z), never a range."
  }
}

variable "cluster_autoscaler_image_tag" {
  type        = string
  description = "Cluster autoscaler image tag: its minor version must be the cluster's Kubernetes minor version."
  default     = "v1.35.2"

  validation {
    condition     = can(regex("^v1\\.[0-9]+\\.[0-9]+$", var.cluster_autoscaler_image_tag))
    error_message = "cluster_autoscaler_image_tag must look like v1.35.2."
  }
}

variable "cluster_autoscaler_role_arn" {
  type        = string
  description = "IRSA role of the cluster autoscaler's service account (kube-system/cluster-autoscaler)."
}

variable "scale_down_unneeded_time" {
  type        = string
  description = "How long a GPU node stays idle before the autoscaler removes it."
  default     = "5m"
}

variable "gpu_pools" {
  type = map(object({
    instance_types = list(string)
    max_size       = number
    gpus_per_node  = number
  }))
  description = "The GPU node groups (keys actor and critic): the Kueue quotas are max_size nodes of each."
}

variable "node_types" {
  type        = map(object({ vcpu = number, memory_gib = number, gpus = number }))
  description = "vCPUs, memory and GPUs of each instance type (infra/terraform/node_types.json)."
}

variable "queue_name" {
  type        = string
  description = "Name of the Kueue ClusterQueue and of the LocalQueue in the namespace (deploy.cluster.queue)."
  default     = "rlhf"
}

variable "work_pools" {
  type        = list(string)
  description = "Prefect work pools, one worker each."
}

variable "prefect_api_url" {
  type        = string
  description = "Prefect API URL of a self-hosted server (used when prefect_account_id is null)."
}

variable "prefect_account_id" {
  type        = string
  description = "Prefect Cloud account ID; null for a self-hosted server."
  default     = null
}

variable "prefect_workspace_id" {
  type        = string
  description = "Prefect Cloud workspace ID."
  default     = null
}

variable "prefect_api_key_secret" {
  type        = string
  description = "Kubernetes Secret (key `key`) holding the Prefect Cloud API key in the namespace; the workers pass it on to the jobs as a secretKeyRef."
  default     = "prefect-api-key"
}

variable "prefect_worker_image_tag" {
  type        = string
  description = "Tag of the prefecthq/prefect worker image: the project's Prefect version (pyproject.toml), with its Kubernetes extra."
  default     = "3.8.8-python3.11-kubernetes"
}
