#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Integration tests of the task database and blob stores: transitions, the device store on both
//! engines, the scheduler and scheduling policies, retention, GCS, PostgreSQL replicas, job faults:
//! one binary (each test binary links the whole crate, so a few grouped binaries build and link
//! much faster than one per file on a 2-core machine).

#[path = "../common/mod.rs"]
mod common;

mod db_transitions;
mod device_store;
mod gcs_blobs;
mod job_faults;
mod postgres_replicas;
mod retention;
mod scheduler;
mod scheduling;
