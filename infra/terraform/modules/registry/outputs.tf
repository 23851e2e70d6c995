output "repository_urls" {
  description = "Map repository name -> URL (<account>.dkr.ecr.<region>.amazonaws.com/<name>): tag and push the images there."
  value       = { for name, repo in aws_ecr_repository.this : name => repo.repository_url }
}

output "kms_key_arn" {
  description = "ARN of the KMS key encrypting the images."
  value       = aws_kms_key.this.arn
}
