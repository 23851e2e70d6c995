data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  oidc_host = replace(var.oidc_issuer_url, "https://", "")

  service_accounts = {
    actor = {
      subject   = "system:serviceaccount:${var.namespace}:${var.actor_service_account_name}"
      read_only = false
    }
    critic = {
      subject   = "system:serviceaccount:${var.namespace}:${var.critic_service_account_name}"
      read_only = var.critic_read_only
    }
  }

  # Built from the name, not the role's attribute: a role's trust policy names the role itself.
  role_names = {
    actor  = "${var.name_prefix}-actor-pod"
    critic = "${var.name_prefix}-critic-pod"
  }
  role_arn_prefix = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:role"

  read_actions  = ["s3:GetObject", "s3:GetObjectVersion", "s3:GetObjectTagging"]
  write_actions = ["s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]

  # A run's store: <checkpoint_prefix><run name>/. A session writes there only with the session tag run=<run name>,
  # which a run's store asks for when it opens (components/storage/s3.py: tagged_session), so what one run writes
  # reaches no other run's store ($${...} is the IAM policy variable, escaped from Terraform).
  run_store = "${var.bucket_arn}/${var.checkpoint_prefix}$${aws:PrincipalTag/run}"

  # Where each role may write in a run's store: the actor (a run's flow run and its pods) all of it; the critic
  # server only the saves it hands its run (<run>/critic-pending/...), never a checkpoint, a lease or latest.json.
  # Nothing else in the bucket but the pipelines' stage leases (StageLeases): MLflow's artifacts go through the MLflow
  # server, with its own credentials.
  write_resources = {
    actor  = ["${local.run_store}/*"]
    critic = ["${local.run_store}/critic-pending/*"]
  }
}

# ---------------------------------------------------------------------------
# Trust: only the named service account of this cluster may assume a role (IRSA); and the role may assume itself
# again, with exactly one session tag, `run` (what a run's store does to get its run's credentials). The role is named
# through the account: a trust policy cannot name a role that does not exist yet, and the identity policy below grants
# the role sts:AssumeRole on itself only.
# ---------------------------------------------------------------------------
data "aws_iam_policy_document" "irsa_assume" {
  for_each = local.service_accounts

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:sub"
      values   = [each.value.subject]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }

  statement {
    sid     = "RunSessionsOfThisRole"
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:PrincipalArn"
      values   = ["${local.role_arn_prefix}/${local.role_names[each.key]}"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:RequestTag/run"
      values   = ["?*"]
    }

    condition {
      test     = "ForAllValues:StringEquals"
      variable = "aws:TagKeys"
      values   = ["run"]
    }
  }
}

resource "aws_iam_role" "pod" {
  for_each           = local.service_accounts
  name               = local.role_names[each.key]
  description        = "IRSA role of ${each.value.subject}"
  assume_role_policy = data.aws_iam_policy_document.irsa_assume[each.key].json
  tags               = merge(var.tags, { "rlhf/role" = each.key })
}

