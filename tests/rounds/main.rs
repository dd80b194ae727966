#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Integration tests of whole rounds in process: aggregation, operator attacks, the worker API, key
//! release and the release ledger, the demo, side channels: one binary (each test binary links the
//! whole crate, so a few grouped binaries build and link much faster than one per file on a 2-core
//! machine).

#[path = "../common/mod.rs"]
mod common;

mod aggregation;
mod analytics;
mod demo;
mod health;
mod key_release;
mod masked_partitions;
mod operator_attacks;
mod own_leases;
mod partitions;
mod reads_during_key;
mod refusal_records;
mod release_ledger;
mod side_channels;
mod unmask;
mod unmask_prepare;
mod witness_follow;
mod worker_api;
