//! The TEE workload of confed. Only this crate ever holds a reassembled private key, a plaintext
//! update or an un-noised sum. It never depends on the untrusted front ends (the root package).
//! The formats it shares with the other parties (HPKE use, envelopes, task policies, shares) are
//! confed-protocol's, so every side has one definition.

pub mod aggregate;
pub mod dp;
pub mod envelope;
pub mod hpke_awslc;
pub mod key_collection;
pub mod model;
pub mod optimizer;
pub mod reads;
pub mod remote;
pub mod secret;
pub mod updater;
pub mod worker;

// The formats the enclave shares with devices, key services and front ends are defined once, in
// confed-protocol; named here so enclave code reads `crate::hpke`, `crate::policy`, ...
pub use confed_protocol::{hpke, http, policy, shares};

pub use model::{ModelError, ModelSchema, TensorSpec};
