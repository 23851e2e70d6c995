data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

# The two images every pod runs (`make image`: docker/actor.Dockerfile and docker/vllm.Dockerfile): tags are
# immutable (a tag names one build for good), every push is scanned, the layers are encrypted with a key of their own.
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
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "${var.name_prefix} container images (ECR)"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_ecr_repository" "this" {
  for_each = toset(var.repositories)

  name                 = each.key
  image_tag_mutability = "IMMUTABLE"
  force_delete         = var.force_delete

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.this.arn
  }

  tags = var.tags
}

# Untagged layers (a failed or superseded push) go after a week; tagged images stay until deleted by hand.
resource "aws_ecr_lifecycle_policy" "this" {
  for_each   = aws_ecr_repository.this
  repository = each.value.name

  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Expire untagged images after 7 days"
      selection    = { tagStatus = "untagged", countType = "sinceImagePushed", countUnit = "days", countNumber = 7 }
      action       = { type = "expire" }
    }]
  })
}
