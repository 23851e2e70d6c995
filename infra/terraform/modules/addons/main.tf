# What the cluster needs besides EKS and its node groups, each a pinned Helm chart:
# - the NVIDIA device plugin: advertises nvidia.com/gpu on the GPU nodes (the AL2023 NVIDIA AMI ships the driver only);
# - the cluster autoscaler: scales the GPU node groups from and to zero for pending pods (Karpenter would replace the
#   managed node groups, their labels and taints, with NodePools: a bigger change for no gain at two fixed pools);
# - JobSet (a multi-node run's actor), LeaderWorkerSet (a run's servers) and Kueue (admits a JobSet's pods together
#   or not at all), from their OCI charts; then the Kueue queues sized to the GPU pools (a local chart: Terraform
#   cannot plan custom objects whose CRDs the same apply installs);
# - one Prefect worker per work pool, in the jobs' namespace (restricted, as every pod there).
# The controllers tolerate no GPU taint, so they run on the system node group.

locals {
  # what a run may hold at once on each pool: every node of it (max_size), by the node's nominal size (the scheduler
  # still places each pod on one node: infra/terraform/node_types.json's allocatable checks that)
  quotas = {
    for role, pool in var.gpu_pools : role => {
      cpu    = tostring(pool.max_size * var.node_types[pool.instance_types[0]].vcpu)
      memory = "${pool.max_size * var.node_types[pool.instance_types[0]].memory_gib}Gi"
      gpus   = tostring(pool.max_size * pool.gpus_per_node)
    }
  }

  kueue_objects = jsondecode(templatefile("${path.module}/templates/kueue_queues.json.tftpl", {
    queue        = var.queue_name
    namespace    = var.namespace
    actor_quota  = local.quotas["actor"]
    critic_quota = local.quotas["critic"]
  }))

  # The jobs' namespace enforces the restricted Pod Security Standard: the worker's pod and containers meet it (the
  # chart's own containerSecurityContext adds no capability but drops none either).
  worker_pod_security = {
    runAsNonRoot   = true
    runAsUser      = 1001
    fsGroup        = 1001
    seccompProfile = { type = "RuntimeDefault" }
  }
  worker_container_security = {
    runAsNonRoot             = true
    runAsUser                = 1001
    readOnlyRootFilesystem   = true
    allowPrivilegeEscalation = false
    capabilities             = { drop = ["ALL"] }
    seccompProfile           = { type = "RuntimeDefault" }
  }

  worker_api = var.prefect_account_id != null ? {
    apiConfig = "cloud"
    cloudApiConfig = {
      accountId    = var.prefect_account_id
      workspaceId  = var.prefect_workspace_id
      apiKeySecret = { name = var.prefect_api_key_secret, key = "key" }
    }
    } : {
    apiConfig                 = "selfHostedServer"
    selfHostedServerApiConfig = { apiUrl = var.prefect_api_url }
  }
}

resource "helm_release" "nvidia_device_plugin" {
  name       = "nvidia-device-plugin"
  namespace  = "kube-system"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.chart_versions.nvidia_device_plugin

  values = [yamlencode({
    tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
    affinity = {
      nodeAffinity = {
        requiredDuringSchedulingIgnoredDuringExecution = {
          nodeSelectorTerms = [{ matchExpressions = [{ key = "rlhf/role", operator = "In", values = ["actor", "critic"] }] }]
        }
      }
    }
  })]
}

resource "helm_release" "cluster_autoscaler" {
  name       = "cluster-autoscaler"
  namespace  = "kube-system"
  repository = "https://kubernetes.github.io/autoscaler"
  chart      = "cluster-autoscaler"
  version    = var.chart_versions.cluster_autoscaler

  values = [yamlencode({
    cloudProvider = "aws"
    awsRegion     = var.region
    autoDiscovery = { clusterName = var.cluster_name }
    image         = { tag = var.cluster_autoscaler_image_tag }
    rbac = {
      serviceAccount = {
        name        = "cluster-autoscaler"
        annotations = { "eks.amazonaws.com/role-arn" = var.cluster_autoscaler_role_arn }
      }
    }
    nodeSelector = { "rlhf/role" = "system" }
    extraArgs = {
      "scale-down-unneeded-time"    = var.scale_down_unneeded_time
      "expander"                    = "least-waste"
      "balance-similar-node-groups" = true
    }
  })]
}

resource "helm_release" "jobset" {
  name             = "jobset"
  namespace        = "jobset-system"
  create_namespace = true
  repository       = "oci://registry.k8s.io/jobset/charts"
  chart            = "jobset"
  version          = var.chart_versions.jobset
  wait             = true
}

resource "helm_release" "lws" {
  name             = "lws"
  namespace        = "lws-system"
  create_namespace = true
  repository       = "oci://registry.k8s.io/lws/charts"
  chart            = "lws"
  version          = var.chart_versions.lws
  wait             = true
}

# Kueue's default integrations include jobset.x-k8s.io/jobset and leaderworkerset.x-k8s.io/leaderworkerset: an object
# labelled kueue.x-k8s.io/queue-name is suspended (a JobSet) or gated (a LeaderWorkerSet's pods) until admitted.
resource "helm_release" "kueue" {
  name             = "kueue"
  namespace        = "kueue-system"
  create_namespace = true
  repository       = "oci://registry.k8s.io/kueue/charts"
  chart            = "kueue"
  version          = var.chart_versions.kueue
  wait             = true

  depends_on = [helm_release.jobset, helm_release.lws]
}

resource "helm_release" "kueue_queues" {
  name      = "rlhf-kueue-queues"
  namespace = var.namespace
  chart     = "${path.module}/charts/kueue-queues"
  values    = [jsonencode({ objects = local.kueue_objects })]

  depends_on = [helm_release.kueue]
}

resource "helm_release" "prefect_worker" {
  for_each = toset(var.work_pools)

  name       = "prefect-worker-${each.key}"
  namespace  = var.namespace
  repository = "https://prefecthq.github.io/prefect-helm"
  chart      = "prefect-worker"
  version    = var.chart_versions.prefect_worker

  values = [yamlencode({
    fullnameOverride = "prefect-worker-${each.key}"
    worker = merge(local.worker_api, {
      config                   = { workPool = each.key, type = "kubernetes", jobNamespace = var.namespace }
      image                    = { prefectTag = var.prefect_worker_image_tag }
      nodeSelector             = { "rlhf/role" = "system" }
      podSecurityContext       = local.worker_pod_security
      containerSecurityContext = local.worker_container_security
      initContainer            = { containerSecurityContext = local.worker_container_security }
    })
  })]
}
