output "node_group_name" {
  description = "Name of the managed node group."
  value       = aws_eks_node_group.this.node_group_name
}

output "node_group_arn" {
  description = "ARN of the managed node group."
  value       = aws_eks_node_group.this.arn
}

output "node_role_arn" {
  description = "ARN of the IAM role of the GPU nodes."
  value       = aws_iam_role.node.arn
}

output "autoscaling_group_name" {
  description = "Name of the Auto Scaling group behind the node group."
  value       = aws_eks_node_group.this.resources[0].autoscaling_groups[0].name
}

output "node_labels" {
  description = "Kubernetes labels every node of the pool carries (select with nodeSelector)."
  value       = aws_eks_node_group.this.labels
}

output "node_taint" {
  description = "Taint every node of the pool carries, as key=value:Effect (pods need a matching toleration)."
  value       = "${one(aws_eks_node_group.this.taint).key}=${one(aws_eks_node_group.this.taint).value}:NoSchedule"
}

output "role" {
  description = "RLHF role of the pool (actor or critic)."
  value       = var.role
}
