//! API tokens for partners (tenants) and the operator's admin token.
//!
//! A tenant token is `cft_<token id>_<secret>`: the id (64 random bits, hex) finds the tenant's row,
//! and the secret (256 random bits, base64url) is checked against the SHA-256 stored there in
//! constant time. The token itself is shown once and never stored.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::hex::sha256_hex;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use thiserror::Error;
use zeroize::{Zeroize, Zeroizing};

const TOKEN_PREFIX: &str = "cft";
/// Shortest admin token accepted: 32 characters of a random token carry well over 128 bits.
pub const MIN_ADMIN_TOKEN_LEN: usize = 32;

#[derive(Debug, Error)]
pub enum AuthError {
    #[error("the operating system's random number generator failed: {0}")]
    Random(String),
    #[error(
        "the admin token is {0} characters; use at least {MIN_ADMIN_TOKEN_LEN} random characters (e.g. `openssl rand -hex 32`)"
    )]
    AdminTokenTooShort(usize),
}

/// A newly issued tenant token: `token` goes to the partner once; the rest goes to the database.
pub struct IssuedToken {
    pub token: Zeroizing<String>,
    pub token_id: String,
    pub secret_sha256_hex: String,
}

impl std::fmt::Debug for IssuedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IssuedToken")
            .field("token_id", &self.token_id)
            .finish_non_exhaustive()
    }
}

pub fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(bytes)
}

pub fn issue_tenant_token() -> Result<IssuedToken, AuthError> {
    let id_bytes = random_bytes::<8>()?;
    let mut secret = Zeroizing::new(random_bytes::<32>()?);
    let secret_b64 = Zeroizing::new(URL_SAFE_NO_PAD.encode(secret.as_slice()));
    secret.zeroize();
    let token_id = confed_protocol::hex::encode(id_bytes);
    let token = Zeroizing::new(format!("{TOKEN_PREFIX}_{token_id}_{}", secret_b64.as_str()));
    Ok(IssuedToken {
        secret_sha256_hex: sha256_hex(secret_b64.as_bytes()),
        token,
        token_id,
    })
}

/// Splits a presented tenant token into (token id, secret); `None` if it is not shaped like one.
pub fn split_tenant_token(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?.strip_prefix('_')?;
    let (id, secret) = rest.split_once('_')?;
    let id_ok = id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit());
    (id_ok && !secret.is_empty()).then_some((id, secret))
}

/// Whether `secret` hashes to the stored hex digest, compared in constant time.
pub fn secret_matches(secret: &str, stored_sha256_hex: &str) -> bool {
    let presented: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    let stored = decode_hex32(stored_sha256_hex).unwrap_or([0u8; 32]);
    bool::from(presented.ct_eq(&stored))
}

/// The operator's admin token, held only as its SHA-256 so the token itself is not kept in memory.
#[derive(Clone)]
pub struct AdminToken([u8; 32]);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// Takes the configured token (from the environment or a file), checks its length, keeps its
    /// hash and wipes the text.
    pub fn from_secret(mut secret: String) -> Result<Self, AuthError> {
        let trimmed_len = secret.trim().len();
        let result = if trimmed_len < MIN_ADMIN_TOKEN_LEN {
            Err(AuthError::AdminTokenTooShort(trimmed_len))
        } else {
            Ok(Self(Sha256::digest(secret.trim().as_bytes()).into()))
        };
        secret.zeroize();
        result
    }

    /// Hashing first makes the comparison independent of the presented token's length.
    pub fn matches(&self, presented: &str) -> bool {
        let presented: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        bool::from(presented.ct_eq(&self.0))
    }
}

fn decode_hex32(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_token_verifies_and_a_changed_one_does_not() {
        let issued = issue_tenant_token().unwrap();
        let (id, secret) = split_tenant_token(&issued.token).unwrap();
        assert_eq!(id, issued.token_id);
        assert!(secret_matches(secret, &issued.secret_sha256_hex));
        let mut wrong = secret.to_string();
        wrong.replace_range(0..1, if wrong.starts_with('A') { "B" } else { "A" });
        assert!(!secret_matches(&wrong, &issued.secret_sha256_hex));
    }

    #[test]
    fn tokens_carry_256_bit_secrets_and_differ() {
        let a = issue_tenant_token().unwrap();
        let b = issue_tenant_token().unwrap();
        assert_ne!(a.token.as_str(), b.token.as_str());
        let (_, secret) = split_tenant_token(&a.token).unwrap();
        assert_eq!(URL_SAFE_NO_PAD.decode(secret).unwrap().len(), 32);
    }

    #[test]
    fn malformed_tokens_do_not_split() {
        for bad in [
            "",
            "cft",
            "cft_",
            "xyz_0123456789abcdef_secret",
            "cft_short_secret",
            "cft_0123456789abcdef_",
            "cft_0123456789abcdeg_secret",
        ] {
            assert_eq!(split_tenant_token(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn corrupt_stored_hash_never_matches() {
        assert!(!secret_matches("anything", "not-hex"));
        assert!(!secret_matches("anything", ""));
    }

    #[test]
    fn admin_token_needs_length_and_matches_exactly() {
        assert!(matches!(
            AdminToken::from_secret("short".into()),
            Err(AuthError::AdminTokenTooShort(5))
        ));
        let token = "a".repeat(40);
        let admin = AdminToken::from_secret(format!("{token}\n")).unwrap();
        assert!(admin.matches(&token));
        assert!(!admin.matches(&"a".repeat(39)));
        assert!(!format!("{admin:?}").contains('a'.to_string().repeat(5).as_str()));
    }
}
