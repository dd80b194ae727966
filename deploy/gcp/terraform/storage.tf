# One bucket: PREFIX/blobs/ (models, releases: kept) and PREFIX/contributions/ (device uploads:
# deleted by the lifecycle rule below, so confed never needs delete permission).
resource "google_storage_bucket" "blobs" {
  name                        = var.bucket_name
  location                    = var.region
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  # Objects are created once and never rewritten; versioning would only keep deleted
  # contributions around past their retention.
  versioning {
    enabled = false
  }

  lifecycle_rule {
    condition {
      age            = var.contribution_retention_days
      matches_prefix = ["${var.blob_prefix}/contributions/"]
    }
    action {
      type = "Delete"
    }
  }

  # Sealed partitions of partitioned rounds (`*.partition`): only their round's merge reads
  # them, and they hold (encrypted) un-noised sums; expired with the contributions.
  lifecycle_rule {
    condition {
      age            = var.contribution_retention_days
      matches_prefix = ["${var.blob_prefix}/blobs/tenants/"]
      matches_suffix = [".partition"]
    }
    action {
      type = "Delete"
    }
  }

  # Incomplete multipart/resumable uploads from devices that gave up.
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}
