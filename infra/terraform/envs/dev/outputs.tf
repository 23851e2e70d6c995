output "region" {
  description = "AWS region of the environment."
  value       = var.region
}

output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name <this>)."
  value       = module.cluster.name
}

output "kubeconfig_command" {
  description = "Command that writes a kubeconfig entry for the cluster."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.name}"
}

output "bucket_name" {
  description = "Artifacts bucket (checkpoints, MLflow artifacts)."
  value       = module.artifacts.bucket_name
}

output "store_key_secret_arn" {
  description = "Secrets Manager secret holding the deployment's store key: $RLHF_STORE_SIGNER_ARN of every pod (prefect.yaml)."
  value       = module.artifacts.store_key_secret_arn
}

output "s3_prefix" {
  description = "Key prefix in the bucket that the pod roles may use."
  value       = module.iam.s3_prefix
}

output "actor_work_pool_name" {
  description = "prefect.yaml work_pool.name of ppo/default and reinforce/default."
  value       = module.prefect.actor_work_pool_name
}

output "critic_work_pool_name" {
  description = "prefect.yaml work_pool.name of compare/default, sweep/default and experiment/default."
  value       = module.prefect.critic_work_pool_name
}

output "work_pool_job_variables" {
  description = "Job variables each work pool accepts from a deployment or a flow run (no other is accepted)."
  value       = module.prefect.job_variables
}

output "namespace" {
  description = "Kubernetes namespace of the flow-run jobs and of the objects the runs create."
  value       = var.namespace
}

output "actor_service_account_name" {
  description = "Service account of the actor pool's flow-run pods and of a run's node groups."
  value       = var.actor_service_account_name
}

output "critic_service_account_name" {
  description = "Service account of the critic pool's flow-run pods and of a run's server pods."
  value       = var.critic_service_account_name
}

output "actor_role_arn" {
  description = "IRSA role ARN of the actor service account."
  value       = module.iam.actor_role_arn
}

output "critic_role_arn" {
  description = "IRSA role ARN of the critic service account."
  value       = module.iam.critic_role_arn
}

output "cluster_autoscaler_role_arn" {
  description = "IRSA role ARN for the cluster autoscaler (helm value rbac.serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn)."
  value       = module.iam.cluster_autoscaler_role_arn
}

output "gpu_node_groups" {
  description = "Map role -> GPU node group name."
  value       = { for role, pool in module.gpu_pool : role => pool.node_group_name }
}

output "gpu_node_taint" {
  description = "Taint carried by every GPU node (the job templates tolerate it)."
  value       = module.gpu_pool["actor"].node_taint
}

output "image_repositories" {
  description = "ECR repository URLs of the two images: RLHF_IMAGE=<rlhf-flows>:<tag>, RLHF_VLLM_IMAGE=<rlhf-flows-vllm>:<tag>."
  value       = module.registry.repository_urls
}

output "queue_name" {
  description = "Kueue LocalQueue of the runs (deploy.cluster.queue)."
  value       = var.queue_name
}

output "cache_claim_name" {
  description = "Claim of the shared Hugging Face cache (deploy.cluster.cache_claim)."
  value       = var.cache_claim_name
}
