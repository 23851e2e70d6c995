locals {
  # Every pod of both pools runs its flow run as one process (Prefect's `prefect flow-run execute`, fixed in the
  # template). A run on several nodes creates its node groups itself, as a JobSet (components/cluster/jobset.py): the
  # flow-run pod is its controller, never a rank. A deployment or a flow run may set only the template's variables
  # (image, resources, env, the pod watch timeout): never the namespace, the service account, the command or a label.
  # Where each pod keeps its state and finds the shared Hugging Face cache: the template mounts both there. prefect.yaml's
  # deployments set the same two variables (a deployment's env replaces this default whole).
  pod_env = merge(var.env, {
    RLHF_STATE_DIR = var.state_dir
    HF_HOME        = "${var.cache_mount}/huggingface"
  })

  pools = {
    (var.actor_pool_name) = {
      role                 = "actor"
      service_account_name = var.actor_service_account_name
      resources            = var.actor_resources
      description          = "RLHF actor flows (PPO / REINFORCE policy rollouts and updates) on the actor GPU node group."
    }
    (var.critic_pool_name) = {
      role                 = "critic"
      service_account_name = var.critic_service_account_name
      resources            = var.critic_resources
      description          = "RLHF flows that need no GPU (compare, sweep, experiment), on the critic GPU node group, where the runs' servers run."
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
      cpu                       = pool.resources.cpu
      memory                    = pool.resources.memory
      shm_size                  = pool.resources.shm_size
      env                       = local.pod_env
      pod_watch_timeout_seconds = var.pod_watch_timeout_seconds
      backoff_limit             = var.backoff_limit
      state_dir                 = var.state_dir
      cache_mount               = var.cache_mount
      cache_claim               = var.cache_claim
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