# S3 access scoped to the bucket and prefix, writes to a run's own store; KMS use only through S3 and Secrets Manager.
data "aws_iam_policy_document" "s3" {
  for_each = local.service_accounts

  statement {
    sid       = "ListPrefix"
    actions   = ["s3:ListBucket", "s3:ListBucketVersions"]
    resources = [var.bucket_arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["${var.s3_prefix}*"]
    }
  }

  statement {
    sid       = "LocateBucket"
    actions   = ["s3:GetBucketLocation"]
    resources = [var.bucket_arn]
  }

  # Reads stay prefix-wide: a pipeline's stage reads its upstream stage's model from that run's store, `rlhf export`
  # reads any run's. What keeps a run from resuming what another wrote is the store's signatures, not secrecy.
  statement {
    sid       = "ObjectsUnderPrefix"
    actions   = local.read_actions
    resources = ["${var.bucket_arn}/${var.s3_prefix}*"]
  }

  dynamic "statement" {
    for_each = each.value.read_only ? [] : [local.write_resources[each.key]]

    content {
      sid       = "WritesOfThisRunOnly"
      actions   = local.write_actions
      resources = statement.value
    }
  }

  # The pipelines' stage leases (components/pipeline/cache.py: <checkpoint_prefix>locks/<stage>-<key>, one builder
  # of a stage, whichever run builds it): a statement of its own, since a statement whose policy variable has no value
  # (a session without a run tag) does not apply at all.
  dynamic "statement" {
    for_each = each.key == "actor" ? ["${var.bucket_arn}/${var.checkpoint_prefix}locks/*"] : []

    content {
      sid       = "StageLeases"
      actions   = ["s3:PutObject", "s3:DeleteObject"]
      resources = [statement.value]
    }
  }

  # A run's credentials: this role again, tagged run=<name> (the trust policy above allows exactly that).
  statement {
    sid       = "TagSessionsOfThisRole"
    actions   = ["sts:AssumeRole", "sts:TagSession"]
    resources = ["${local.role_arn_prefix}/${local.role_names[each.key]}"]
  }

  # The deployment's store key (components/storage/signing.py), never in the bucket.
  statement {
    sid       = "StoreKey"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [var.store_key_secret_arn]
  }

  # One writer per run name (components/storage/lease.py): a lease is created with If-None-Match: * and renewed or
  # taken over with If-Match: <ETag>; a write without either would replace another holder's lease. latest.json, the
  # store's committed sequence (components/storage/store.py), moves the same way: a write without a condition could
  # drop a commit.
  statement {
    sid       = "LeasesAndLatestOnlyByConditionalWrites"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = ["${var.bucket_arn}/${var.checkpoint_prefix}*/lease.json", "${var.bucket_arn}/${var.checkpoint_prefix}*/latest.json"]

    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["true"]
    }

    condition {
      test     = "Null"
      variable = "s3:if-match"
      values   = ["true"]
    }
  }

  # A checkpoint's commit point is written once, under a prefix of its own (components/storage/store.py): it is
  # created with If-None-Match: *, never overwritten.
  statement {
    sid       = "CommitPointsCreateOnly"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = ["${var.bucket_arn}/${var.checkpoint_prefix}*/state.json"]

    condition {
      test     = "Null"
      variable = "s3:if-none-match"
      values   = ["true"]
    }
  }

  statement {
    sid       = "BucketKeyViaS3"
    actions   = each.value.read_only ? ["kms:Decrypt"] : ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [var.kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
    }
  }

  statement {
    sid       = "StoreKeyViaSecretsManager"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "s3" {
  for_each = local.service_accounts
  name     = "artifacts-bucket"
  role     = aws_iam_role.pod[each.key].id
  policy   = data.aws_iam_policy_document.s3[each.key].json
}

# ---------------------------------------------------------------------------
# Cluster autoscaler (scale GPU pools from/to zero)
# ---------------------------------------------------------------------------
data "aws_iam_policy_document" "autoscaler_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:sub"
      values   = ["system:serviceaccount:kube-system:cluster-autoscaler"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "autoscaler" {
  statement {
    sid = "Discover"
    actions = [
      "autoscaling:DescribeAutoScalingGroups",
      "autoscaling:DescribeAutoScalingInstances",
      "autoscaling:DescribeLaunchConfigurations",
      "autoscaling:DescribeScalingActivities",
      "autoscaling:DescribeTags",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:GetInstanceTypesFromInstanceRequirements",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "ReadNodeGroupLabelsAndTaints"
    actions   = ["eks:DescribeNodegroup"]
    resources = ["arn:${data.aws_partition.current.partition}:eks:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:nodegroup/${var.cluster_name}/*/*"]
  }

  statement {
    sid = "ScaleOwnedGroups"
    actions = [
      "autoscaling:SetDesiredCapacity",
      "autoscaling:TerminateInstanceInAutoScalingGroup",
    ]
    # Managed node group ASGs are named eks-<node group>-<uuid>; the tag condition narrows it to this cluster.
    resources = ["arn:${data.aws_partition.current.partition}:autoscaling:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:autoScalingGroup:*:autoScalingGroupName/eks-*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/k8s.io/cluster-autoscaler/${var.cluster_name}"
      values   = ["owned"]
    }
  }
}

resource "aws_iam_role" "cluster_autoscaler" {
  count              = var.create_cluster_autoscaler_role ? 1 : 0
  name               = "${var.name_prefix}-cluster-autoscaler"
  description        = "IRSA role of kube-system/cluster-autoscaler"
  assume_role_policy = data.aws_iam_policy_document.autoscaler_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy" "cluster_autoscaler" {
  count  = var.create_cluster_autoscaler_role ? 1 : 0
  name   = "cluster-autoscaler"
  role   = aws_iam_role.cluster_autoscaler[0].id
  policy = data.aws_iam_policy_document.autoscaler.json
}
