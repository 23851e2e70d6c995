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

  read_actions  = ["s3:GetObject", "s3:GetObjectVersion", "s3:GetObjectTagging"]
  write_actions = ["s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]

  # Where each role may write: the actor (the training flow run) everything under the pods' prefix: its runs'
  # checkpoints, leases, MLflow artifacts; the critic server only the saves it hands its run
  # (<checkpoint_prefix><run>/critic-pending/...), never a checkpoint, a lease or latest.json.
  write_resources = {
    actor  = ["${var.bucket_arn}/${var.s3_prefix}*"]
    critic = ["${var.bucket_arn}/${var.checkpoint_prefix}*/critic-pending/*"]
  }
}

# ---------------------------------------------------------------------------
# IRSA trust: only the named service account of this cluster may assume a role.
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
}

resource "aws_iam_role" "pod" {
  for_each           = local.service_accounts
  name               = "${var.name_prefix}-${each.key}-pod"
  description        = "IRSA role of ${each.value.subject}"
  assume_role_policy = data.aws_iam_policy_document.irsa_assume[each.key].json
  tags               = merge(var.tags, { "rlhf/role" = each.key })
}

# S3 access scoped to the bucket and prefix; KMS use only through S3.
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

  statement {
    sid       = "ObjectsUnderPrefix"
    actions   = local.read_actions
    resources = ["${var.bucket_arn}/${var.s3_prefix}*"]
  }

  dynamic "statement" {
    for_each = each.value.read_only ? [] : [local.write_resources[each.key]]

    content {
      sid       = "WritesOfThisRole"
      actions   = local.write_actions
      resources = statement.value
    }
  }

  # One writer per run name (components/storage/lease.py): a lease is created with If-None-Match: * and renewed or
  # taken over with If-Match: <ETag>; a write without either would replace another run's lease.
  statement {
    sid       = "LeasesOnlyByConditionalWrites"
    effect    = "Deny"
    actions   = ["s3:PutObject"]
    resources = ["${var.bucket_arn}/${var.checkpoint_prefix}*/lease.json"]

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
