//! Key sets: the public keys a key service vouches for, and its P-256 signature over each entry,
//! which devices check before they encrypt (`GET /v1/keys`, `docs/protocol.md`). JSON on the wire;
//! binary values are unpadded base64url; times are Unix seconds.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{Signature, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

/// One public key as a key service vouches for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedPublicKey {
    pub key_id: String,
    pub suite: String,
    /// X25519 public key, base64url.
    pub public_key: String,
    pub not_before: i64,
    pub not_after: i64,
    pub threshold: u16,
    pub shares: u16,
    /// `pending`, `active` or `expired` at the time of the answer (not signed).
    pub state: String,
    /// ECDSA P-256 / SHA-256 over `signed_message`, 64 bytes r||s, base64url.
    pub signature: String,
}

/// `GET /v1/keys` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySet {
    pub keyservice_id: String,
    /// This key service's P-256 verifying key: SEC1 uncompressed point (65 bytes), base64url.
    pub verifying_key: String,
    pub keys: Vec<SignedPublicKey>,
    /// The key service's masking key for masked rounds (`masking_keys.rs`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masking_key: Option<crate::masking_keys::SignedMaskingKey>,
}

/// A fresh random P-256 signing key from the operating system's generator.
pub fn generate_signing_key() -> SigningKey {
    loop {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).expect("the operating system's random generator failed");
        // Fails only for the zero scalar or one at least the group order: draw again.
        if let Ok(key) = SigningKey::from_slice(&bytes) {
            return key;
        }
    }
}

/// The bytes a key service signs for one key: fields joined by `|` after a version label. Ids are
/// restricted to `A-Z a-z 0-9 . _ -`, so the encoding is unambiguous.
pub fn signed_message(keyservice_id: &str, key: &SignedPublicKey) -> Vec<u8> {
    format!(
        "confed-keyset-v1|{keyservice_id}|{}|{}|{}|{}|{}|{}|{}",
        key.key_id,
        key.suite,
        key.public_key,
        key.not_before,
        key.not_after,
        key.threshold,
        key.shares
    )
    .into_bytes()
}

/// Signs a key entry (fills `signature`).
pub fn sign_key(signing_key: &SigningKey, keyservice_id: &str, key: &mut SignedPublicKey) {
    let signature: Signature = signing_key.sign(&signed_message(keyservice_id, key));
    key.signature = URL_SAFE_NO_PAD.encode(signature.to_bytes());
}

/// Whether `key` carries a valid signature of the key service `keyservice_id` with `verifying_key`.
pub fn verify_key(
    verifying_key: &VerifyingKey,
    keyservice_id: &str,
    key: &SignedPublicKey,
) -> bool {
    let Ok(bytes) = URL_SAFE_NO_PAD.decode(&key.signature) else {
        return false;
    };
    let Ok(signature) = Signature::from_slice(&bytes) else {
        return false;
    };
    verifying_key
        .verify(&signed_message(keyservice_id, key), &signature)
        .is_ok()
}

/// Encodes a verifying key as published in `KeySet::verifying_key`.
pub fn encode_verifying_key(key: &VerifyingKey) -> String {
    URL_SAFE_NO_PAD.encode(key.to_sec1_point(false).as_bytes())
}

pub fn decode_verifying_key(text: &str) -> Option<VerifyingKey> {
    let bytes = URL_SAFE_NO_PAD.decode(text).ok()?;
    VerifyingKey::from_sec1_bytes(&bytes).ok()
}
