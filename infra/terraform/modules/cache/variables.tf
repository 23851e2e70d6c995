variable "name" {
  type        = string
  description = "Environment name: prefixes the file system, its security group and the CSI driver's role."
}

variable "cluster_name" {
  type        = string
  description = "Name of the EKS cluster (the CSI driver add-on is installed there)."
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster."
}

variable "vpc_cidr_block" {
  type        = string
  description = "CIDR of the VPC: NFS is open to it only."
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets of the nodes: one mount target each."
}

variable "oidc_provider_arn" {
  type        = string
  description = "ARN of the cluster's IAM OIDC provider (IRSA of the CSI driver)."
}

variable "oidc_issuer_url" {
  type        = string
  description = "OIDC issuer URL of the cluster."
}

variable "namespace" {
  type        = string
  description = "Namespace of the pods that mount the cache (the claim lives there)."
}

variable "claim_name" {
  type        = string
  description = "Name of the ReadWriteMany claim every pod mounts at /cache (deploy.cluster.cache_claim; the work pools' cache_claim)."
  default     = "rlhf-cache"
}

variable "efs_csi_version" {
  type        = string
  description = "Version of the aws-efs-csi-driver EKS add-on; null = the cluster version's default."
  default     = null
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource of this module."
  default     = {}
}
