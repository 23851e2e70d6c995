provider "aws" {
  region = var.region

  default_tags {
    tags = merge(var.tags, {
      Project     = "rlhf-flows"
      Environment = var.name
      ManagedBy   = "terraform"
    })
  }
}

provider "prefect" {
  endpoint     = var.prefect_api_url
  account_id   = var.prefect_account_id
  workspace_id = var.prefect_workspace_id
}

# Talks to the cluster created below; needs network access to its API endpoint
# (a VPN/bastion into the VPC, or cluster_endpoint_public_access with your CIDR).
provider "kubernetes" {
  host                   = module.cluster.endpoint
  cluster_ca_certificate = base64decode(module.cluster.certificate_authority_data)

  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.cluster.name, "--region", var.region]
  }
}

# Installs the cluster's add-ons (modules/addons) with the same credentials.
provider "helm" {
  kubernetes = {
    host                   = module.cluster.endpoint
    cluster_ca_certificate = base64decode(module.cluster.certificate_authority_data)

    exec = {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", module.cluster.name, "--region", var.region]
    }
  }
}

data "aws_caller_identity" "current" {}

locals {
  cluster_name = var.name
  bucket_name  = coalesce(var.bucket_name, "${var.name}-artifacts-${data.aws_caller_identity.current.account_id}")

  private_subnet_cidrs = [for i, _ in var.availability_zones : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnet_cidrs  = [for i, _ in var.availability_zones : cidrsubnet(var.vpc_cidr, 8, 240 + i)]

  node_types = jsondecode(file("${path.module}/../../node_types.json")).instance_types

  job_env = merge({
    AWS_REGION            = var.region
    RLHF_S3_BUCKET        = module.artifacts.bucket_name
    RLHF_S3_PREFIX        = var.s3_prefix
    RLHF_STORE_SIGNER_ARN = module.artifacts.store_key_secret_arn
  }, var.job_env)
}

module "network" {
  source = "../../modules/network"

  name                 = var.name
  cidr_block           = var.vpc_cidr
  availability_zones   = var.availability_zones
  private_subnet_cidrs = local.private_subnet_cidrs
  public_subnet_cidrs  = local.public_subnet_cidrs
  single_nat_gateway   = true
  cluster_name         = local.cluster_name
}

module "cluster" {
  source = "../../modules/cluster"

  name                    = local.cluster_name
  kubernetes_version      = var.kubernetes_version
  vpc_id                  = module.network.vpc_id
  subnet_ids              = module.network.private_subnet_ids
  endpoint_private_access = true
  endpoint_public_access  = var.cluster_endpoint_public_access
  public_access_cidrs     = var.cluster_public_access_cidrs
  admin_principal_arns    = var.cluster_admin_principal_arns
}

module "gpu_pool" {
  source   = "../../modules/gpu_pool"
  for_each = var.gpu_pools

  cluster_name   = module.cluster.name
  name           = "${each.key}-gpu"
  role           = each.key
  subnet_ids     = module.network.private_subnet_ids
  instance_types = each.value.instance_types
  ami_type       = each.value.ami_type
  capacity_type  = each.value.capacity_type
  min_size       = each.value.min_size
  max_size       = each.value.max_size
  desired_size   = each.value.desired_size
  disk_size_gb   = each.value.disk_size_gb
  gpus_per_node  = each.value.gpus_per_node

  # The system node group must exist first so CoreDNS etc. never wait on a GPU node.
  depends_on = [module.cluster]
}

module "artifacts" {
  source = "../../modules/artifacts"

  bucket_name       = local.bucket_name
  checkpoint_prefix = var.checkpoint_prefix
  force_destroy     = var.bucket_force_destroy
}

check "checkpoints_under_pod_prefix" {
  assert {
    condition     = startswith(var.checkpoint_prefix, var.s3_prefix)
    error_message = "checkpoint_prefix must start with s3_prefix, or the pod roles cannot write checkpoints."
  }
}

module "iam" {
  source = "../../modules/iam"

  name_prefix                 = var.name
  cluster_name                = module.cluster.name
  oidc_provider_arn           = module.cluster.oidc_provider_arn
  oidc_issuer_url             = module.cluster.oidc_issuer_url
  bucket_arn                  = module.artifacts.bucket_arn
  kms_key_arn                 = module.artifacts.kms_key_arn
  store_key_secret_arn        = module.artifacts.store_key_secret_arn
  s3_prefix                   = var.s3_prefix
  checkpoint_prefix           = var.checkpoint_prefix
  namespace                   = var.namespace
  actor_service_account_name  = var.actor_service_account_name
  critic_service_account_name = var.critic_service_account_name
}

module "registry" {
  source = "../../modules/registry"

  name_prefix  = var.name
  force_delete = var.bucket_force_destroy
}

check "autoscaler_matches_kubernetes" {
  assert {
    condition     = startswith(var.cluster_autoscaler_image_tag, "v${var.kubernetes_version}.")
    error_message = "cluster_autoscaler_image_tag must be a release of the cluster's Kubernetes minor version."
  }
}

module "prefect" {
  source = "../../modules/prefect"

  actor_pool_name             = "actor-gpu"
  critic_pool_name            = "critic-gpu"
  image                       = var.container_image
  namespace                   = var.namespace
  actor_service_account_name  = var.actor_service_account_name
  critic_service_account_name = var.critic_service_account_name
  actor_resources             = var.actor_job_resources
  critic_resources            = var.critic_job_resources
  env                         = local.job_env
  workspace_id                = var.prefect_workspace_id
  cache_claim                 = var.cache_claim_name
}

# ---------------------------------------------------------------------------
# What runs inside the cluster (needs network access to its API, as the resources below): the Hugging Face cache
# volume, and the add-ons: NVIDIA device plugin, cluster autoscaler, JobSet, LeaderWorkerSet, Kueue and its queues,
# a Prefect worker per work pool.
# ---------------------------------------------------------------------------
module "cache" {
  source = "../../modules/cache"
  count  = var.manage_kubernetes_resources ? 1 : 0

  name              = var.name
  cluster_name      = module.cluster.name
  vpc_id            = module.network.vpc_id
  vpc_cidr_block    = module.network.vpc_cidr_block
  subnet_ids        = module.network.private_subnet_ids
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer_url   = module.cluster.oidc_issuer_url
  namespace         = kubernetes_namespace_v1.rlhf[0].metadata[0].name
  claim_name        = var.cache_claim_name
}

module "addons" {
  source = "../../modules/addons"
  count  = var.manage_kubernetes_resources ? 1 : 0

  cluster_name                 = module.cluster.name
  region                       = var.region
  namespace                    = kubernetes_namespace_v1.rlhf[0].metadata[0].name
  cluster_autoscaler_role_arn  = module.iam.cluster_autoscaler_role_arn
  cluster_autoscaler_image_tag = var.cluster_autoscaler_image_tag
  gpu_pools                    = var.gpu_pools
  node_types                   = local.node_types
  queue_name                   = var.queue_name
  work_pools                   = [module.prefect.actor_work_pool_name, module.prefect.critic_work_pool_name]
  prefect_api_url              = var.prefect_api_url
  prefect_account_id           = var.prefect_account_id
  prefect_workspace_id         = var.prefect_workspace_id
  prefect_api_key_secret       = "prefect-api-key"

  depends_on = [module.gpu_pool, kubernetes_secret_v1.prefect_api_key]
}

# The Prefect Cloud API key the workers use and hand on to the flow-run pods (a secretKeyRef: never in a spec). From
# TF_VAR_prefect_api_key; it lands in the state, which must be a protected backend (encrypted S3, as versions.tf shows).
resource "kubernetes_secret_v1" "prefect_api_key" {
  count = var.manage_kubernetes_resources && var.prefect_api_key != null ? 1 : 0

  metadata {
    name      = "prefect-api-key"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  data = { key = var.prefect_api_key }
}

# ---------------------------------------------------------------------------
# Namespace and IRSA service accounts the work-pool job templates refer to.
# ---------------------------------------------------------------------------
# The namespace enforces the restricted Pod Security Standard on every pod (flow-run pods, node groups, servers, the
# Prefect workers: each meets it, tests/infra/test_run_isolation.py checks them), at the cluster's own version.
resource "kubernetes_namespace_v1" "rlhf" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name = var.namespace
    labels = {
      "app.kubernetes.io/part-of"                  = "rlhf-flows"
      "pod-security.kubernetes.io/enforce"         = "restricted"
      "pod-security.kubernetes.io/enforce-version" = "v${var.kubernetes_version}"
      "pod-security.kubernetes.io/audit"           = "restricted"
      "pod-security.kubernetes.io/audit-version"   = "v${var.kubernetes_version}"
      "pod-security.kubernetes.io/warn"            = "restricted"
      "pod-security.kubernetes.io/warn-version"    = "v${var.kubernetes_version}"
    }
  }

  depends_on = [module.cluster]
}

