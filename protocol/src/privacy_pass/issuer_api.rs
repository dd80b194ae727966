//! The token issuer's HTTP API as devices and the issuer share it (`docs/protocol.md`, "Device
//! tokens"): JSON bodies, binary values in base64url without padding.
//!
//! - `GET /v1/directory` -> `Directory` (RFC 9578's issuer directory, plus the window and limit)
//! - `POST /v1/challenge` -> `ChallengeResponse`
//! - `POST /v1/token-request` with `TokenRequestBody` -> `TokenResponseBody`
//!
//! A device attests (`challenge` + `evidence`) once per window; the answer carries a credential
//! it presents instead for the rest of the window.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

/// The dev attester's signed message: this label, then the raw challenge bytes.
pub const DEV_ATTESTATION_LABEL: &[u8] = b"confed-dev-attestation-v1\0";

/// What an App Attest key signs over for the issuer (its `clientDataHash`): SHA-256 of this
/// label, then the raw challenge bytes. The label keeps an assertion made for the issuer apart
/// from any the app's own servers ask the same key for.
pub const APP_ATTEST_CLIENT_DATA_LABEL: &[u8] = b"confed-app-attest-v1\0";

/// The `clientDataHash` an App Attest device passes to `attestKey` or `generateAssertion` for the
/// issuer's `challenge`.
pub fn app_attest_client_data_hash(challenge: &[u8]) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::new()
        .chain_update(APP_ATTEST_CLIENT_DATA_LABEL)
        .chain_update(challenge)
        .finalize()
        .into()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenKey {
    #[serde(rename = "token-type")]
    pub token_type: u16,
    /// base64url DER SubjectPublicKeyInfo (RSASSA-PSS).
    #[serde(rename = "token-key")]
    pub token_key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Directory {
    pub issuer_name: String,
    #[serde(rename = "issuer-request-uri")]
    pub issuer_request_uri: String,
    #[serde(rename = "token-keys")]
    pub token_keys: Vec<TokenKey>,
    /// Lowercase hex SHA-256 of the (first) token key's SPKI: the key id its tokens carry.
    pub token_key_id: String,
    /// L: tokens one attested device may obtain per window.
    pub tokens_per_window: u32,
    pub window_seconds: i64,
    /// The evidence `format` the issuer accepts (the first, when it accepts several).
    pub attester: String,
    /// Every evidence `format` the issuer accepts (e.g. Android's and Apple's for an app on both).
    #[serde(default)]
    pub attesters: Vec<String>,
    /// Present when the attester bounds nothing (the dev attester).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChallengeResponse {
    /// base64url, 40 bytes: what the evidence must bind.
    pub challenge: String,
    /// Unix seconds after which the issuer refuses evidence bound to it.
    pub expires_at: crate::clock::Seconds,
}

/// The evidence a device attests with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "format", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Evidence {
    /// A self-made P-256 key signing `DEV_ATTESTATION_LABEL || challenge`: tests and demos only.
    Dev {
        /// base64url SEC1 P-256 point.
        public_key: String,
        /// base64url 64-byte `r || s` ECDSA-P256-SHA256 signature.
        signature: String,
    },
    /// Android key attestation (`issuer/src/attester/android/`): the certificate chain of a
    /// key the device generated with the issuer's challenge as its attestation challenge, as
    /// Android's `KeyStore.getCertificateChain` returns it.
    AndroidKeyAttestation {
        /// base64url DER certificates, the attested key's first and the root's last.
        certificate_chain: Vec<String>,
    },
    /// Apple App Attest (`issuer/src/attester/apple/`): once per key, the attestation object
    /// `DCAppAttestService.attestKey` returns; afterwards an assertion of the same key
    /// (`generateAssertion`), both over `app_attest_client_data_hash(challenge)`. Exactly one of
    /// `attestation` and `assertion`.
    AppleAppAttest {
        /// base64url, 32 bytes: the key identifier `generateKey` returned (SHA-256 of its public key).
        key_id: String,
        /// base64url CBOR attestation object (`fmt` "apple-appattest", `attStmt`, `authData`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attestation: Option<String>,
        /// base64url CBOR assertion (`signature`, `authenticatorData`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        assertion: Option<String>,
    },
}

impl Evidence {
    /// The `format` this evidence carries on the wire.
    pub fn format(&self) -> &'static str {
        match self {
            Self::Dev { .. } => "dev",
            Self::AndroidKeyAttestation { .. } => "android-key-attestation",
            Self::AppleAppAttest { .. } => "apple-app-attest",
        }
    }

    /// A dev device's evidence for `challenge` under `key`.
    pub fn dev(key: &p256::ecdsa::SigningKey, challenge: &[u8]) -> Self {
        use p256::ecdsa::signature::Signer;
        let signature: p256::ecdsa::Signature =
            key.sign(&[DEV_ATTESTATION_LABEL, challenge].concat());
        Self::Dev {
            public_key: URL_SAFE_NO_PAD.encode(key.verifying_key().to_sec1_point(true).as_bytes()),
            signature: URL_SAFE_NO_PAD.encode(signature.to_bytes()),
        }
    }
}

/// `POST /v1/token-request`: either `challenge` and `evidence`, or `credential`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRequestBody {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub challenge: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<Evidence>,
    /// The credential an earlier answer of the same window gave.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// base64url `TokenRequest`s of type 0x0002 (259 bytes each), 1 to 64.
    pub token_requests: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenResponseBody {
    /// base64url `TokenResponse`s (256 bytes each), in the order of the requests.
    pub token_responses: Vec<String>,
    /// Tokens this device may still ask for in the current window.
    pub remaining: u32,
    pub window_ends_at: crate::clock::Seconds,
    /// Present instead of evidence in this device's further requests of the window.
    pub credential: String,
}
