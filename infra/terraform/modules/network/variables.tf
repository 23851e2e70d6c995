variable "name" {
  type        = string
  description = "Name prefix for every network resource (usually the environment name, e.g. rlhf-dev)."

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 chars of lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "cidr_block" {
  type        = string
  description = "IPv4 CIDR of the VPC, e.g. 10.40.0.0/16."

  validation {
    condition     = can(cidrhost(var.cidr_block, 0)) && tonumber(split("/", var.cidr_block)[1]) <= 20
    error_message = "cidr_block must be a valid IPv4 CIDR of size /20 or larger."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones to spread subnets over (EKS needs at least two)."

  validation {
    condition     = length(var.availability_zones) >= 2 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "Give at least two distinct availability zones."
  }
}

variable "private_subnet_cidrs" {
  type        = list(string)
  description = "CIDRs of the private subnets (EKS nodes and pods), one per availability zone, in the same order."

  validation {
    condition     = alltrue([for c in var.private_subnet_cidrs : can(cidrhost(c, 0))])
    error_message = "Every private subnet CIDR must be a valid IPv4 CIDR."
  }
}

variable "public_subnet_cidrs" {
  type        = list(string)
  description = "CIDRs of the public subnets (NAT gateways, internet-facing load balancers), one per availability zone."

  validation {
    condition     = alltrue([for c in var.public_subnet_cidrs : can(cidrhost(c, 0))])
    error_message = "Every public subnet CIDR must be a valid IPv4 CIDR."
  }
}

variable "single_nat_gateway" {
  type        = bool
  description = "Use one NAT gateway for all private subnets (cheaper, not zone-redundant) instead of one per zone."
  default     = true
}

variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster that will use these subnets (used for the kubernetes.io/cluster/<name> discovery tags)."

  validation {
    condition     = can(regex("^[a-zA-Z][a-zA-Z0-9-]{0,99}$", var.cluster_name))
    error_message = "cluster_name must start with a letter and contain only letters, digits and hyphens (max 100)."
  }
}

variable "flow_log_traffic_type" {
  type        = string
  description = "Which traffic the VPC flow logs capture: ACCEPT, REJECT or ALL."
  default     = "ALL"

  validation {
    condition     = contains(["ACCEPT", "REJECT", "ALL"], var.flow_log_traffic_type)
    error_message = "flow_log_traffic_type must be ACCEPT, REJECT or ALL."
  }
}

variable "flow_log_retention_days" {
  type        = number
  description = "Retention of the flow-log CloudWatch log group, in days (a value CloudWatch accepts, at least 365)."
  default     = 365

  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days must be a CloudWatch retention value of at least 365 days."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
