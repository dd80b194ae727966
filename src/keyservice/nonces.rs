//! Challenge nonces: 32 random bytes, single use, for one key id, short-lived. Held in memory:
//! a restart forgets them, which only makes enclaves ask again.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// How long a nonce stays usable (seconds).
pub const NONCE_TTL_SECONDS: i64 = 60;
/// Outstanding nonces at most; beyond this, challenges are refused until some expire.
pub const MAX_OUTSTANDING: usize = 10_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NonceProblem {
    /// Never issued, or already used.
    Unknown,
    Expired,
    OtherKey,
}

impl NonceProblem {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unknown => "nonce was not issued by this key service or was already used",
            Self::Expired => "nonce expired; request a new challenge",
            Self::OtherKey => "nonce was issued for another key id",
        }
    }
}

#[derive(Debug, Default)]
pub struct NonceStore {
    outstanding: HashMap<String, (String, i64)>,
}

impl NonceStore {
    /// Issues a nonce for `key_id`; `None` when too many are outstanding.
    pub fn issue(&mut self, key_id: &str, now: i64) -> Option<(String, i64)> {
        self.outstanding.retain(|_, (_, expires)| *expires > now);
        if self.outstanding.len() >= MAX_OUTSTANDING {
            return None;
        }
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).ok()?;
        let nonce = URL_SAFE_NO_PAD.encode(bytes);
        let expires_at = now + NONCE_TTL_SECONDS;
        self.outstanding
            .insert(nonce.clone(), (key_id.to_string(), expires_at));
        Some((nonce, expires_at))
    }

    /// Uses up a nonce. It is removed whatever the outcome, so a refused request cannot retry it.
    pub fn consume(&mut self, nonce: &str, key_id: &str, now: i64) -> Result<(), NonceProblem> {
        let (issued_for, expires_at) = self
            .outstanding
            .remove(nonce)
            .ok_or(NonceProblem::Unknown)?;
        if now >= expires_at {
            Err(NonceProblem::Expired)
        } else if issued_for != key_id {
            Err(NonceProblem::OtherKey)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonce_works_once_for_its_key_before_expiry() {
        let mut store = NonceStore::default();
        let (nonce, expires) = store.issue("k1", 100).unwrap();
        assert_eq!(expires, 100 + NONCE_TTL_SECONDS);
        assert_eq!(URL_SAFE_NO_PAD.decode(&nonce).unwrap().len(), 32);
        assert_eq!(store.consume(&nonce, "k1", 101), Ok(()));
        assert_eq!(store.consume(&nonce, "k1", 102), Err(NonceProblem::Unknown));
        let (late, _) = store.issue("k1", 100).unwrap();
        assert_eq!(
            store.consume(&late, "k1", 100 + NONCE_TTL_SECONDS),
            Err(NonceProblem::Expired)
        );
        let (other, _) = store.issue("k1", 100).unwrap();
        assert_eq!(
            store.consume(&other, "k2", 101),
            Err(NonceProblem::OtherKey)
        );
        assert_eq!(store.consume(&other, "k1", 101), Err(NonceProblem::Unknown));
    }

    #[test]
    fn outstanding_nonces_are_bounded_and_expired_ones_purged() {
        let mut store = NonceStore::default();
        for _ in 0..MAX_OUTSTANDING {
            store.issue("k", 0).unwrap();
        }
        assert!(store.issue("k", 0).is_none());
        assert!(store.issue("k", NONCE_TTL_SECONDS).is_some());
    }
}
