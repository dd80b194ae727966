//! The TEE workload of confed. Only this crate ever holds a reassembled private key, a plaintext
//! update or an un-noised sum. It never depends on the untrusted front ends (the root package).
//! The formats it shares with the other parties (HPKE use, envelopes, task policies, shares) are
//! confed-protocol's, and what it shares with the front end (the job store interface, the worker
//! API, the release manifest, the model format) confed-worker-api's, so every side has one
//! definition and the front end links none of this crate.

pub mod aggregate;
pub mod analytics;
pub mod dp;
pub mod envelope;
pub mod hpke_awslc;
mod hpke_ring;
pub mod key_collection;
pub mod masked;
pub mod optimizer;
pub mod remote;
pub mod secret;
pub mod updater;
pub mod worker;

// The formats the enclave shares with devices, key services and front ends are defined once, in
// confed-protocol; named here so enclave code reads `crate::hpke`, `crate::policy`, ...
pub use confed_protocol::{hpke, http, policy, shares};
