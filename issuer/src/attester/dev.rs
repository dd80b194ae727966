//! The dev attester: a device proves only that it holds a P-256 key, by signing
//! `"confed-dev-attestation-v1" 0x00 || challenge` with it (`Evidence::dev`); its identity is the SHA-256 of the
//! key's uncompressed SEC1 encoding. Anyone can make keys, so this bounds nothing: it exists so
//! tests and `confed demo --device-auth` run the whole token flow without Android hardware, and the
//! issuer says so in its log and its directory whenever it runs with it.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::signature::Verifier;
use p256::ecdsa::{Signature, VerifyingKey};
use sha2::{Digest, Sha256};

use super::{AttestError, Attester, DeviceIdentity, Evidence, FailedCheck, Seconds};

pub const FORMAT: &str = "dev";

/// What a dev device signs.
pub fn signed_message(challenge: &[u8]) -> Vec<u8> {
    [
        confed_protocol::privacy_pass::issuer_api::DEV_ATTESTATION_LABEL,
        challenge,
    ]
    .concat()
}

#[derive(Debug, Default, Clone, Copy)]
pub struct DevAttester;

impl Attester for DevAttester {
    fn format(&self) -> &'static str {
        FORMAT
    }

    fn insecure(&self) -> bool {
        true
    }

    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        _now: Seconds,
    ) -> Result<DeviceIdentity, AttestError> {
        let Evidence::Dev {
            public_key,
            signature,
        } = evidence
        else {
            return Err(FailedCheck::format(&[FORMAT]).into());
        };
        let key = URL_SAFE_NO_PAD
            .decode(public_key)
            .ok()
            .and_then(|bytes| VerifyingKey::from_sec1_bytes(&bytes).ok())
            .ok_or_else(|| {
                AttestError::from(FailedCheck::new(
                    "public_key",
                    "not a base64url SEC1 P-256 point",
                ))
            })?;
        let signature = URL_SAFE_NO_PAD
            .decode(signature)
            .ok()
            .and_then(|bytes| Signature::from_slice(&bytes).ok())
            .ok_or_else(|| {
                AttestError::from(FailedCheck::new(
                    "signature",
                    "not a base64url 64-byte r || s ECDSA signature",
                ))
            })?;
        key.verify(&signed_message(challenge), &signature)
            .map_err(|_| {
                AttestError::from(FailedCheck::new(
                    "signature",
                    "does not verify over the challenge under public_key",
                ))
            })?;
        let point = key.to_sec1_point(false);
        Ok(DeviceIdentity(Sha256::digest(point.as_bytes()).into()))
    }
}

/// A dev device's evidence (for tests, the simulator and the demo).
pub fn evidence(key: &p256::ecdsa::SigningKey, challenge: &[u8]) -> Evidence {
    Evidence::dev(key, challenge)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> p256::ecdsa::SigningKey {
        p256::ecdsa::SigningKey::from_slice(&[byte; 32]).unwrap()
    }

    #[test]
    fn a_signature_over_the_challenge_attests_and_names_the_key_however_it_is_encoded() {
        let device = key(1);
        let identity = DevAttester
            .attest(&evidence(&device, b"c1"), b"c1", Seconds(0))
            .unwrap();
        let Evidence::Dev { signature, .. } = evidence(&device, b"c2") else {
            unreachable!("dev evidence")
        };
        let uncompressed = Evidence::Dev {
            public_key: URL_SAFE_NO_PAD
                .encode(device.verifying_key().to_sec1_point(false).as_bytes()),
            signature,
        };
        assert_eq!(
            DevAttester
                .attest(&uncompressed, b"c2", Seconds(0))
                .unwrap(),
            identity
        );
        assert_ne!(
            DevAttester
                .attest(&evidence(&key(2), b"c1"), b"c1", Seconds(0))
                .unwrap(),
            identity
        );
    }

    #[test]
    fn a_signature_over_another_challenge_or_garbage_is_refused_by_name() {
        let device = key(1);
        let refused = DevAttester
            .attest(&evidence(&device, b"old"), b"new", Seconds(0))
            .unwrap_err();
        assert_eq!(refused.checks()[0].check, "signature");
        let garbage = Evidence::Dev {
            public_key: "AAAA".into(),
            signature: "AAAA".into(),
        };
        assert_eq!(
            DevAttester
                .attest(&garbage, b"c", Seconds(0))
                .unwrap_err()
                .checks()[0]
                .check,
            "public_key"
        );
    }
}
