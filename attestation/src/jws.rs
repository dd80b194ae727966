//! JWS compact serialization (RFC 7515) as used by attestation tokens: parsing, and signature
//! verification with the algorithm the *policy* names. The token header's `alg` is reported, never
//! obeyed: there is no code path that picks a verification algorithm from the token.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;
use thiserror::Error;

use crate::jwk::Jwk;

/// Tokens longer than this are refused before any decoding (Confidential Space tokens are ~2 KB).
pub const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// Signature algorithms a policy may name. `none` and HMAC algorithms are not representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
pub enum Algorithm {
    /// RSASSA-PKCS1-v1_5 with SHA-256, 2048-8192-bit keys (Google's Confidential Space tokens).
    RS256,
    /// ECDSA P-256 with SHA-256 (the dev attester).
    ES256,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::RS256 => "RS256",
            Self::ES256 => "ES256",
        }
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum JwsError {
    #[error("token is larger than {MAX_TOKEN_BYTES} bytes")]
    TooLarge,
    #[error("token is not three base64url parts separated by '.'")]
    Shape,
    #[error("token {0} is not valid base64url")]
    Base64(&'static str),
    #[error("token header is not a JSON object with a string `alg`: {0}")]
    Header(String),
    #[error("token payload is not a JSON object: {0}")]
    Payload(String),
}

/// The protected header fields confed reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Header {
    pub alg: String,
    #[serde(default)]
    pub kid: Option<String>,
    #[serde(default)]
    pub typ: Option<String>,
    /// Extensions the verifier must understand (RFC 7515 4.1.11). confed understands none, so
    /// any `crit` refuses the token.
    #[serde(default)]
    pub crit: Option<serde_json::Value>,
}

/// A parsed, not yet verified, token.
#[derive(Debug, Clone)]
pub struct UnverifiedJws {
    pub header: Header,
    /// The payload as JSON; claims are read from it only after appraisal decides.
    pub payload: serde_json::Value,
    signing_input: String,
    signature: Vec<u8>,
}

/// Splits and decodes a compact JWS. Never panics, whatever the input.
pub fn parse(token: &str) -> Result<UnverifiedJws, JwsError> {
    if token.len() > MAX_TOKEN_BYTES {
        return Err(JwsError::TooLarge);
    }
    let mut parts = token.split('.');
    let (Some(header_b64), Some(payload_b64), Some(signature_b64), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwsError::Shape);
    };
    let header_bytes = URL_SAFE_NO_PAD
        .decode(header_b64)
        .map_err(|_| JwsError::Base64("header"))?;
    let payload_bytes = URL_SAFE_NO_PAD
        .decode(payload_b64)
        .map_err(|_| JwsError::Base64("payload"))?;
    let signature = URL_SAFE_NO_PAD
        .decode(signature_b64)
        .map_err(|_| JwsError::Base64("signature"))?;
    // Duplicate member names are refused, not resolved last-wins: a token whose header or claims
    // read differently to two parsers is not one this verifier appraises.
    crate::strict_json::reject_duplicate_keys(&header_bytes).map_err(JwsError::Header)?;
    crate::strict_json::reject_duplicate_keys(&payload_bytes).map_err(JwsError::Payload)?;
    let header: Header =
        serde_json::from_slice(&header_bytes).map_err(|e| JwsError::Header(e.to_string()))?;
    // Present at all, whatever its value: `"crit": null` deserializes as no `crit`, and a
    // header that names it is one this verifier must refuse.
    let names_crit =
        serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&header_bytes)
            .map_err(|e| JwsError::Header(e.to_string()))?
            .contains_key("crit");
    if names_crit || header.crit.is_some() {
        return Err(JwsError::Header(
            "`crit` names extensions this verifier does not understand (RFC 7515 4.1.11)".into(),
        ));
    }
    let payload: serde_json::Value =
        serde_json::from_slice(&payload_bytes).map_err(|e| JwsError::Payload(e.to_string()))?;
    if !payload.is_object() {
        return Err(JwsError::Payload("not an object".into()));
    }
    Ok(UnverifiedJws {
        header,
        payload,
        signing_input: format!("{header_b64}.{payload_b64}"),
        signature,
    })
}

impl UnverifiedJws {
    /// Verifies the signature with `algorithm` (from the policy) and `key`.
    pub fn verify_signature(&self, algorithm: Algorithm, key: &Jwk) -> Result<(), String> {
        let message = self.signing_input.as_bytes();
        match (algorithm, key) {
            (Algorithm::RS256, Jwk::Rsa { n, e, .. }) => {
                let public = ring::signature::RsaPublicKeyComponents { n, e };
                public
                    .verify(
                        &ring::signature::RSA_PKCS1_2048_8192_SHA256,
                        message,
                        &self.signature,
                    )
                    .map_err(|_| "RS256 signature does not verify with the policy's key".into())
            }
            (Algorithm::ES256, Jwk::P256 { key: verifying, .. }) => {
                use p256::ecdsa::signature::Verifier;
                let signature = p256::ecdsa::Signature::from_slice(&self.signature)
                    .map_err(|_| "ES256 signature is not 64 bytes r||s".to_string())?;
                verifying
                    .verify(message, &signature)
                    .map_err(|_| "ES256 signature does not verify with the policy's key".into())
            }
            (algorithm, key) => Err(format!(
                "the policy's key `{}` is not a key for {}",
                key.kid(),
                algorithm.as_str()
            )),
        }
    }
}

/// Builds a compact JWS from a header, payload and a signing function (dev attester and tests).
pub fn encode(
    header: &serde_json::Value,
    payload: &serde_json::Value,
    sign: impl FnOnce(&[u8]) -> Vec<u8>,
) -> String {
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(payload.to_string())
    );
    let signature = sign(signing_input.as_bytes());
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_tokens_are_refused_without_panicking() {
        let cases = [
            ("", JwsError::Shape),
            ("a.b", JwsError::Shape),
            ("a.b.c.d", JwsError::Shape),
            ("!!.e30.", JwsError::Base64("header")),
            ("e30.!!.", JwsError::Base64("payload")),
            ("e30.e30.!!", JwsError::Base64("signature")),
        ];
        for (token, expected) in cases {
            assert_eq!(parse(token).unwrap_err(), expected, "{token:?}");
        }
        // `{}` has no alg.
        assert!(matches!(parse("e30.e30."), Err(JwsError::Header(_))));
        // payload `[]` is not an object.
        let header = URL_SAFE_NO_PAD.encode(r#"{"alg":"RS256"}"#);
        assert!(matches!(
            parse(&format!("{header}.W10.")),
            Err(JwsError::Payload(_))
        ));
        assert_eq!(
            parse(&"a".repeat(MAX_TOKEN_BYTES + 1)).unwrap_err(),
            JwsError::TooLarge
        );
    }

    #[test]
    fn parse_reads_header_and_payload() {
        let token = encode(
            &serde_json::json!({"alg": "ES256", "kid": "k1", "typ": "JWT"}),
            &serde_json::json!({"iss": "x"}),
            |_| vec![1, 2, 3],
        );
        let jws = parse(&token).unwrap();
        assert_eq!(jws.header.alg, "ES256");
        assert_eq!(jws.header.kid.as_deref(), Some("k1"));
        assert_eq!(jws.payload["iss"], "x");
        assert_eq!(jws.signature, vec![1, 2, 3]);
    }
}
