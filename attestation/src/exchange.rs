//! The messages of the key-release exchange between an enclave (attester) and a key service
//! (verifier and relying party), and the key-set signatures devices check. JSON on the wire; binary
//! values are unpadded base64url; times are Unix seconds. See `docs/protocol.md`.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::VerifyingKey;
use serde::{Deserialize, Serialize};

use crate::release::{Receipt, ReleaseCommitment};

// Key sets are part of the device protocol: defined in confed-protocol, named here too so the
// key-release exchange reads as one module.
pub use confed_protocol::keyset::{
    KeySet, SignedPublicKey, decode_verifying_key, encode_verifying_key, generate_signing_key,
    sign_key, signed_message, verify_key,
};

/// `POST /v1/keys/{key_id}/challenge` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Challenge {
    /// 32 random bytes, base64url: put it in the token's `eat_nonce`.
    pub nonce: String,
    /// Unix seconds after which the nonce is refused.
    pub expires_at: i64,
    /// The audience this key service requires in the token's `aud`.
    pub audience: String,
}

/// `POST /v1/keys/{key_id}/release` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The attestation token (compact JWS).
    pub token: String,
    /// The enclave's ephemeral X25519 public key (32 bytes, base64url).
    pub ephemeral_public_key: String,
    /// The enclave's per-job P-256 signing key (SEC1 uncompressed, 65 bytes, base64url). The
    /// token's `eat_nonce` must contain `release::key_binding` of both keys.
    pub enclave_signing_key: String,
    /// The nonce from the challenge.
    pub nonce: String,
    pub task_id: String,
    pub round: u64,
    /// What this round's release will depend on; recorded in the key service's ledger.
    pub commitment: ReleaseCommitment,
    /// The task policy text whose SHA-256 is `commitment.policy_sha256`.
    pub policy: String,
}

/// A release request whose fields have been checked (what `ReleaseRequest::decode` yields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckedRelease {
    pub token: String,
    pub ephemeral_public_key: [u8; 32],
    /// SEC1 bytes of the enclave's per-job signing key, and the key itself.
    pub enclave_signing_key: Vec<u8>,
    pub nonce: String,
    pub task_id: String,
    pub round: u64,
    pub commitment: ReleaseCommitment,
    pub policy: String,
}

/// Longest nonce accepted in a release request (ours are 43 characters).
pub const MAX_NONCE_CHARS: usize = 128;
/// Longest task policy text accepted in a release request.
pub const MAX_POLICY_BYTES: usize = 80 * 1024;

impl ReleaseRequest {
    /// Decodes and checks a release request body. Never panics, whatever the bytes; every error
    /// says which field is wrong.
    pub fn decode(body: &[u8]) -> Result<CheckedRelease, String> {
        let mut json = serde_json::Deserializer::from_slice(body);
        let request: ReleaseRequest = serde_path_to_error::deserialize(&mut json)
            .map_err(|e| format!("not a release request: `{}`: {}", e.path(), e.inner()))?;
        // A token over `jws::MAX_TOKEN_BYTES` is not refused here (400) but by the appraisal's
        // `token_format` check (403), as for any other malformed token; the route's body limit
        // (128 KiB) bounds what is read.
        let ephemeral_public_key: [u8; 32] = URL_SAFE_NO_PAD
            .decode(&request.ephemeral_public_key)
            .ok()
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or("`ephemeral_public_key` must be a 32-byte X25519 public key in base64url")?;
        let enclave_signing_key = URL_SAFE_NO_PAD
            .decode(&request.enclave_signing_key)
            .ok()
            .filter(|bytes| bytes.len() == 65 && VerifyingKey::from_sec1_bytes(bytes).is_ok())
            .ok_or("`enclave_signing_key` must be an uncompressed SEC1 P-256 point (65 bytes) in base64url")?;
        if request.nonce.is_empty() || request.nonce.len() > MAX_NONCE_CHARS {
            return Err(format!("`nonce` must be 1-{MAX_NONCE_CHARS} characters"));
        }
        let task_ok = (1..=128).contains(&request.task_id.len())
            && request
                .task_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !task_ok {
            return Err("`task_id` must be 1-128 of A-Z a-z 0-9 . _ -".into());
        }
        request.commitment.check()?;
        if request.commitment.task_id != request.task_id
            || request.commitment.round != request.round
        {
            return Err("`commitment` must name the request's task_id and round".into());
        }
        if request.policy.len() > MAX_POLICY_BYTES {
            return Err(format!("`policy` is longer than {MAX_POLICY_BYTES} bytes"));
        }
        Ok(CheckedRelease {
            token: request.token,
            ephemeral_public_key,
            enclave_signing_key,
            nonce: request.nonce,
            task_id: request.task_id,
            round: request.round,
            commitment: request.commitment,
            policy: request.policy,
        })
    }
}

