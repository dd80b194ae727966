# Enclave workers: Confidential VMs (AMD SEV) booting Google's Confidential Space image, which runs
# exactly the container named by digest in `tee-image-reference` and attests to it. The
# production image family (not `confidential-space-debug`): no SSH, no serial console, and the
# token says `dbgstat = disabled-since-boot`, which the key services' policy requires.
locals {
  keyservices = join(",", [for id, url in var.keyservices : "${id}=${url}"])
}

resource "google_compute_instance_template" "enclave" {
  name_prefix  = "${var.name}-enclave-"
  machine_type = var.enclave_machine_type
  region       = var.region

  confidential_instance_config {
    enable_confidential_compute = true
    confidential_instance_type  = "SEV"
  }

  shielded_instance_config {
    enable_secure_boot          = true
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  scheduling {
    # Confidential VMs cannot live-migrate.
    on_host_maintenance = "TERMINATE"
    automatic_restart   = true
  }

  disk {
    source_image = "projects/confidential-space-images/global/images/family/confidential-space"
    auto_delete  = true
    boot         = true
    disk_size_gb = 20
  }

  network_interface {
    subnetwork = google_compute_subnetwork.confed.id
    # No external address: egress through Cloud NAT.
  }

  service_account {
    email  = google_service_account.enclave.email
    scopes = ["cloud-platform"]
  }

  # Only what the image's launch policy allows to be set (deploy/confidential-space/Dockerfile):
  # where the server and key services are, and which secret holds the worker token. Never the
  # token itself: every tee-env value is copied into the attestation token each key service
  # receives. Nothing here can weaken privacy.
  metadata = {
    tee-image-reference                = var.enclave_image
    tee-restart-policy                 = "Always"
    tee-container-log-redirect         = "false"
    tee-env-CONFED_SERVER              = var.server_url
    tee-env-CONFED_KEYSERVICES         = local.keyservices
    tee-env-CONFED_THRESHOLD           = tostring(var.threshold)
    tee-env-CONFED_WORKER_TOKEN_SECRET = "${google_secret_manager_secret.worker_token.id}/versions/latest"
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "google_compute_region_instance_group_manager" "enclave" {
  name                      = "${var.name}-enclave"
  region                    = var.region
  base_instance_name        = "${var.name}-enclave"
  distribution_policy_zones = var.zones
  target_size               = var.enclave_workers

  version {
    instance_template = google_compute_instance_template.enclave.id
  }

  # A new image digest rolls out VM by VM; leases hand a dying worker's job to another.
  update_policy {
    type                  = "PROACTIVE"
    minimal_action        = "REPLACE"
    max_surge_fixed       = length(var.zones)
    max_unavailable_fixed = 0
  }
}
