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

data "aws_caller_identity" "current" {}

locals {
  cluster_name = var.name
  bucket_name  = coalesce(var.bucket_name, "${var.name}-artifacts-${data.aws_caller_identity.current.account_id}")

  private_subnet_cidrs = [for i, _ in var.availability_zones : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnet_cidrs  = [for i, _ in var.availability_zones : cidrsubnet(var.vpc_cidr, 8, 240 + i)]

  job_env = merge({
    AWS_REGION     = var.region
    RLHF_S3_BUCKET = module.artifacts.bucket_name
    RLHF_S3_PREFIX = var.s3_prefix
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
  s3_prefix                   = var.s3_prefix
  checkpoint_prefix           = var.checkpoint_prefix
  namespace                   = var.namespace
  actor_service_account_name  = var.actor_service_account_name
  critic_service_account_name = var.critic_service_account_name
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
}

# ---------------------------------------------------------------------------
# Namespace and IRSA service accounts the work-pool job templates refer to.
# ---------------------------------------------------------------------------
resource "kubernetes_namespace_v1" "rlhf" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name   = var.namespace
    labels = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  depends_on = [module.cluster]
}

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
}

# ---------------------------------------------------------------------------
# Network isolation of the namespace, enforced by the VPC CNI's network policy agent (module.cluster): no pod takes
# ingress unless a policy allows it. Actor pods take it from actor pods (a run's ranks rendezvous before any of its
# code runs). A run's server pods take it only from that run's own actor Job, and that Job's pods from those servers,
# by the two policies the run itself creates while its servers live (components/serving/network_policy.py), owned by
# its Job so that Kubernetes removes them with it. Every request to a server also carries the run's secret.
# ---------------------------------------------------------------------------
resource "kubernetes_network_policy_v1" "default_deny_ingress" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-default-deny-ingress"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {}
    policy_types = ["Ingress"]
  }
}

resource "kubernetes_network_policy_v1" "actor_ranks" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-actor-ranks"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    pod_selector {
      match_labels = { "rlhf/role" = "actor" }
    }
    policy_types = ["Ingress"]

    ingress {
      from {
        pod_selector {
          match_labels = { "rlhf/role" = "actor" }
        }
      }
    }
  }
}

# What a run needs to create (and delete) its own two policies: NetworkPolicies and a read of its Job (their owner),
# in this namespace only.
resource "kubernetes_role_v1" "run_network_policies" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-run-network-policies"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
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
}

resource "kubernetes_role_binding_v1" "run_network_policies" {
  count = var.manage_kubernetes_resources ? 1 : 0

  metadata {
    name      = "rlhf-run-network-policies"
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.run_network_policies[0].metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = var.actor_service_account_name
    namespace = kubernetes_namespace_v1.rlhf[0].metadata[0].name
  }
}
