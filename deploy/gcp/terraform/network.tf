resource "google_compute_network" "confed" {
  name                    = var.name
  auto_create_subnetworks = false
}

resource "google_compute_subnetwork" "confed" {
  name                     = var.name
  network                  = google_compute_network.confed.id
  region                   = var.region
  ip_cidr_range            = "10.40.0.0/20"
  private_ip_google_access = true
}

resource "google_compute_global_address" "private_services" {
  name          = "${var.name}-private-services"
  purpose       = "VPC_PEERING"
  address_type  = "INTERNAL"
  prefix_length = 20
  network       = google_compute_network.confed.id
}

resource "google_service_networking_connection" "private_services" {
  network                 = google_compute_network.confed.id
  service                 = "servicenetworking.googleapis.com"
  reserved_peering_ranges = [google_compute_global_address.private_services.name]
}

# Enclave VMs have no external address; they reach the key services and Google APIs via NAT.
resource "google_compute_router" "confed" {
  name    = var.name
  network = google_compute_network.confed.id
  region  = var.region
}

resource "google_compute_router_nat" "confed" {
  name                               = var.name
  router                             = google_compute_router.confed.name
  region                             = var.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "ALL_SUBNETWORKS_ALL_IP_RANGES"
}
