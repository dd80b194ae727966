//! Challenge nonces that cost the key service no state until they are used.
//!
//! A nonce is `base64url(issued_at (8 bytes, big-endian Unix seconds) || 16 random bytes ||
//! tag)`, where `tag` is the first 16 bytes of HMAC-SHA256 under a key this process drew at start
//! over the key id, `issued_at` and the random bytes (40 bytes, 54 characters: within the 10-74
//! bytes Confidential Space accepts as a token nonce). Issuing stores nothing, so no flood of
//! challenges can lock enclaves out; a release checks the tag, the age and the key id before
//! anything else, and remembers a used nonce only until it expires (single use). A restart draws
//! a new key, which only makes enclaves ask again.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

/// How long a nonce stays usable (seconds).
pub const NONCE_TTL_SECONDS: i64 = 60;
/// Used nonces remembered at most (each until it expires); beyond this, releases are refused
/// until some expire. Only nonces with a valid tag get here, each one a full release request.
pub const MAX_USED: usize = 1_000_000;

const NONCE_BYTES: usize = 40;
const DOMAIN: &[u8] = b"confed-challenge-nonce-v1\0";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NonceProblem {
    /// Not issued by this process for this key (or malformed).
    Unknown,
    Expired,
    AlreadyUsed,
    /// Too many used nonces are remembered: retry shortly.
    Busy,
}

impl NonceProblem {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Unknown => {
                "nonce was not issued by this key service for this key (or it restarted since); request a new challenge"
            }
            Self::Expired => "nonce expired; request a new challenge",
            Self::AlreadyUsed => "nonce was already used; request a new challenge",
            Self::Busy => "too many releases in the last minute; retry shortly",
        }
    }
}

pub struct NonceStore {
    key: ring::hmac::Key,
    /// Random part of each used nonce -> when it expires.
    used: HashMap<[u8; 16], i64>,
}

impl std::fmt::Debug for NonceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NonceStore")
            .field("used", &self.used.len())
            .finish_non_exhaustive()
    }
}

impl Default for NonceStore {
    fn default() -> Self {
        let mut secret = Zeroizing::new([0u8; 32]);
        getrandom::fill(secret.as_mut()).expect("the OS random source works");
        Self {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_ref()),
            used: HashMap::new(),
        }
    }
}

