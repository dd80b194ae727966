//! Task encryption keys outside the enclave: the generation ceremony, the share and key-set files
//! it writes, and key states. The whole private key exists only inside `ceremony::generate`, and
//! is wiped before it returns.

pub mod ceremony;
pub mod files;

use thiserror::Error;

pub use confed_protocol::keys::{KeyState, valid_id};
pub use files::{HeldShare, KeySetFile, PublicKeyRecord, ShareFile};

#[derive(Debug, Error)]
pub enum KeyError {
    #[error(transparent)]
    Shares(#[from] confed_protocol::shares::ShareError),
    #[error("the operating system's random generator failed: {0}")]
    Random(String),
    #[error("validity window is empty: --valid-from must be before --valid-until")]
    EmptyValidity,
    #[error("{path}")]
    File {
        path: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("{path} already exists; keys and shares are never overwritten (choose another --out)")]
    Exists { path: String },
    #[error("the share file {path} does not match its key: {reason}")]
    Inconsistent { path: String, reason: String },
    #[error(
        "threshold {threshold} of {shares} is not a majority: two disjoint sets of {threshold} key services could each admit a different release of the same round, so the one-release rule would rest on no key service at all. Use --threshold {} or more, or pass --development for a key set that will never protect real data",
        shares / 2 + 1
    )]
    MinorityThreshold { threshold: u16, shares: u16 },
}
