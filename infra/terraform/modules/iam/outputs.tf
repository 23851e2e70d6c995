output "actor_role_arn" {
  description = "ARN of the IRSA role of the actor flow service account (annotate the service account with it)."
  value       = aws_iam_role.pod["actor"].arn
}

output "critic_role_arn" {
  description = "ARN of the IRSA role of the critic/reward server service account."
  value       = aws_iam_role.pod["critic"].arn
}

output "cluster_autoscaler_role_arn" {
  description = "ARN of the IRSA role of the cluster autoscaler (null when not created)."
  value       = var.create_cluster_autoscaler_role ? aws_iam_role.cluster_autoscaler[0].arn : null
}

output "service_account_role_arns" {
  description = "Map namespace/service-account -> IRSA role ARN."
  value = {
    "${var.namespace}/${var.actor_service_account_name}"  = aws_iam_role.pod["actor"].arn
    "${var.namespace}/${var.critic_service_account_name}" = aws_iam_role.pod["critic"].arn
  }
}

output "s3_prefix" {
  description = "Key prefix the pod roles may read (each run's session writes only its own store under checkpoint_prefix)."
  value       = var.s3_prefix
}
