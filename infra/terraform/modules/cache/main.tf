data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  oidc_host  = replace(var.oidc_issuer_url, "https://", "")
  csi_sa     = "efs-csi-controller-sa"
  partition  = data.aws_partition.current.partition
  account_id = data.aws_caller_identity.current.account_id
}

# ---------------------------------------------------------------------------
# The Hugging Face cache every pod of a run shares: an EFS file system (ReadWriteMany), mounted at /cache in every
# pod (HF_HOME=/cache/huggingface). Read-mostly: models and data sets land there once and every node reads them. No
# run state goes through it: checkpoints and what ranks share live in the run's S3 store.
# ---------------------------------------------------------------------------
data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:KMS key policy: Resource "*" means this key only; the account-root statement is AWS's default key policy.
  #checkov:skip=CKV_AWS_111:KMS key policy: Resource "*" means this key only; the account-root statement is AWS's default key policy.
  #checkov:skip=CKV_AWS_356:KMS key policy: Resource "*" means this key only (key policies cannot name other resources).
  statement {
    sid       = "AccountAdministration"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "${var.name} Hugging Face cache (EFS)"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_efs_file_system" "this" {
  #checkov:skip=CKV2_AWS_18:The cache holds copies of public models and data sets, fetched again when lost; backups would only add cost.
  creation_token   = "${var.name}-hf-cache"
  encrypted        = true
  kms_key_id       = aws_kms_key.this.arn
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"

  lifecycle_policy {
    transition_to_ia = "AFTER_30_DAYS"
  }

  tags = merge(var.tags, { Name = "${var.name}-hf-cache" })
}

resource "aws_security_group" "efs" {
  name_prefix = "${var.name}-efs-"
  description = "NFS to the Hugging Face cache from the cluster's pods"
  vpc_id      = var.vpc_id
  tags        = var.tags

  ingress {
    description = "NFS from the VPC (the nodes and their pods)"
    from_port   = 2049
    to_port     = 2049
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr_block]
  }

  egress {
    description = "Answers to NFS clients in the VPC"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [var.vpc_cidr_block]
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_efs_mount_target" "this" {
  for_each        = toset(var.subnet_ids)
  file_system_id  = aws_efs_file_system.this.id
  subnet_id       = each.value
  security_groups = [aws_security_group.efs.id]
}

# ---------------------------------------------------------------------------
# The EFS CSI driver (an EKS add-on) with an IRSA role of its own: it makes one access point per volume.
# ---------------------------------------------------------------------------
data "aws_iam_policy_document" "csi_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:sub"
      values   = ["system:serviceaccount:kube-system:${local.csi_sa}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_host}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "csi" {
  name               = "${var.name}-efs-csi"
  description        = "IRSA role of kube-system/${local.csi_sa}"
  assume_role_policy = data.aws_iam_policy_document.csi_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "csi" {
  role       = aws_iam_role.csi.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEFSCSIDriverPolicy"
}

resource "aws_eks_addon" "efs_csi" {
  cluster_name                = var.cluster_name
  addon_name                  = "aws-efs-csi-driver"
  addon_version               = var.efs_csi_version
  service_account_role_arn    = aws_iam_role.csi.arn
  resolve_conflicts_on_create = "OVERWRITE"
  resolve_conflicts_on_update = "OVERWRITE"
  tags                        = var.tags

  depends_on = [aws_iam_role_policy_attachment.csi]
}

# ---------------------------------------------------------------------------
# The StorageClass (an access point per volume, owned by the pods' uid 1000) and the claim every pod mounts.
# ---------------------------------------------------------------------------
resource "kubernetes_storage_class_v1" "efs" {
  metadata {
    name   = "rlhf-efs"
    labels = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  storage_provisioner = "efs.csi.aws.com"
  reclaim_policy      = "Retain"

  parameters = {
    provisioningMode = "efs-ap"
    fileSystemId     = aws_efs_file_system.this.id
    directoryPerms   = "750"
    uid              = "1000"
    gid              = "1000"
    basePath         = "/rlhf"
  }

  depends_on = [aws_eks_addon.efs_csi, aws_efs_mount_target.this]
}

resource "kubernetes_persistent_volume_claim_v1" "cache" {
  metadata {
    name      = var.claim_name
    namespace = var.namespace
    labels    = { "app.kubernetes.io/part-of" = "rlhf-flows" }
  }

  spec {
    access_modes       = ["ReadWriteMany"]
    storage_class_name = kubernetes_storage_class_v1.efs.metadata[0].name

    resources {
      requests = { storage = "100Gi" } # EFS grows as it fills; the request is a formality
    }
  }

  wait_until_bound = false
}
