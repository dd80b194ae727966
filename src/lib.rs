//! confed: the untrusted front ends of a confidential-computing federated-learning server (task
//! management for partners, the scheduler, the task database, the blob store) and its CLI.
//! Nothing here ever sees a plaintext update, a key share or an un-noised sum.
//!
//! The device library is `confed-device` (re-exported as `confed::device` for the tools), the
//! wire formats are `confed-protocol`, what the front end and enclave workers agree on is
//! `confed-worker-api`, and the privacy accounting `confed-dp`.
//!
//! The `embedded` feature (on by default) adds the embedded default: key services and an enclave
//! worker in process (`embedded`, DEV attester only) and the tools built on it (`tools`: the
//! simulator, local training and the demo). Without it the crate links no enclave, key-service
//! or issuer code (`cargo tree -p confed --no-default-features`; tests/crate_boundaries.rs):
//! the production front end is built that way (deploy/gcp/Dockerfile).

pub mod aggregation;
pub mod api;
pub mod app;
pub mod auth;
pub mod blob;
pub mod checkin;
pub mod clock;
pub mod console;
pub mod db;
#[cfg(feature = "embedded")]
pub mod embedded;
pub mod evaluation;
pub mod keys;
pub mod ports;
pub mod registry;
pub mod release_check;
pub mod retention;
pub mod scheduler;
pub mod scheduling;
pub mod server;
pub mod spool;
pub mod states;
pub mod task_spec;
pub mod tasks;
#[cfg(feature = "embedded")]
pub mod tools;
pub mod uploads;
pub mod verify;
pub mod web;

pub use confed_device as device;
#[cfg(feature = "embedded")]
pub use confed_keyservice as keyservice;
