output "actor_work_pool_name" {
  description = "Name of the actor work pool (prefect.yaml: work_pool.name of ppo/default and reinforce/default)."
  value       = prefect_work_pool.this[var.actor_pool_name].name
}

output "critic_work_pool_name" {
  description = "Name of the critic work pool (prefect.yaml: work_pool.name of compare/default, sweep/default and experiment/default)."
  value       = prefect_work_pool.this[var.critic_pool_name].name
}

output "work_pool_ids" {
  description = "Map work pool name -> ID."
  value       = { for name, pool in prefect_work_pool.this : name => pool.id }
}

output "job_variables" {
  description = "Map work pool name -> the job variables a deployment or a flow run may set (no other is accepted)."
  value       = { for name, tpl in local.base_job_templates : name => sort(keys(jsondecode(tpl).variables.properties)) }
}
