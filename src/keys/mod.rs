//! Task encryption keys outside the enclave: the generation ceremony, the share and key-set files
//! it writes, and key states. The whole private key exists only inside `ceremony::generate`, and
//! is wiped before it returns.

pub mod ceremony;
pub mod directory;
pub mod files;
pub mod trust;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use files::{HeldShare, KeySetFile, PublicKeyRecord, ShareFile};

#[derive(Debug, Error)]
pub enum KeyError {
    #[error(transparent)]
    Shares(#[from] confed_enclave::shares::ShareError),
    #[error("validity window is empty: --valid-from must be before --valid-until")]
    EmptyValidity,
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
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

/// A key's state at a given time: pending -> active -> expired, from its validity window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyState {
    Pending,
    Active,
    Expired,
}

impl KeyState {
    /// `not_before <= now < not_after` is active. Unix seconds.
    pub fn at(not_before: i64, not_after: i64, now: i64) -> Self {
        if now < not_before {
            Self::Pending
        } else if now < not_after {
            Self::Active
        } else {
            Self::Expired
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Active => "active",
            Self::Expired => "expired",
        }
    }
}

/// Ids of keys and key services: 1-64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_state_follows_the_validity_window() {
        assert_eq!(KeyState::at(10, 20, 9), KeyState::Pending);
        assert_eq!(KeyState::at(10, 20, 10), KeyState::Active);
        assert_eq!(KeyState::at(10, 20, 19), KeyState::Active);
        assert_eq!(KeyState::at(10, 20, 20), KeyState::Expired);
    }
}
