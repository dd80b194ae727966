#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Integration tests of the HTTP APIs and the console over the real router (partners, devices,
//! operators), tenant isolation, device tokens, evaluation, the protocol example: one binary (each
//! test binary links the whole crate, so a few grouped binaries build and link much faster than one
//! per file on a 2-core machine).

#[path = "../common/mod.rs"]
mod common;

mod admin_ops;
mod console;
mod device_tokens;
mod devices;
mod evaluation;
mod masked_tasks;
mod models;
mod protocol_example;
mod tasks;
mod tenant_isolation;
mod token_rotation;
