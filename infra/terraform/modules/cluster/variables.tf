variable "name" {
  type        = string
  description = "Name of the EKS cluster."

  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,99}$", var.name))
    error_message = "name must start with a letter and contain only letters, digits and hyphens (max 100)."
  }
}

variable "kubernetes_version" {
  type        = string
  description = "Kubernetes minor version of the control plane, e.g. 1.35."
  default     = "1.35"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.31."
  }
}

variable "vpc_id" {
  type        = string
  description = "ID of the VPC the cluster lives in."

  validation {
    condition     = startswith(var.vpc_id, "vpc-")
    error_message = "vpc_id must be a VPC ID (vpc-...)."
  }
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnet IDs for the control-plane ENIs and the system node group (at least two zones)."

  validation {
    condition     = length(var.subnet_ids) >= 2 && alltrue([for s in var.subnet_ids : startswith(s, "subnet-")])
    error_message = "Give at least two subnet IDs (subnet-...)."
  }
}

variable "endpoint_private_access" {
  type        = bool
  description = "Expose the Kubernetes API inside the VPC (nodes use it). Keep true."
  default     = true
}

variable "endpoint_public_access" {
  type        = bool
  description = "Also expose the Kubernetes API on the internet, restricted to public_access_cidrs. Off by default."
  default     = false
}

variable "public_access_cidrs" {
  type        = list(string)
  description = "CIDRs allowed to reach the public API endpoint when endpoint_public_access is true. 0.0.0.0/0 is refused."
  default     = []

  validation {
    condition     = alltrue([for c in var.public_access_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "public_access_cidrs must be valid CIDRs and must not contain 0.0.0.0/0."
  }
}

variable "enabled_log_types" {
  type        = list(string)
  description = "Control-plane log types shipped to CloudWatch."
  default     = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  validation {
    condition     = alltrue([for t in var.enabled_log_types : contains(["api", "audit", "authenticator", "controllerManager", "scheduler"], t)])
    error_message = "enabled_log_types may only contain api, audit, authenticator, controllerManager, scheduler."
  }
}

variable "log_retention_days" {
  type        = number
  description = "Retention of the control-plane CloudWatch log group, in days (a CloudWatch value, at least 365)."
  default     = 365

  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a CloudWatch retention value of at least 365 days."
  }
}

variable "admin_principal_arns" {
  type        = list(string)
  description = "IAM principal ARNs granted cluster-admin through EKS access entries (the role that runs Terraform gets it automatically)."
  default     = []

  validation {
    condition     = alltrue([for a in var.admin_principal_arns : can(regex("^arn:aws[a-zA-Z-]*:iam::[0-9]{12}:(role|user)/.+$", a))])
    error_message = "admin_principal_arns must be IAM role or user ARNs."
  }
}

variable "system_node_instance_types" {
  type        = list(string)
  description = "Instance types of the small CPU node group running cluster services (CoreDNS, Prefect workers, autoscaler)."
  default     = ["m6i.large"]

  validation {
    condition     = length(var.system_node_instance_types) > 0
    error_message = "Give at least one system node instance type."
  }
}

variable "system_node_min_size" {
  type        = number
  description = "Minimum size of the system node group (at least 1: CoreDNS and the Prefect workers live there)."
  default     = 1

  validation {
    condition     = var.system_node_min_size >= 1 && floor(var.system_node_min_size) == var.system_node_min_size
    error_message = "system_node_min_size must be an integer >= 1."
  }
}

variable "system_node_max_size" {
  type        = number
  description = "Maximum size of the system node group."
  default     = 3

  validation {
    condition     = var.system_node_max_size >= 1 && floor(var.system_node_max_size) == var.system_node_max_size
    error_message = "system_node_max_size must be an integer >= 1."
  }
}

variable "system_node_desired_size" {
  type        = number
  description = "Initial desired size of the system node group (later changes by the autoscaler are ignored)."
  default     = 2

  validation {
    condition     = var.system_node_desired_size >= 1 && floor(var.system_node_desired_size) == var.system_node_desired_size
    error_message = "system_node_desired_size must be an integer >= 1."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}

variable "vpc_cni_version" {
  type        = string
  description = "Version of the vpc-cni add-on (network policy enforcement needs v1.14.0 or later); null = the cluster version's default."
  default     = null
}