# Only the actor's pods get a Kubernetes API token by default (they create a run's objects); the critic's account
# (servers, and the flows that need no GPU) has none unless a pod asks for it, and a run's servers may not
# (modules/admission). Their IRSA tokens (S3) are projected by EKS whatever this says.
resource "kubernetes_service_account_v1" "pod" {
  for_each = var.manage_kubernetes_resources ? {
    (var.actor_service_account_name)  = module.iam.actor_role_arn
    (var.critic_service_account_name) = module.iam.critic_role_arn
  } : {}

  metadata {
    name        = each.key
    namespace   = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    annotations = { "eks.amazonaws.com/role-arn" = each.value }
    labels      = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  automount_service_account_token = each.key == var.actor_service_account_name
}

# ---------------------------------------------------------------------------
# Network isolation of the namespace, enforced by the VPC CNI's network policy agent (module.cluster): no pod takes or
# opens a connection unless a policy allows it. Every pod may resolve names (kube-dns) and reach addresses outside
# the VPC and the Service range, never the link-local range (the instance metadata service, 169.254.169.254); the
# pods that call the Kubernetes API (the actor's: a run's controller and node groups; the Prefect workers) reach it
# on 443; in_vpc_egress adds services inside the VPC (an internal MLflow or Prefect server). Between pods, only what
# a run opens for itself: its two NetworkPolicies (components/cluster/network_policy.py), created with its node
# groups or servers, owned by its Job (Kubernetes removes them with it), letting its pods talk to its own pods only,
# both ways. Every request to a server also carries the run's secret.
# ---------------------------------------------------------------------------
resource "kubernetes_network_policy_v1" "default_deny" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-default-deny"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {}
    policy_types = ["Ingress", "Egress"]
  }
}

