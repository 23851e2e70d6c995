data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

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
  description             = "SSE-KMS key of s3://${var.bucket_name}"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = var.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/s3/${var.bucket_name}"
  target_key_id = aws_kms_key.this.key_id
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Server access logs need a second bucket per env; CloudTrail data events are the audit trail for this bucket.
  #checkov:skip=CKV_AWS_144:Checkpoints are reproducible training outputs; cross-region replication doubles storage cost for no recovery need.
  #checkov:skip=CKV2_AWS_62:No consumer of S3 event notifications exists; MLflow and the flows poll/read directly.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  # Whole bucket: interrupted checkpoint uploads and orphaned delete markers.
  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_upload_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  # Checkpoints only: overwritten/deleted versions go after N days, keeping the newest few.
  # (Versions outside checkpoint_prefix, e.g. MLflow artifacts, are kept.)
  rule {
    id     = "expire-old-checkpoints"
    status = "Enabled"

    filter {
      prefix = var.checkpoint_prefix
    }

    noncurrent_version_expiration {
      noncurrent_days           = var.noncurrent_version_expiration_days
      newer_noncurrent_versions = var.newer_noncurrent_versions_to_keep
    }

    dynamic "expiration" {
      for_each = var.checkpoint_expiration_days > 0 ? [var.checkpoint_expiration_days] : []
      content {
        days = expiration.value
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOutdatedTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

# ---------------------------------------------------------------------------
# The deployment's store key (components/storage/signing.py): every run's checkpoint store signs its latest.json and
# manifests with a key derived from it, so a record written without it is never resumed. It is never in the bucket;
# the pods' roles alone may read it (modules/iam), through $RLHF_STORE_SIGNER_ARN. Its value is drawn once by AWS and
# kept: a new value would make every existing run's store refuse to resume.
# ---------------------------------------------------------------------------
resource "aws_secretsmanager_secret" "store_key" {
  #checkov:skip=CKV2_AWS_57:Rotating the store key invalidates every run's signed checkpoints; rotate by hand between runs.
  name_prefix             = "${var.bucket_name}-store-key-"
  description             = "Store key of the checkpoints in s3://${var.bucket_name} (rlhf-flows: signed latest.json and manifests)"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 30
  tags                    = var.tags
}

data "aws_secretsmanager_random_password" "store_key" {
  password_length     = 64
  exclude_punctuation = true
}

resource "aws_secretsmanager_secret_version" "store_key" {
  secret_id     = aws_secretsmanager_secret.store_key.id
  secret_string = data.aws_secretsmanager_random_password.store_key.random_password

  lifecycle {
    ignore_changes = [secret_string] # drawn once: the data source draws anew at every plan
  }
}
