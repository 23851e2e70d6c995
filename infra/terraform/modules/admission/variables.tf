variable "name" {
  type        = string
  description = "Name of the ValidatingAdmissionPolicy and of its binding."
  default     = "rlhf-run"
}

variable "namespace" {
  type        = string
  description = "Namespace of the runs: the policy applies to requests for objects there."
}

variable "actor_service_account_name" {
  type        = string
  description = "Service account of the pods that create a run's objects (flow-run pods, node groups): its requests are checked, and a JobSet's pods must run as it."
}

variable "server_service_account_name" {
  type        = string
  description = "Service account of a run's server pods: its requests are checked, and a LeaderWorkerSet's pods must run as it."
}

variable "image_repositories" {
  type        = list(string)
  description = "Repositories a run's pods may run images from (<registry>/<name>, any tag or digest): the project's own."

  validation {
    condition     = length(var.image_repositories) > 0 && alltrue([for r in var.image_repositories : can(regex("^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+$", r))])
    error_message = "image_repositories must name at least one repository, each <registry>/<path> without a tag."
  }
}

variable "cache_claim" {
  type        = string
  description = "The one PersistentVolumeClaim a run's pods may mount (the shared Hugging Face cache)."
}

variable "shared_secrets" {
  type        = list(string)
  description = "Secrets every run's pods may read through their environment (deploy.cluster.secret_env), e.g. the Prefect API key; all other Secrets a run's pods reference must be its own."
  default     = []
}