moved {
  from = kubernetes_network_policy_v1.default_deny_ingress
  to   = kubernetes_network_policy_v1.default_deny
}

resource "kubernetes_network_policy_v1" "egress_dns" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-egress-dns"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {}
    policy_types = ["Egress"]

    egress {
      to {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = "kube-system" }
        }
        pod_selector {
          match_labels = { "k8s-app" = "kube-dns" }
        }
      }
      ports {
        protocol = "UDP"
        port     = "53"
      }
      ports {
        protocol = "TCP"
        port     = "53"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "egress_outside" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-egress-outside"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {}
    policy_types = ["Egress"]

    egress {
      to {
        ip_block {
          cidr   = "0.0.0.0/0"
          except = [var.vpc_cidr, module.cluster.service_cidr, "169.254.0.0/16"]
        }
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "egress_kubernetes_api" {
  for_each = var.manage_kubernetes_resources ? {
    actor   = { "rlhf/role" = "actor" }
    workers = { "app.kubernetes.io/name" = "prefect-worker" }
  } : {}

  metadata {
    name      = "rlhf-egress-kubernetes-api-${each.key}"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {
      match_labels = each.value
    }
    policy_types = ["Egress"]

    # the kubernetes Service's ClusterIP, and the API server's endpoints in the cluster's subnets (on 443, where no
    # pod of a run can listen: it may not bind a port below 1024)
    egress {
      dynamic "to" {
        for_each = concat(["${cidrhost(module.cluster.service_cidr, 1)}/32"], local.private_subnet_cidrs)
        content {
          ip_block {
            cidr = to.value
          }
        }
      }
      ports {
        protocol = "TCP"
        port     = "443"
      }
    }
  }
}

resource "kubernetes_network_policy_v1" "egress_in_vpc" {
  count = var.manage_kubernetes_resources && length(var.in_vpc_egress) > 0 ? 1 : 0

  metadata {
    name      = "rlhf-egress-in-vpc"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {}
    policy_types = ["Egress"]

    dynamic "egress" {
      for_each = var.in_vpc_egress
      content {
        to {
          ip_block {
            cidr = egress.value.cidr
          }
        }
        ports {
          protocol = "TCP"
          port     = tostring(egress.value.port)
        }
      }
    }
  }
}

# What a run's service account may do in its namespace, and nothing more: create, read and delete the objects a run
# makes (its node groups' JobSet, its servers' LeaderWorkerSets and their Secrets, its two NetworkPolicies), read its
# own Job (the owner of all of them) and the pods and logs of what it made, read why Kueue holds a workload. RBAC
# cannot tell one run's objects from another's: the admission policy below (modules/admission) admits a create or a
# delete only for an object of the run whose pod asks, as that run may make it.
resource "kubernetes_role_v1" "run" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-run"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  rule {
    api_groups = ["jobset.x-k8s.io"]
    resources  = ["jobsets"]
    verbs      = ["create", "get", "delete"]
  }

  rule {
    api_groups = ["leaderworkerset.x-k8s.io"]
    resources  = ["leaderworkersets"]
    verbs      = ["create", "get", "delete"]
  }

  rule {
    api_groups = [""]
    resources  = ["secrets"]
    verbs      = ["create", "delete"]
  }

  rule {
    api_groups = [""]
    resources  = ["pods", "pods/log"]
    verbs      = ["get", "list"]
  }

  rule {
    api_groups = ["networking.k8s.io"]
    resources  = ["networkpolicies"]
    verbs      = ["create", "delete"]
  }

  rule {
    api_groups = ["batch"]
    resources  = ["jobs"]
    verbs      = ["get"]
  }

  rule {
    api_groups = ["kueue.x-k8s.io"]
    resources  = ["workloads"]
    verbs      = ["list"]
  }
}

resource "kubernetes_role_binding_v1" "run" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-run"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.run[0].metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = var.actor_service_account_name
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
  }
}

module "admission" {
  source = "../../modules/admission"
  count  = var.manage_kubernetes_resources ? 1 : 0

  namespace                   = kubernetes_namespace_v1.rlhf[0].metadata[0].name
  actor_service_account_name  = var.actor_service_account_name
  server_service_account_name = var.critic_service_account_name
  image_repositories          = distinct(concat(values(module.registry.repository_urls), var.extra_image_repositories))
  cache_claim                 = var.cache_claim_name
  shared_secrets              = [for secret in kubernetes_secret_v1.prefect_api_key : secret.metadata[0].name]
}
