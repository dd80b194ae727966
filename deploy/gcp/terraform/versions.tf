# confed on Google Cloud: the untrusted front ends on GKE Autopilot, the task database on Cloud SQL
# for PostgreSQL, blobs in one GCS bucket, and enclave workers as a Confidential Space managed
# instance group. Key services are NOT here: each is run by a separate operator in its own
# project (deploy/gcp/k8s/keyservice.yaml is the template they start from).
terraform {
  required_version = ">= 1.6"
  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.0, < 8.0"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}
