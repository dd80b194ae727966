//! JSON Web Keys (RFC 7517) for verifying attestation tokens: RSA keys (Google) and P-256 keys
//! (the dev attester). Keys of any other type are skipped when a set is loaded.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum JwkError {
    #[error("JWKS is not valid JSON of the form {{\"keys\": [...]}}: {0}")]
    Json(String),
    #[error("key `{kid}`: {reason}")]
    Key { kid: String, reason: String },
}

/// One verification key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Jwk {
    Rsa {
        kid: String,
        n: Vec<u8>,
        e: Vec<u8>,
    },
    P256 {
        kid: String,
        key: p256::ecdsa::VerifyingKey,
    },
}

impl Jwk {
    pub fn kid(&self) -> &str {
        match self {
            Self::Rsa { kid, .. } | Self::P256 { kid, .. } => kid,
        }
    }
}

/// A key set, looked up by `kid`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Jwks {
    keys: Vec<Jwk>,
}

#[derive(Deserialize)]
struct RawSet {
    keys: Vec<RawKey>,
}

#[derive(Deserialize)]
struct RawKey {
    kty: String,
    kid: Option<String>,
    #[serde(rename = "use")]
    key_use: Option<String>,
    n: Option<String>,
    e: Option<String>,
    crv: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

fn b64(kid: &str, field: &str, value: Option<&String>) -> Result<Vec<u8>, JwkError> {
    let value = value.ok_or_else(|| JwkError::Key {
        kid: kid.into(),
        reason: format!("missing `{field}`"),
    })?;
    URL_SAFE_NO_PAD.decode(value).map_err(|_| JwkError::Key {
        kid: kid.into(),
        reason: format!("`{field}` is not base64url"),
    })
}

impl Jwks {
    pub fn new(keys: Vec<Jwk>) -> Self {
        Self { keys }
    }

    /// Parses a JWKS document. Keys without `kid`, for encryption, or of other types are skipped;
    /// a malformed RSA or P-256 key is an error.
    pub fn from_json(text: &str) -> Result<Self, JwkError> {
        let raw: RawSet = serde_json::from_str(text).map_err(|e| JwkError::Json(e.to_string()))?;
        let mut keys = Vec::new();
        for key in raw.keys {
            let Some(kid) = key.kid.clone() else { continue };
            if key.key_use.as_deref().is_some_and(|u| u != "sig") {
                continue;
            }
            match key.kty.as_str() {
                "RSA" => keys.push(Jwk::Rsa {
                    n: b64(&kid, "n", key.n.as_ref())?,
                    e: b64(&kid, "e", key.e.as_ref())?,
                    kid,
                }),
                "EC" if key.crv.as_deref() == Some("P-256") => {
                    let mut point = vec![0x04];
                    point.extend(b64(&kid, "x", key.x.as_ref())?);
                    point.extend(b64(&kid, "y", key.y.as_ref())?);
                    let verifying =
                        p256::ecdsa::VerifyingKey::from_sec1_bytes(&point).map_err(|_| {
                            JwkError::Key {
                                kid: kid.clone(),
                                reason: "`x`/`y` is not a point on P-256".into(),
                            }
                        })?;
                    keys.push(Jwk::P256 {
                        kid,
                        key: verifying,
                    });
                }
                _ => {}
            }
        }
        Ok(Self { keys })
    }

    pub fn get(&self, kid: &str) -> Option<&Jwk> {
        self.keys.iter().find(|k| k.kid() == kid)
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// The public JWK (JSON) of a P-256 key, as published by the dev attester.
pub fn p256_public_jwk(kid: &str, key: &p256::ecdsa::VerifyingKey) -> serde_json::Value {
    let point = key.to_sec1_point(false);
    let bytes = point.as_bytes();
    serde_json::json!({
        "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
        "x": URL_SAFE_NO_PAD.encode(&bytes[1..33]),
        "y": URL_SAFE_NO_PAD.encode(&bytes[33..65]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_rsa_and_p256_and_skips_others() {
        let text = r#"{"keys": [
            {"kty": "RSA", "kid": "r1", "use": "sig", "n": "AQAB", "e": "AQAB"},
            {"kty": "oct", "kid": "h1", "k": "c2VjcmV0"},
            {"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"},
            {"kty": "RSA", "n": "AQAB", "e": "AQAB"}
        ]}"#;
        let jwks = Jwks::from_json(text).unwrap();
        assert!(jwks.get("r1").is_some());
        assert!(jwks.get("h1").is_none(), "symmetric keys are never loaded");
        assert!(jwks.get("enc").is_none());
    }

    #[test]
    fn bad_points_and_json_are_errors() {
        let bad_point =
            r#"{"keys": [{"kty": "EC", "crv": "P-256", "kid": "e1", "x": "AAAA", "y": "AAAA"}]}"#;
        assert!(matches!(
            Jwks::from_json(bad_point),
            Err(JwkError::Key { .. })
        ));
        assert!(matches!(Jwks::from_json("[]"), Err(JwkError::Json(_))));
    }
}
