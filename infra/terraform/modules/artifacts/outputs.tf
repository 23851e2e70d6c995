output "bucket_name" {
  description = "Name of the artifacts bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the artifacts bucket."
  value       = aws_s3_bucket.this.arn
}

output "bucket_regional_domain_name" {
  description = "Regional domain name of the bucket."
  value       = aws_s3_bucket.this.bucket_regional_domain_name
}

output "kms_key_arn" {
  description = "ARN of the KMS key used for SSE-KMS (pod roles need kms:Decrypt/GenerateDataKey on it)."
  value       = aws_kms_key.this.arn
}

output "checkpoint_prefix" {
  description = "Key prefix of training checkpoints (subject to the lifecycle rules)."
  value       = var.checkpoint_prefix
}

output "store_key_secret_arn" {
  description = "ARN of the Secrets Manager secret holding the deployment's store key ($RLHF_STORE_SIGNER_ARN of every pod)."
  value       = aws_secretsmanager_secret.store_key.arn
}
