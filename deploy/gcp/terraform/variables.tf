variable "project" {
  description = "GCP project that runs the front ends, the database, the bucket and the enclave workers."
  type        = string
}

variable "region" {
  type    = string
  default = "europe-west4"
}

variable "zones" {
  description = "Zones of the enclave workers' managed instance group (Confidential VMs with AMD SEV)."
  type        = list(string)
  default     = ["europe-west4-a", "europe-west4-b"]
}

variable "name" {
  description = "Prefix of every resource name."
  type        = string
  default     = "confed"
}

variable "bucket_name" {
  description = "Globally unique bucket for models, releases and device contributions."
  type        = string
}

variable "blob_prefix" {
  description = "Object prefix inside the bucket: the server runs with --blobs gs://BUCKET/PREFIX."
  type        = string
  default     = "confed"
}

variable "contribution_retention_days" {
  description = "Days after which device contributions are deleted by the bucket. Must exceed the longest round deadline plus the job retry window; a committed release never needs them again."
  type        = number
  default     = 14
  validation {
    condition     = var.contribution_retention_days >= 2
    error_message = "Keep contributions at least 2 days: a round's job may still need them."
  }
}

variable "database_tier" {
  type    = string
  default = "db-custom-2-8192"
}

variable "enclave_image" {
  description = "The confed-enclave image BY DIGEST (REGION-docker.pkg.dev/PROJECT/confed/confed-enclave@sha256:...): the digest the key services allow-list."
  type        = string
  validation {
    condition     = can(regex("@sha256:[0-9a-f]{64}$", var.enclave_image))
    error_message = "Reference the enclave image by digest, never by tag: the digest is what key services attest."
  }
}

variable "enclave_workers" {
  description = "Enclave worker VMs. Jobs are leased, so any number can run; one per round in flight is plenty."
  type        = number
  default     = 2
}

variable "enclave_machine_type" {
  type    = string
  default = "n2d-standard-4"
}

variable "server_url" {
  description = "HTTPS URL of the front ends' worker API as the enclave workers reach it (the internal load balancer)."
  type        = string
}

variable "keyservices" {
  description = "The key services the enclave collects shares from: id => HTTPS URL. Each is run by its own operator."
  type        = map(string)
}

variable "threshold" {
  description = "Shares needed to reconstruct a key (T of the ceremony). A release needs q = max(T, ceil((N+T)/2)) key services: 3 of 5 gives q = 4, which survives one lost key service (docs/operations.md)."
  type        = number
  default     = 3
}
