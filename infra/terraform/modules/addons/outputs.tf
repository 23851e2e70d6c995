output "chart_versions" {
  description = "Chart versions installed (JobSet, LeaderWorkerSet, Kueue, NVIDIA device plugin, autoscaler, Prefect worker)."
  value       = var.chart_versions
}

output "queue_name" {
  description = "Kueue LocalQueue of the run's JobSets and LeaderWorkerSets (deploy.cluster.queue)."
  value       = var.queue_name
}

output "kueue_quotas" {
  description = "Kueue nominal quotas per pool flavor (cpu, memory, GPUs): max_size nodes of each pool."
  value       = local.quotas
}
