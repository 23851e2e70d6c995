output "policy_name" {
  description = "Name of the ValidatingAdmissionPolicy (and of its binding) that keeps each run to its own objects."
  value       = var.name
}

output "run_users" {
  description = "The service-account users whose requests the policy checks."
  value       = [for sa in [var.actor_service_account_name, var.server_service_account_name] : "system:serviceaccount:${var.namespace}:${sa}"]
}