/// `POST /v1/keys/{key_id}/release` answer: the share, HPKE-sealed to the ephemeral key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseResponse {
    pub keyservice_id: String,
    pub key_id: String,
    /// HPKE encapsulated key, base64url.
    pub encapsulated_key: String,
    /// HPKE ciphertext of the share (`x || y`), base64url. `info` is
    /// `share_release_info(keyservice_id, key_id, task_id, round)`, `aad` the nonce's UTF-8 bytes.
    pub ciphertext: String,
    /// The key service's signed receipt for the commitment it recorded.
    pub receipt: Receipt,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_requests_are_decoded_or_refused_by_field() {
        let signing = generate_signing_key();
        let good = serde_json::json!({
            "token": "a.b.c", "ephemeral_public_key": URL_SAFE_NO_PAD.encode([7u8; 32]),
            "enclave_signing_key": encode_verifying_key(signing.verifying_key()),
            "nonce": "n", "task_id": "t-1", "round": 3,
            "commitment": {"task_id": "t-1", "round": 3, "key_id": "k1", "policy_sha256": "a".repeat(64),
                           "model_sha256": "b".repeat(64), "inputs_digest": "c".repeat(64)},
            "policy": "p",
        });
        let checked = ReleaseRequest::decode(good.to_string().as_bytes()).unwrap();
        assert_eq!(checked.ephemeral_public_key, [7u8; 32]);
        let cases = [
            ("ephemeral_public_key", serde_json::json!("AAAA")),
            ("enclave_signing_key", serde_json::json!("AAAA")),
            (
                "commitment",
                serde_json::json!({"task_id": "t-2", "round": 3,
                "policy_sha256": "a".repeat(64), "model_sha256": "b".repeat(64),
                "inputs_digest": "c".repeat(64)}),
            ),
            ("task_id", serde_json::json!("../etc")),
            ("nonce", serde_json::json!("")),
            ("round", serde_json::json!(-1)),
            ("surprise", serde_json::json!(1)),
        ];
        for (field, value) in cases {
            let mut bad = good.clone();
            bad[field] = value;
            let error = ReleaseRequest::decode(bad.to_string().as_bytes()).unwrap_err();
            assert!(error.contains(field), "{field}: {error}");
        }
        assert!(ReleaseRequest::decode(b"\xff\x00").is_err());
        // A 20 KiB token is the appraisal's to refuse (403 token_format), not a 400 here.
        let mut long = good.clone();
        long["token"] = serde_json::json!("a".repeat(20 * 1024));
        assert!(ReleaseRequest::decode(long.to_string().as_bytes()).is_ok());
    }

    fn entry() -> SignedPublicKey {
        SignedPublicKey {
            key_id: "k1".into(),
            suite: "S".into(),
            public_key: "cGs".into(),
            not_before: 10,
            not_after: 20,
            threshold: 3,
            shares: 5,
            state: "active".into(),
            signature: String::new(),
        }
    }

    #[test]
    fn signature_covers_every_field_but_state() {
        let key = crate::dev::generate_signing_key();
        let mut signed = entry();
        sign_key(&key, "ks1", &mut signed);
        let verifying = decode_verifying_key(&encode_verifying_key(key.verifying_key())).unwrap();
        assert!(verify_key(&verifying, "ks1", &signed));
        assert!(
            !verify_key(&verifying, "ks2", &signed),
            "bound to the key service id"
        );
        let mut changed = signed.clone();
        changed.state = "expired".into();
        assert!(
            verify_key(&verifying, "ks1", &changed),
            "state is informative, not signed"
        );
        for tamper in [
            |k: &mut SignedPublicKey| k.public_key = "b3RoZXI".into(),
            |k: &mut SignedPublicKey| k.not_after = 99,
            |k: &mut SignedPublicKey| k.threshold = 1,
            |k: &mut SignedPublicKey| k.key_id = "k2".into(),
        ] {
            let mut bad = signed.clone();
            tamper(&mut bad);
            assert!(!verify_key(&verifying, "ks1", &bad));
        }
        let mut garbage = signed;
        garbage.signature = "!!".into();
        assert!(!verify_key(&verifying, "ks1", &garbage));
    }
}
