variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster the node group joins."

  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,99}$", var.cluster_name))
    error_message = "cluster_name must start with a letter and contain only letters, digits and hyphens."
  }
}

variable "name" {
  type        = string
  description = "Node group name, e.g. actor-gpu."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}$", var.name))
    error_message = "name must be 2-39 chars of lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "role" {
  type        = string
  description = "Which RLHF workload this pool runs; becomes the node label rlhf/role (actor = policy/reference flow runs, critic = critic/reward servers)."

  validation {
    condition     = contains(["actor", "critic"], var.role)
    error_message = "role must be \"actor\" or \"critic\"."
  }
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnet IDs the GPU nodes are launched in."

  validation {
    condition     = length(var.subnet_ids) > 0 && alltrue([for s in var.subnet_ids : startswith(s, "subnet-")])
    error_message = "Give at least one subnet ID (subnet-...)."
  }
}

variable "instance_types" {
  type        = list(string)
  description = "GPU instance types for the pool, e.g. [\"g5.xlarge\"] (several types only make sense with capacity_type SPOT)."

  validation {
    condition     = length(var.instance_types) > 0 && alltrue([for t in var.instance_types : can(regex("^(g4dn|g5|g5g|g6|g6e|gr6|p3|p4d|p4de|p5|p5e|p5en)\\.[0-9a-z]+$", t))])
    error_message = "instance_types must be NVIDIA GPU instance types (g4dn, g5, g6, g6e, gr6, p3, p4d, p4de, p5, p5e, p5en families)."
  }
}

variable "ami_type" {
  type        = string
  description = "EKS-optimised AMI type with NVIDIA drivers."
  default     = "AL2023_x86_64_NVIDIA"

  validation {
    condition     = contains(["AL2023_x86_64_NVIDIA", "AL2_x86_64_GPU", "BOTTLEROCKET_x86_64_NVIDIA"], var.ami_type)
    error_message = "ami_type must be a GPU AMI type: AL2023_x86_64_NVIDIA, AL2_x86_64_GPU or BOTTLEROCKET_x86_64_NVIDIA."
  }
}

variable "capacity_type" {
  type        = string
  description = "ON_DEMAND or SPOT. Spot suits the critic/reward servers less than short, checkpointed actor runs."
  default     = "ON_DEMAND"

  validation {
    condition     = contains(["ON_DEMAND", "SPOT"], var.capacity_type)
    error_message = "capacity_type must be ON_DEMAND or SPOT."
  }
}

variable "min_size" {
  type        = number
  description = "Minimum number of nodes. 0 lets the pool scale to zero when no flow run needs it."
  default     = 0

  validation {
    condition     = var.min_size >= 0 && floor(var.min_size) == var.min_size
    error_message = "min_size must be an integer >= 0."
  }
}

variable "max_size" {
  type        = number
  description = "Maximum number of nodes (caps spend)."
  default     = 2

  validation {
    condition     = var.max_size >= 1 && var.max_size <= 100 && floor(var.max_size) == var.max_size
    error_message = "max_size must be an integer between 1 and 100."
  }
}

variable "desired_size" {
  type        = number
  description = "Initial number of nodes; afterwards the cluster autoscaler owns it (changes are ignored)."
  default     = 0

  validation {
    condition     = var.desired_size >= 0 && floor(var.desired_size) == var.desired_size
    error_message = "desired_size must be an integer >= 0."
  }
}

variable "disk_size_gb" {
  type        = number
  description = "Root volume size per node in GiB (container images with CUDA + model weights are large)."
  default     = 200

  validation {
    condition     = var.disk_size_gb >= 50 && var.disk_size_gb <= 16384
    error_message = "disk_size_gb must be between 50 and 16384."
  }
}

variable "gpus_per_node" {
  type        = number
  description = "GPUs per instance of the chosen type (g5.xlarge: 1, g6e.12xlarge: 4, p4d.24xlarge: 8); advertised to the cluster autoscaler for scale-from-zero."
  default     = 1

  validation {
    condition     = contains([1, 2, 4, 8], var.gpus_per_node)
    error_message = "gpus_per_node must be 1, 2, 4 or 8."
  }
}

variable "extra_labels" {
  type        = map(string)
  description = "Additional Kubernetes node labels (rlhf/role is always set from var.role and cannot be overridden)."
  default     = {}
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
