#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Integration tests of the real binaries as processes: confed serve, the key service, confed-
//! enclave, the local multi-process cluster, the simulator, Secret Manager: one binary (each test
//! binary links the whole crate, so a few grouped binaries build and link much faster than one per
//! file on a 2-core machine).

#[path = "../common/mod.rs"]
mod common;

mod embedded_ports;
mod enclave;
mod keyservice;
mod local_cluster;
mod monitoring;
mod secret_manager;
mod serve;
mod simulation;
mod witness_flood;
