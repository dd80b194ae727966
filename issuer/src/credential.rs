//! The credential a device presents instead of evidence for the rest of a window, so it attests
//! once per window (Android key attestation costs a key generation in secure hardware), not once
//! per token request:
//!
//! ```text
//! credential = base64url( window_index (8 bytes, big-endian) || identity (32) || tag (16) )
//! tag        = HMAC-SHA256(key, "confed-issuer-credential-v1" 0x00 || window_index || identity)[..16]
//! ```
//!
//! `identity` is what the attester derived (the same value the limiter counts by), so a
//! credential carries the device's allowance and nothing else; it is valid only in its window.
//! The key is derived from the limiter's persistent key, so credentials survive a restart.

use subtle::ConstantTimeEq;

use crate::attester::DeviceIdentity;

const LABEL: &[u8] = b"confed-issuer-credential-v1\0";
const BYTES: usize = 8 + 32 + 16;

pub struct Credentials {
    key: ring::hmac::Key,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials")
    }
}

impl Credentials {
    pub fn new(key: ring::hmac::Key) -> Self {
        Self { key }
    }

    fn tag(&self, window: i64, identity: &[u8]) -> [u8; 16] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(LABEL);
        context.update(&window.to_be_bytes());
        context.update(identity);
        context.sign().as_ref()[..16].try_into().expect("16 bytes")
    }

    pub fn issue(&self, window: i64, identity: &DeviceIdentity) -> Vec<u8> {
        let mut out = Vec::with_capacity(BYTES);
        out.extend_from_slice(&window.to_be_bytes());
        out.extend_from_slice(&identity.0);
        out.extend_from_slice(&self.tag(window, &identity.0));
        out
    }

    /// The identity a credential of window `window` carries, if it is one of ours.
    pub fn check(&self, credential: &[u8], window: i64) -> Option<DeviceIdentity> {
        if credential.len() != BYTES {
            return None;
        }
        let (head, tag) = credential.split_at(40);
        let issued = i64::from_be_bytes(head[..8].try_into().expect("8 bytes"));
        let expected = self.tag(issued, &head[8..]);
        if !bool::from(expected.ct_eq(tag)) || issued != window {
            return None;
        }
        Some(DeviceIdentity(head[8..].try_into().expect("32 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn credentials(byte: u8) -> Credentials {
        Credentials::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[byte; 32]))
    }

    #[test]
    fn a_credential_carries_its_identity_in_its_window_only_and_cannot_be_altered() {
        let ours = credentials(1);
        let identity = DeviceIdentity([7; 32]);
        let credential = ours.issue(5, &identity);
        assert_eq!(ours.check(&credential, 5), Some(identity));
        assert_eq!(ours.check(&credential, 6), None);
        assert_eq!(credentials(2).check(&credential, 5), None);
        let mut other = credential.clone();
        other[20] ^= 1;
        assert_eq!(ours.check(&other, 5), None);
        assert_eq!(ours.check(&credential[..55], 5), None);
    }
}
