# Two identities, least privilege each.
#
# front ends (GKE workloads through Workload Identity): create and read objects (no delete, so no
# overwrite: writes are create-only), sign device upload URLs as themselves (signBlob), connect to
# Cloud SQL with IAM authentication. They never hold a key share or a plaintext update.
#
# enclave workers (Confidential Space VMs): attest (workloadUser) and write logs. They need no
# storage or database access at all: jobs, contributions and releases go through the worker API.

resource "google_service_account" "frontend" {
  account_id   = "${var.name}-frontend"
  display_name = "confed front ends (API replicas, scheduler)"
}

resource "google_service_account" "enclave" {
  account_id   = "${var.name}-enclave"
  display_name = "confed enclave workers (Confidential Space)"
}

resource "google_storage_bucket_iam_member" "frontend_create" {
  bucket = google_storage_bucket.blobs.name
  role   = "roles/storage.objectCreator"
  member = "serviceAccount:${google_service_account.frontend.email}"
}

resource "google_storage_bucket_iam_member" "frontend_read" {
  bucket = google_storage_bucket.blobs.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${google_service_account.frontend.email}"
}

# Signing V4 URLs through IAM signBlob, as itself.
resource "google_service_account_iam_member" "frontend_signs_urls" {
  service_account_id = google_service_account.frontend.name
  role               = "roles/iam.serviceAccountTokenCreator"
  member             = "serviceAccount:${google_service_account.frontend.email}"
}

resource "google_project_iam_member" "frontend_sql" {
  project = var.project
  role    = "roles/cloudsql.client"
  member  = "serviceAccount:${google_service_account.frontend.email}"
}

resource "google_project_iam_member" "frontend_sql_login" {
  project = var.project
  role    = "roles/cloudsql.instanceUser"
  member  = "serviceAccount:${google_service_account.frontend.email}"
}

# The Kubernetes service account `confed/confed-frontend` acts as the front-end identity.
resource "google_service_account_iam_member" "frontend_workload_identity" {
  service_account_id = google_service_account.frontend.name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${var.project}.svc.id.goog[confed/confed-frontend]"
}

resource "google_project_iam_member" "enclave_attests" {
  project = var.project
  role    = "roles/confidentialcomputing.workloadUser"
  member  = "serviceAccount:${google_service_account.enclave.email}"
}

resource "google_project_iam_member" "enclave_logs" {
  project = var.project
  role    = "roles/logging.logWriter"
  member  = "serviceAccount:${google_service_account.enclave.email}"
}

resource "google_project_iam_member" "enclave_pulls_image" {
  project = var.project
  role    = "roles/artifactregistry.reader"
  member  = "serviceAccount:${google_service_account.enclave.email}"
}

# The worker token: the enclave VMs read it from Secret Manager with their own service account
# (confed-enclave --worker-token-secret). The secret's value is added out of band and never
# enters Terraform state:
#   gcloud secrets versions add NAME-worker-token --data-file=worker-token
resource "google_secret_manager_secret" "worker_token" {
  secret_id = "${var.name}-worker-token"
  replication {
    auto {}
  }
}

resource "google_secret_manager_secret_iam_member" "enclave_reads_worker_token" {
  secret_id = google_secret_manager_secret.worker_token.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.enclave.email}"
}
