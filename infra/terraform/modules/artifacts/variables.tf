variable "bucket_name" {
  type        = string
  description = "Globally unique name of the S3 bucket holding checkpoints, MLflow artifacts and rollouts."

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name)) && !can(regex("\\.\\.|^xn--|-s3alias$", var.bucket_name))
    error_message = "bucket_name must be a valid S3 bucket name (3-63 chars, lowercase letters, digits, dots, hyphens)."
  }
}

variable "checkpoint_prefix" {
  type        = string
  description = "Key prefix under which training checkpoints are written (lifecycle rules target it). No leading slash, trailing slash required."
  default     = "checkpoints/"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-]+(/[A-Za-z0-9!_.*'()-]+)*/$", var.checkpoint_prefix))
    error_message = "checkpoint_prefix must be a relative key prefix ending with '/', e.g. checkpoints/."
  }
}

variable "noncurrent_version_expiration_days" {
  type        = number
  description = "Days after which overwritten/deleted (noncurrent) versions of checkpoints under checkpoint_prefix are removed."
  default     = 30

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && var.noncurrent_version_expiration_days <= 3650
    error_message = "noncurrent_version_expiration_days must be between 1 and 3650."
  }
}

variable "newer_noncurrent_versions_to_keep" {
  type        = number
  description = "Number of most recent noncurrent versions of each checkpoint kept regardless of age."
  default     = 3

  validation {
    condition     = var.newer_noncurrent_versions_to_keep >= 0 && var.newer_noncurrent_versions_to_keep <= 100
    error_message = "newer_noncurrent_versions_to_keep must be between 0 and 100."
  }
}

variable "checkpoint_expiration_days" {
  type        = number
  description = "Days after which current checkpoint objects under checkpoint_prefix expire; 0 keeps them forever."
  default     = 0

  validation {
    condition     = var.checkpoint_expiration_days >= 0 && var.checkpoint_expiration_days <= 3650
    error_message = "checkpoint_expiration_days must be between 0 (never) and 3650."
  }
}

variable "abort_incomplete_multipart_upload_days" {
  type        = number
  description = "Days after which incomplete multipart uploads (interrupted checkpoint writes) are aborted."
  default     = 7

  validation {
    condition     = var.abort_incomplete_multipart_upload_days >= 1 && var.abort_incomplete_multipart_upload_days <= 365
    error_message = "abort_incomplete_multipart_upload_days must be between 1 and 365."
  }
}

variable "force_destroy" {
  type        = bool
  description = "Allow terraform destroy to delete a non-empty bucket (all checkpoints are lost). Keep false outside throwaway environments."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
