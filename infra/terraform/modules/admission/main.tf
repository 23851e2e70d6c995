# What a run's pods may do with their service account's token, beyond RBAC (which cannot tell one run's objects from
# another's): a ValidatingAdmissionPolicy (Kubernetes' own CEL admission, GA in 1.30) bound to the runs' namespace.
# A request of the runs' service accounts to create, change or delete a JobSet, LeaderWorkerSet, Secret or
# NetworkPolicy is admitted only for an object of the run whose pod made it: labelled rlhf/run=<that pod's Job> and
# owned by that Job, whose pods run the project's images as the run's service accounts, restricted (no privilege, no
# host namespaces, hostPath or host ports), mount only the run's own Secrets and the cache, and whose NetworkPolicies
# open the run's pods to its own pods only. The policy's own text (templates/run_admission.yaml.tftpl) says each rule;
# tests/infra/test_admission_policy.py evaluates it on the objects components/cluster builds.
# Installed with a local chart, as modules/addons installs the Kueue queues: Helm needs no cluster at plan time.

locals {
  objects = yamldecode(templatefile("${path.module}/templates/run_admission.yaml.tftpl", {
    name                   = var.name
    namespace              = var.namespace
    actor_service_account  = var.actor_service_account_name
    server_service_account = var.server_service_account_name
    image_repositories     = var.image_repositories
    cache_claim            = var.cache_claim
    shared_secrets         = var.shared_secrets
  }))
}

resource "helm_release" "this" {
  name      = var.name
  namespace = var.namespace
  chart     = "${path.module}/charts/run-admission"
  values    = [jsonencode({ objects = local.objects })]
}
