//! The TEE workload of confed. Only this crate ever holds a reassembled private key, a plaintext
//! update or an un-noised sum. It never depends on the untrusted front ends (the root package).
//! It also defines the cryptographic formats the front ends produce for it (HPKE use, shares,
//! models), so both sides share one definition.

pub mod aggregate;
pub mod dp;
pub mod envelope;
mod envelope_cbor;
pub mod hpke;
pub mod hpke_awslc;
pub mod http;
pub mod key_collection;
pub mod model;
pub mod policy;
pub mod remote;
pub mod secret;
pub mod shares;
pub mod updater;
pub mod worker;

pub use model::{ModelError, ModelSchema, TensorSpec};
