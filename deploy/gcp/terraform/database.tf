# The task database: Cloud SQL for PostgreSQL 15, private IP only, IAM authentication for the
# front ends (through the Cloud SQL Auth Proxy sidecar, which does TLS and IAM), point-in-time
# recovery on. Spanner's PostgreSQL interface is the alternative at larger scale.
resource "google_sql_database_instance" "tasks" {
  name                = "${var.name}-tasks"
  database_version    = "POSTGRES_15"
  region              = var.region
  deletion_protection = true

  settings {
    tier              = var.database_tier
    availability_type = "REGIONAL"
    disk_autoresize   = true

    ip_configuration {
      ipv4_enabled    = false
      private_network = google_compute_network.confed.id
      ssl_mode        = "ENCRYPTED_ONLY"
    }

    backup_configuration {
      enabled                        = true
      point_in_time_recovery_enabled = true
      transaction_log_retention_days = 7
      backup_retention_settings {
        retained_backups = 30
      }
    }

    database_flags {
      name  = "cloudsql.iam_authentication"
      value = "on"
    }
    # Each confed process opens at most 11 connections (7 pooled, 2 for the grouped device reads,
    # 1 device write batch, 1 job listener).
    database_flags {
      name  = "max_connections"
      value = "800"
    }
  }

  depends_on = [google_service_networking_connection.private_services]
}

resource "google_sql_database" "confed" {
  name     = "confed"
  instance = google_sql_database_instance.tasks.name
}

# IAM database user for the front ends: no password exists.
resource "google_sql_user" "frontend" {
  name     = trimsuffix(google_service_account.frontend.email, ".gserviceaccount.com")
  instance = google_sql_database_instance.tasks.name
  type     = "CLOUD_IAM_SERVICE_ACCOUNT"
}
