variable "region" {
  type        = string
  description = "AWS region of the environment, e.g. us-east-1."

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "name" {
  type        = string
  description = "Environment name; prefixes the VPC, cluster, roles and default bucket name."
  default     = "rlhf-dev"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,22}[a-z0-9]$", var.name))
    error_message = "name must be 3-24 chars of lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones to use (at least two; check that they offer the chosen GPU instance types)."

  validation {
    condition     = length(var.availability_zones) >= 2
    error_message = "Give at least two availability zones."
  }
}

variable "vpc_cidr" {
  type        = string
  description = "IPv4 CIDR of the VPC; subnets are carved from it (/20 private, /24 public per zone)."
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0)) && tonumber(split("/", var.vpc_cidr)[1]) <= 16
    error_message = "vpc_cidr must be a valid IPv4 CIDR of size /16 or larger."
  }
}

variable "kubernetes_version" {
  type        = string
  description = "EKS Kubernetes version (the run's objects are validated for 1.32 and 1.35: tests/infra/schemas.py)."
  default     = "1.35"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.31."
  }
}

variable "cluster_endpoint_public_access" {
  type        = bool
  description = "Expose the EKS API publicly (restricted to cluster_public_access_cidrs), e.g. to run Terraform from a laptop. Off by default."
  default     = false
}

variable "cluster_public_access_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the public EKS API endpoint (your office/VPN egress, never 0.0.0.0/0)."
  default     = []

  validation {
    condition     = alltrue([for c in var.cluster_public_access_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "cluster_public_access_cidrs must be valid CIDRs other than 0.0.0.0/0."
  }
}

variable "cluster_admin_principal_arns" {
  type        = list(string)
  description = "Extra IAM role/user ARNs given cluster-admin (not the principal running Terraform: it is admin already)."
  default     = []
}

variable "gpu_pools" {
  type = map(object({
    instance_types = list(string)
    min_size       = optional(number, 0)
    max_size       = optional(number, 2)
    desired_size   = optional(number, 0)
    disk_size_gb   = optional(number, 200)
    capacity_type  = optional(string, "ON_DEMAND")
    ami_type       = optional(string, "AL2023_x86_64_NVIDIA")
    gpus_per_node  = optional(number, 1)
  }))
  description = "GPU node groups keyed by RLHF role (exactly the keys actor and critic)."
  default = {
    actor = {
      instance_types = ["g5.xlarge"]
    }
    critic = {
      instance_types = ["g5.xlarge"]
    }
  }

  validation {
    condition     = length(var.gpu_pools) == 2 && alltrue([for role in keys(var.gpu_pools) : contains(["actor", "critic"], role)])
    error_message = "gpu_pools must have exactly the keys actor and critic."
  }
}

variable "bucket_name" {
  type        = string
  description = "Name of the artifacts bucket; null derives <name>-artifacts-<account id>."
  default     = null
}

variable "bucket_force_destroy" {
  type        = bool
  description = "Let terraform destroy delete the bucket with its checkpoints (dev only)."
  default     = false
}

variable "s3_prefix" {
  type        = string
  description = "Key prefix in the bucket used by the flows and servers (the pod roles are limited to it)."
  default     = "rlhf/"
}

variable "checkpoint_prefix" {
  type        = string
  description = "Key prefix of training checkpoints (lifecycle rules expire their old versions); keep it under s3_prefix."
  default     = "rlhf/checkpoints/"
}

variable "namespace" {
  type        = string
  description = "Kubernetes namespace of the flow-run jobs and service accounts."
  default     = "rlhf"
}

variable "actor_service_account_name" {
  type        = string
  description = "Kubernetes service account of the actor flow runs."
  default     = "rlhf-actor"
}

variable "critic_service_account_name" {
  type        = string
  description = "Kubernetes service account of the critic/reward servers."
  default     = "rlhf-critic"
}

variable "manage_kubernetes_resources" {
  type        = bool
  description = "Create the namespace and IRSA-annotated service accounts with the kubernetes provider (needs network access to the EKS API)."
  default     = true
}

variable "container_image" {
  type        = string
  description = "Default image of both work pools, e.g. 123456789012.dkr.ecr.us-east-1.amazonaws.com/rlhf-flows:0.1.0."
}

variable "job_env" {
  type        = map(string)
  description = "Extra default environment variables of every flow-run job (merged over AWS_REGION, RLHF_S3_BUCKET, RLHF_S3_PREFIX)."
  default     = {}
}

variable "actor_job_resources" {
  type = object({
    gpu_count = number
    cpu       = string
    memory    = string
    shm_size  = optional(string, "2Gi")
  })
  description = "Default resources of actor jobs (must fit one actor node)."
  default = {
    gpu_count = 1
    cpu       = "3"
    memory    = "12Gi"
  }
}

variable "critic_job_resources" {
  type = object({
    gpu_count = number
    cpu       = string
    memory    = string
    shm_size  = optional(string, "2Gi")
  })
  description = "Default resources of critic/reward server jobs (must fit one critic node)."
  default = {
    gpu_count = 1
    cpu       = "3"
    memory    = "12Gi"
  }
}

variable "prefect_api_url" {
  type        = string
  description = "Prefect API URL (Prefect Cloud: https://api.prefect.cloud; self-hosted: https://prefect.example.com/api). The API key comes from PREFECT_API_KEY."
  default     = "https://api.prefect.cloud"

  validation {
    condition     = can(regex("^https?://", var.prefect_api_url))
    error_message = "prefect_api_url must be an http(s) URL."
  }
}

variable "prefect_account_id" {
  type        = string
  description = "Prefect Cloud account ID (null for a self-hosted server)."
  default     = null
}

variable "prefect_workspace_id" {
  type        = string
  description = "Prefect Cloud workspace ID (null for a self-hosted server)."
  default     = null
}

variable "tags" {
  type        = map(string)
  description = "Tags applied to every AWS resource (provider default_tags)."
  default     = {}
}

variable "prefect_api_key" {
  type        = string
  description = "Prefect Cloud API key for the workers and the flow-run pods (kept in the Secret prefect-api-key); from TF_VAR_prefect_api_key, never a tfvars file. null for a self-hosted server without one."
  default     = null
  sensitive   = true
}

variable "cluster_autoscaler_image_tag" {
  type        = string
  description = "Cluster autoscaler release: its minor version must be kubernetes_version's (checked)."
  default     = "v1.35.2"
}

variable "queue_name" {
  type        = string
  description = "Kueue ClusterQueue and LocalQueue of the runs' JobSets and LeaderWorkerSets (deploy.cluster.queue)."
  default     = "rlhf"
}

variable "cache_claim_name" {
  type        = string
  description = "ReadWriteMany claim of the shared Hugging Face cache, mounted at /cache in every pod (deploy.cluster.cache_claim)."
  default     = "rlhf-cache"
}

variable "extra_image_repositories" {
  type        = list(string)
  description = "Repositories, besides the project's ECR repositories, whose images a run's pods may run (<registry>/<path>, any tag or digest), e.g. where container_image lives when it is not the project's ECR."
  default     = []
}

variable "in_vpc_egress" {
  type = list(object({
    cidr = string
    port = number
  }))
  description = "Services inside the VPC every pod of the namespace may reach (CIDR and TCP port), e.g. an internal MLflow or Prefect server; outside the VPC everything but the link-local range is reachable."
  default     = []

  validation {
    condition     = alltrue([for e in var.in_vpc_egress : can(cidrhost(e.cidr, 0)) && e.port > 0 && e.port < 65536])
    error_message = "Each in_vpc_egress entry needs a CIDR and a TCP port (1-65535)."
  }
}
