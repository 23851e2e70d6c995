output "file_system_id" {
  description = "ID of the EFS file system holding the Hugging Face cache."
  value       = aws_efs_file_system.this.id
}

output "claim_name" {
  description = "PersistentVolumeClaim every pod mounts at /cache."
  value       = kubernetes_persistent_volume_claim_v1.cache.metadata[0].name
}
