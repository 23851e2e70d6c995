variable "name_prefix" {
  type        = string
  description = "Prefix of the IAM role names (usually the environment name)."

  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,31}$", var.name_prefix))
    error_message = "name_prefix must be 1-32 chars of letters, digits and hyphens, starting with a letter."
  }
}

variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster (scopes the cluster-autoscaler permissions to its Auto Scaling groups)."

  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,99}$", var.cluster_name))
    error_message = "cluster_name must start with a letter and contain only letters, digits and hyphens."
  }
}

variable "oidc_provider_arn" {
  type        = string
  description = "ARN of the cluster's IAM OIDC provider (module cluster output oidc_provider_arn)."

  validation {
    condition     = can(regex("^arn:aws[a-zA-Z-]*:iam::[0-9]{12}:oidc-provider/.+$", var.oidc_provider_arn))
    error_message = "oidc_provider_arn must be an IAM OIDC provider ARN."
  }
}

variable "oidc_issuer_url" {
  type        = string
  description = "OIDC issuer URL of the cluster (https://oidc.eks.<region>.amazonaws.com/id/...)."

  validation {
    condition     = startswith(var.oidc_issuer_url, "https://")
    error_message = "oidc_issuer_url must start with https://."
  }
}

variable "bucket_arn" {
  type        = string
  description = "ARN of the artifacts bucket the pod roles may use."

  validation {
    condition     = can(regex("^arn:aws[a-zA-Z-]*:s3:::[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_arn))
    error_message = "bucket_arn must be an S3 bucket ARN (arn:aws:s3:::name)."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "ARN of the KMS key encrypting the bucket (SSE-KMS)."

  validation {
    condition     = can(regex("^arn:aws[a-zA-Z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.kms_key_arn))
    error_message = "kms_key_arn must be a KMS key ARN."
  }
}

variable "store_key_secret_arn" {
  type        = string
  description = "ARN of the Secrets Manager secret holding the deployment's store key (module artifacts output store_key_secret_arn); the pod roles may read it."

  validation {
    condition     = can(regex("^arn:aws[a-zA-Z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:.+$", var.store_key_secret_arn))
    error_message = "store_key_secret_arn must be a Secrets Manager secret ARN."
  }
}

variable "s3_prefix" {
  type        = string
  description = "Key prefix (ending with '/') inside the bucket that the pod roles may read and write, e.g. rlhf/. Access is limited to it."
  default     = "rlhf/"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$", var.s3_prefix))
    error_message = "s3_prefix must be a non-empty relative key prefix ending with '/', e.g. rlhf/."
  }
}

variable "checkpoint_prefix" {
  type        = string
  description = "Key prefix (ending with '/', inside s3_prefix) of the runs' checkpoint stores: <checkpoint_prefix><run_name>/. A session tagged run=<run_name> writes only that run's store (the critic role only its pending saves there); leases, latest.json and commit points are written only by conditional puts."
  default     = "rlhf/checkpoints/"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be a non-empty relative key prefix ending with '/', e.g. rlhf/checkpoints/."
  }
}

variable "namespace" {
  type        = string
  description = "Kubernetes namespace of the RLHF service accounts."
  default     = "rlhf"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a valid Kubernetes namespace name."
  }
}

variable "actor_service_account_name" {
  type        = string
  description = "Service account of the actor flow runs (PPO / REINFORCE); it gets read-write access to the prefix."
  default     = "rlhf-actor"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.actor_service_account_name))
    error_message = "actor_service_account_name must be a valid Kubernetes name."
  }
}

variable "critic_service_account_name" {
  type        = string
  description = "Service account of the critic and reward servers."
  default     = "rlhf-critic"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$", var.critic_service_account_name))
    error_message = "critic_service_account_name must be a valid Kubernetes name."
  }
}

variable "critic_read_only" {
  type        = bool
  description = "Give the critic role read-only S3 access (set true if the critic servers never upload their saves to the run's store)."
  default     = false
}

variable "create_cluster_autoscaler_role" {
  type        = bool
  description = "Create an IRSA role for the cluster autoscaler (kube-system/cluster-autoscaler), needed for scale-from-zero GPU pools."
  default     = true
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