impl NonceStore {
    fn tag(&self, key_id: &str, issued_at: &[u8; 8], random: &[u8; 16]) -> [u8; 16] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(DOMAIN);
        context.update(&(key_id.len() as u64).to_be_bytes());
        context.update(key_id.as_bytes());
        context.update(issued_at);
        context.update(random);
        let mut tag = [0u8; 16];
        tag.copy_from_slice(&context.sign().as_ref()[..16]);
        tag
    }

    /// Issues a nonce for `key_id`; stores nothing.
    pub fn issue(&self, key_id: &str, now: i64) -> Result<(String, i64), getrandom::Error> {
        let mut random = [0u8; 16];
        getrandom::fill(&mut random)?;
        let issued_at = now.to_be_bytes();
        let mut bytes = Vec::with_capacity(NONCE_BYTES);
        bytes.extend_from_slice(&issued_at);
        bytes.extend_from_slice(&random);
        bytes.extend_from_slice(&self.tag(key_id, &issued_at, &random));
        Ok((URL_SAFE_NO_PAD.encode(bytes), now + NONCE_TTL_SECONDS))
    }

    /// Checks a nonce without using it: issued here, for this key, not expired. Cheap (one
    /// HMAC), so it runs before anything costly.
    fn check(&self, nonce: &str, key_id: &str, now: i64) -> Result<([u8; 16], i64), NonceProblem> {
        let bytes = URL_SAFE_NO_PAD
            .decode(nonce)
            .map_err(|_| NonceProblem::Unknown)?;
        if bytes.len() != NONCE_BYTES {
            return Err(NonceProblem::Unknown);
        }
        let issued_at: [u8; 8] = bytes[..8].try_into().expect("8 bytes");
        let random: [u8; 16] = bytes[8..24].try_into().expect("16 bytes");
        let expected = self.tag(key_id, &issued_at, &random);
        if !bool::from(expected.ct_eq(&bytes[24..])) {
            return Err(NonceProblem::Unknown);
        }
        let issued = i64::from_be_bytes(issued_at);
        let expires_at = issued.saturating_add(NONCE_TTL_SECONDS);
        // Issued in the future means the clock went back: refuse rather than extend its life.
        if now >= expires_at || issued > now {
            return Err(NonceProblem::Expired);
        }
        Ok((random, expires_at))
    }

    /// Uses up a nonce: valid, and not used before. A used nonce is remembered until it expires,
    /// whatever the outcome of the request that used it, so a refused request cannot retry it.
    pub fn consume(&mut self, nonce: &str, key_id: &str, now: i64) -> Result<(), NonceProblem> {
        let (random, expires_at) = self.check(nonce, key_id, now)?;
        if self.used.len() >= MAX_USED / 2 {
            self.used.retain(|_, expires| *expires > now);
        }
        if self.used.contains_key(&random) {
            return Err(NonceProblem::AlreadyUsed);
        }
        if self.used.len() >= MAX_USED {
            return Err(NonceProblem::Busy);
        }
        self.used.insert(random, expires_at);
        Ok(())
    }

    /// Used nonces remembered now.
    pub fn remembered(&self) -> usize {
        self.used.len()
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
        assert_eq!(URL_SAFE_NO_PAD.decode(&nonce).unwrap().len(), 40);
        assert_eq!(nonce.len(), 54, "within Confidential Space's 10-74 bytes");
        assert_eq!(store.consume(&nonce, "k1", 101), Ok(()));
        assert_eq!(
            store.consume(&nonce, "k1", 102),
            Err(NonceProblem::AlreadyUsed)
        );
        let (late, _) = store.issue("k1", 100).unwrap();
        assert_eq!(
            store.consume(&late, "k1", 100 + NONCE_TTL_SECONDS),
            Err(NonceProblem::Expired)
        );
        let (other, _) = store.issue("k1", 100).unwrap();
        assert_eq!(store.consume(&other, "k2", 101), Err(NonceProblem::Unknown));
        assert_eq!(store.consume(&other, "k1", 101), Ok(()));
    }

    /// The challenge flood: issuing stores nothing, so any number of challenges leaves room for
    /// an enclave's; only nonces that are used are remembered, and only until they expire.
    #[test]
    fn a_challenge_flood_costs_no_state_and_locks_nobody_out() {
        let mut store = NonceStore::default();
        for _ in 0..100_000 {
            store.issue("k", 0).unwrap();
        }
        assert_eq!(store.remembered(), 0);
        let (enclaves, _) = store.issue("k", 0).unwrap();
        assert_eq!(store.consume(&enclaves, "k", 1), Ok(()));
        assert_eq!(store.remembered(), 1);
    }

    #[test]
    fn forged_or_altered_nonces_are_unknown() {
        let mut store = NonceStore::default();
        let (nonce, _) = store.issue("k", 100).unwrap();
        let mut bytes = URL_SAFE_NO_PAD.decode(&nonce).unwrap();
        // Pushing issued_at forward to extend a nonce's life breaks its tag.
        bytes[7] ^= 1;
        let altered = URL_SAFE_NO_PAD.encode(&bytes);
        for bad in [altered.as_str(), "", "not base64!", &"A".repeat(54)] {
            assert_eq!(
                store.consume(bad, "k", 101),
                Err(NonceProblem::Unknown),
                "{bad}"
            );
        }
        let another_process = NonceStore::default();
        let (theirs, _) = another_process.issue("k", 100).unwrap();
        assert_eq!(store.consume(&theirs, "k", 101), Err(NonceProblem::Unknown));
        assert_eq!(
            store.consume(&nonce, "k", 99),
            Err(NonceProblem::Expired),
            "issued in the future"
        );
    }
}
