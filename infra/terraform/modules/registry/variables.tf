variable "name_prefix" {
  type        = string
  description = "Prefix of the KMS key's description (usually the environment name)."
}

variable "repositories" {
  type        = list(string)
  description = "ECR repositories to create: the actor image and the vLLM image ($RLHF_IMAGE, $RLHF_VLLM_IMAGE)."
  default     = ["rlhf-flows", "rlhf-flows-vllm"]

  validation {
    condition     = alltrue([for r in var.repositories : can(regex("^[a-z0-9]+(?:[._-][a-z0-9]+)*(/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$", r))])
    error_message = "Repository names must be lowercase ECR names (letters, digits, . _ - and /)."
  }
}

variable "force_delete" {
  type        = bool
  description = "Let terraform destroy delete repositories that still hold images."
  default     = false
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
