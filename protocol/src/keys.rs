//! Task encryption keys as devices see them: key states from the validity window, and the key an
//! assignment carries with every key service's signature over it.

use serde::{Deserialize, Serialize};

use crate::keyset::{KeySet, SignedPublicKey};

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

/// One key service's signature over a key entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct KeySignature {
    pub keyservice_id: String,
    /// ECDSA P-256 over the key-set message, 64 bytes r||s, base64url.
    pub signature: String,
}

/// A public key as handed to devices, with the key services' signatures over it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceKey {
    pub key_id: String,
    pub suite: String,
    /// X25519 public key, base64url.
    pub public_key: String,
    pub not_before: i64,
    pub not_after: i64,
    pub threshold: u16,
    pub shares: u16,
    pub signatures: Vec<KeySignature>,
}

impl DeviceKey {
    /// The signed entries as each key service published them (for signature checks).
    pub fn signed_entries(&self) -> Vec<KeySet> {
        self.signatures
            .iter()
            .map(|s| KeySet {
                keyservice_id: s.keyservice_id.clone(),
                verifying_key: String::new(),
                keys: vec![SignedPublicKey {
                    key_id: self.key_id.clone(),
                    suite: self.suite.clone(),
                    public_key: self.public_key.clone(),
                    not_before: self.not_before,
                    not_after: self.not_after,
                    threshold: self.threshold,
                    shares: self.shares,
                    state: String::new(),
                    signature: s.signature.clone(),
                }],
                masking_key: None,
            })
            .collect()
    }
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
