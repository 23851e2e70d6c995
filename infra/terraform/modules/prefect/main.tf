locals {
  # The actor pool runs every pod under torchrun: the pod hostname of an Indexed Job is <job>-<index>, so rank 0 is
  # <job>-0.<service>; on rank 0 components.launch.ranks execs Prefect's flow-run command, every other rank follows it.
  actor_launch = join(" ", [
    "exec torchrun --nnodes={{ nnodes }} --nproc-per-node={{ gpu_count }} --node-rank=$JOB_COMPLETION_INDEX",
    "--master-addr=\"$(hostname | sed 's/-[0-9]*$/-0/').${var.ranks_service_name}\" --master-port={{ master_port }}",
    "-m components.launch.ranks -- {{ command }}",
  ])

  pools = {
    (var.actor_pool_name) = {
      role                 = "actor"
      service_account_name = var.actor_service_account_name
      resources            = var.actor_resources
      launch               = local.actor_launch
      min_gpu_count        = 1 # torchrun starts gpu_count ranks per pod
      description          = "RLHF actor flows (PPO / REINFORCE policy rollouts and updates) on the actor GPU node group."
    }
    (var.critic_pool_name) = {
      role                 = "critic"
      service_account_name = var.critic_service_account_name
      resources            = var.critic_resources
      launch               = "exec {{ command }}"
      min_gpu_count        = 0 # flows that need no GPU (compare, sweep) run here with gpu_count 0
      description          = "RLHF critic, reward and rollout servers, and the flows that need no GPU, on the critic GPU node group."
    }
  }

  base_job_templates = {
    for name, pool in local.pools : name => templatefile("${path.module}/templates/base_job_template.json.tftpl", {
      pool_name                 = name
      role                      = pool.role
      image                     = var.image
      namespace                 = var.namespace
      service_account_name      = pool.service_account_name
      gpu_count                 = pool.resources.gpu_count
      min_gpu_count             = pool.min_gpu_count
      cpu                       = pool.resources.cpu
      memory                    = pool.resources.memory
      shm_size                  = pool.resources.shm_size
      env                       = var.env
      pod_watch_timeout_seconds = var.pod_watch_timeout_seconds
      ranks_service             = var.ranks_service_name
      launch                    = pool.launch
    })
  }
}

resource "prefect_work_pool" "this" {
  for_each = local.pools

  name         = each.key
  type         = "kubernetes"
  description  = each.value.description
  paused       = var.paused
  workspace_id = var.workspace_id

  concurrency_limit = lookup(var.concurrency_limits, each.key, null)

  # Normalised through jsondecode/jsonencode so whitespace never shows up as a diff.
  base_job_template = jsonencode(jsondecode(local.base_job_templates[each.key]))

  lifecycle {
    precondition {
      condition     = var.actor_pool_name != var.critic_pool_name
      error_message = "actor_pool_name and critic_pool_name must differ."
    }
  }
}
