output "name" {
  description = "Name of the EKS cluster."
  value       = aws_eks_cluster.this.name
}

output "arn" {
  description = "ARN of the EKS cluster."
  value       = aws_eks_cluster.this.arn
}

output "endpoint" {
  description = "URL of the Kubernetes API server."
  value       = aws_eks_cluster.this.endpoint
}

output "certificate_authority_data" {
  description = "Base64-encoded CA certificate of the API server."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "kubernetes_version" {
  description = "Kubernetes version of the control plane."
  value       = aws_eks_cluster.this.version
}

output "cluster_security_group_id" {
  description = "Security group EKS created for the control plane and managed nodes."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "ARN of the IAM OIDC provider used for IRSA."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer_url" {
  description = "OIDC issuer URL of the cluster (https://...)."
  value       = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

output "kms_key_arn" {
  description = "ARN of the KMS key encrypting Kubernetes secrets and control-plane logs."
  value       = aws_kms_key.this.arn
}

output "system_node_group_name" {
  description = "Name of the CPU node group running cluster services."
  value       = aws_eks_node_group.system.node_group_name
}

output "network_policy_enforced" {
  description = "Whether the VPC CNI add-on enforces Kubernetes NetworkPolicies (its network policy agent is on)."
  value       = jsondecode(aws_eks_addon.vpc_cni.configuration_values).enableNetworkPolicy == "true"
}

output "service_cidr" {
  description = "The cluster's Service CIDR (ClusterIPs; the kubernetes Service, the API, is its first address)."
  value       = aws_eks_cluster.this.kubernetes_network_config[0].service_ipv4_cidr
}
