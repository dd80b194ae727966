# GKE Autopilot for the stateless front ends (deploy/gcp/k8s): Workload Identity is on by
# default, nodes are Shielded VMs, and no node pool is ours to patch.
resource "google_container_cluster" "frontends" {
  name                = "${var.name}-frontends"
  location            = var.region
  enable_autopilot    = true
  network             = google_compute_network.confed.id
  subnetwork          = google_compute_subnetwork.confed.id
  deletion_protection = true

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
  }

  release_channel {
    channel = "REGULAR"
  }
}
