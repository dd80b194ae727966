//! What the enclave worker and the untrusted front end agree on, and nothing of either: the job
//! store interface and the job it leases (`store`), the worker API's paths (`routes`) and wire types (`wire`), the
//! framing of a batch of contributions (`batch`), the
//! release manifest (`manifest`), the model format (`model`), the server optimizer's
//! configuration and state file (`optimizer`) and the pooled read buffers both sides reuse
//! (`reads`).
//!
//! The production front end links this crate and not `confed-enclave`, so it carries none of
//! the enclave's key handling, noise or OpenDP/AWS-LC/rayon (tests/crate_boundaries.rs).

#![forbid(unsafe_code)]

pub mod batch;
pub mod manifest;
pub mod model;
pub mod optimizer;
pub mod reads;
pub mod routes;
pub mod store;
pub mod wire;

pub use manifest::Manifest;
pub use model::{ModelError, ModelSchema, TensorSpec, validate_model};
pub use optimizer::{OptimizerState, ServerOptimizer};
pub use store::{JobContribution, JobSpec, JobStore, StagedRelease, StoreError};
