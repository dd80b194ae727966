//! The wire formats of confed, one definition for every party: the device messages of the task
//! assignment API (`device`), key sets and their signatures (`keyset`, `keys`), the task policy a
//! device agrees to (`policy`), the contribution envelope and its HPKE sealing (`envelope`,
//! `hpke`), the device's trust file, the state names the API reports (`states`), and Privacy
//! Pass device tokens (`privacy_pass`).
//!
//! This crate is what a device links (through `confed-device`), so it depends on no other confed
//! crate, no database, HTTP server, DP or thread-pool crate; `docs/protocol.md` describes every
//! format here byte for byte.

#![forbid(unsafe_code)]

pub mod analytics;
pub mod answer;
pub mod blt_noise;
pub mod clock;
pub mod device;
pub mod device_auth;
pub mod envelope;
mod envelope_cbor;
pub mod envelope_scan;
pub mod errors;
pub mod grid;
pub mod hex;
pub mod hpke;
pub mod hpke_ephemeral;
#[cfg(feature = "http")]
pub mod http;
pub mod ids;
pub mod keys;
pub mod keyset;
pub mod masking;
pub mod masking_keys;
pub mod masking_noise;
pub mod masking_ring;
pub mod masking_sums;
pub mod mechanism;
pub mod policy;
pub mod privacy_pass;
#[cfg(feature = "shares")]
pub mod shares;
pub mod states;
pub mod trust;
pub mod upload_window;
