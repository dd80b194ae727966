//! The device side of confed, as a library other Rust programs can use: check in, honour retry
//! windows, verify the task key (T trusted signatures), download the model with caching, seal the
//! update with HPKE, upload with retries (idempotent), report.

pub mod client;
pub mod simulate;
pub mod train;

pub use client::{Checkin, DeviceClient, DeviceError, TrustConfig};
