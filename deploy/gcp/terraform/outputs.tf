output "blobs_url" {
  description = "--blobs for every confed serve process."
  value       = "gs://${google_storage_bucket.blobs.name}/${var.blob_prefix}"
}

output "database_instance" {
  description = "Cloud SQL connection name for the Auth Proxy sidecar."
  value       = google_sql_database_instance.tasks.connection_name
}

output "database_user" {
  description = "The front ends' IAM database user (in CONFED_DATABASE_URL)."
  value       = google_sql_user.frontend.name
}

output "frontend_service_account" {
  value = google_service_account.frontend.email
}

output "enclave_service_account" {
  description = "The identity in the enclave's attestation token; key-service policies may pin it."
  value       = google_service_account.enclave.email
}

output "gke_cluster" {
  value = google_container_cluster.frontends.name
}
