//! The TEE workload of confed. Only this crate ever holds a reassembled private key, a plaintext
//! update or an un-noised sum. It never depends on the untrusted front ends (the root package).

pub mod model;

pub use model::{ModelError, ModelSchema, TensorSpec};
