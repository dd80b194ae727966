//! A task policy's device-authentication requirement (`device_auth=` line, `policy.rs`): the
//! issuer whose tokens a contribution must carry, and its token keys. Devices check the issuer
//! against their trust file before sealing; the front end and the enclave verify every
//! contribution's token against exactly these keys (`docs/protocol.md`, "Device tokens").
//!
//! ```text
//! device_auth=privacy_pass;issuer=<name>;token_keys=<base64url SPKI>[,<base64url SPKI>...]
//! ```
//!
//! At most four keys (an issuer rotating its key lists the old and the new one); each is the DER
//! SubjectPublicKeyInfo (RSASSA-PSS) of a type 0x0002 key, base64url without padding.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use thiserror::Error;

use crate::privacy_pass::context::{encoded_round_challenge, token_nonce};
use crate::privacy_pass::{IssuerKey, Token, TokenError};

pub const PRIVACY_PASS: &str = "privacy_pass";
pub const MAX_TOKEN_KEYS: usize = 4;

/// Why a contribution's token does not authenticate it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TokenRefusal {
    #[error(
        "the task requires a device token (Privacy Pass, issuer {0}) in the envelope's `token`; obtain one for this assignment from the issuer"
    )]
    Missing(String),
    #[error("the envelope's token is malformed: {0}")]
    Malformed(TokenError),
    #[error("the token was issued under a key the task policy does not name")]
    UnknownKey,
    #[error(
        "the token does not bind this envelope (its nonce is not SHA-256 of the envelope's `enc`)"
    )]
    NotBound,
    #[error(
        "the token was issued for another challenge (another task, round, assignment or issuer)"
    )]
    Challenge,
    #[error("the token's signature does not verify under the issuer's key")]
    Signature,
}

impl TokenRefusal {
    /// A short name for metrics labels.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing(_) => "missing",
            Self::Malformed(_) => "malformed",
            Self::UnknownKey => "unknown_key",
            Self::NotBound => "not_bound",
            Self::Challenge => "challenge",
            Self::Signature => "signature",
        }
    }
}

#[derive(Debug, Clone)]
pub struct DeviceAuth {
    pub issuer: String,
    /// DER SubjectPublicKeyInfo of each token key, in the order the policy lists them.
    pub token_keys: Vec<Vec<u8>>,
    keys: Vec<IssuerKey>,
}

impl PartialEq for DeviceAuth {
    fn eq(&self, other: &Self) -> bool {
        self.issuer == other.issuer && self.token_keys == other.token_keys
    }
}

fn valid_issuer(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl DeviceAuth {
    /// A requirement of tokens from `issuer` under `token_keys` (DER SPKIs).
    pub fn new(issuer: &str, token_keys: Vec<Vec<u8>>) -> Result<Self, String> {
        if !valid_issuer(issuer) {
            return Err("the issuer name must be 1-128 of A-Z a-z 0-9 . _ -".into());
        }
        if !(1..=MAX_TOKEN_KEYS).contains(&token_keys.len()) {
            return Err(format!("give 1 to {MAX_TOKEN_KEYS} token keys"));
        }
        let keys = token_keys
            .iter()
            .enumerate()
            .map(|(i, spki)| {
                IssuerKey::from_spki(spki).map_err(|e| format!("token key {}: {e}", i + 1))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            issuer: issuer.to_string(),
            token_keys,
            keys,
        })
    }

    /// The value of the `device_auth=` line.
    pub fn encode(&self) -> String {
        let keys: Vec<String> = self
            .token_keys
            .iter()
            .map(|k| URL_SAFE_NO_PAD.encode(k))
            .collect();
        format!(
            "{PRIVACY_PASS};issuer={};token_keys={}",
            self.issuer,
            keys.join(",")
        )
    }

    /// Parses the value of a `device_auth=` line.
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut parts = value.split(';');
        if parts.next() != Some(PRIVACY_PASS) {
            return Err(format!("`device_auth` must start with `{PRIVACY_PASS};`"));
        }
        let issuer = parts
            .next()
            .and_then(|p| p.strip_prefix("issuer="))
            .ok_or("`device_auth` needs `issuer=<name>` after `privacy_pass;`")?;
        let keys = parts
            .next()
            .and_then(|p| p.strip_prefix("token_keys="))
            .ok_or("`device_auth` needs `token_keys=<base64url SPKI>,...` after the issuer")?;
        if parts.next().is_some() {
            return Err("`device_auth` has fields after `token_keys`".into());
        }
        let token_keys = keys
            .split(',')
            .map(|k| {
                URL_SAFE_NO_PAD
                    .decode(k)
                    .map_err(|_| "a token key is not base64url without padding".to_string())
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(issuer, token_keys)
    }

    /// The issuer keys, as origins verify with them.
    pub fn issuer_keys(&self) -> &[IssuerKey] {
        &self.keys
    }

    /// Checks that `token` (the envelope's) authenticates the contribution with encapsulated key
    /// `enc` for `assignment_ref` of `round` of `task_id`.
    pub fn verify(
        &self,
        token: Option<&[u8]>,
        enc: &[u8],
        task_id: &str,
        round: u64,
        assignment_ref: &str,
    ) -> Result<(), TokenRefusal> {
        self.verify_nonce(token, &token_nonce(enc), task_id, round, assignment_ref)
    }

    /// `verify` for a token whose nonce must be `nonce`: a masked contribution's binds its
    /// sealed seeds too (`envelope::masked_nonce_of`).
    pub fn verify_nonce(
        &self,
        token: Option<&[u8]>,
        nonce: &[u8; 32],
        task_id: &str,
        round: u64,
        assignment_ref: &str,
    ) -> Result<(), TokenRefusal> {
        let bytes = token.ok_or_else(|| TokenRefusal::Missing(self.issuer.clone()))?;
        let token = Token::decode(bytes).map_err(TokenRefusal::Malformed)?;
        let key = self
            .keys
            .iter()
            .find(|k| k.token_key_id == token.token_key_id)
            .ok_or(TokenRefusal::UnknownKey)?;
        if token.nonce != *nonce {
            return Err(TokenRefusal::NotBound);
        }
        let challenge = encoded_round_challenge(&self.issuer, task_id, round, assignment_ref)
            .map_err(TokenRefusal::Malformed)?;
        key.verify(&token, &challenge).map_err(|e| match e {
            TokenError::Challenge => TokenRefusal::Challenge,
            TokenError::KeyId => TokenRefusal::UnknownKey,
            _ => TokenRefusal::Signature,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn vector_key() -> Vec<u8> {
        let cases: Vec<std::collections::BTreeMap<String, String>> =
            serde_json::from_str(include_str!("../testdata/privacy_pass_type2_vectors.json"))
                .unwrap();
        crate::hex::decode(&cases[0]["pkS"]).unwrap()
    }

    #[test]
    fn the_line_round_trips_and_malformed_lines_say_what_is_wrong() {
        let auth = DeviceAuth::new("issuer.example", vec![vector_key()]).unwrap();
        let line = auth.encode();
        assert!(line.starts_with("privacy_pass;issuer=issuer.example;token_keys=MIIB"));
        assert_eq!(DeviceAuth::parse(&line).unwrap(), auth);
        for (bad, words) in [
            ("tokens;issuer=a;token_keys=x", "must start"),
            ("privacy_pass;token_keys=x", "issuer="),
            ("privacy_pass;issuer=a b;token_keys=AAAA", "issuer name"),
            ("privacy_pass;issuer=a;token_keys=!!", "base64url"),
            ("privacy_pass;issuer=a;token_keys=AAAA", "token key 1"),
            ("privacy_pass;issuer=a;token_keys=AAAA;x=y", "after"),
        ] {
            let error = DeviceAuth::parse(bad).unwrap_err();
            assert!(error.contains(words), "{bad}: {error}");
        }
        let five = vec![vector_key(); 5];
        assert!(DeviceAuth::new("a", five).unwrap_err().contains("1 to 4"));
    }

    /// A token obtained for one envelope authenticates it for its task, round and assignment
    /// only; the same token on an envelope the operator sealed itself does not.
    #[cfg(feature = "privacy-pass")]
    #[test]
    fn a_token_authenticates_only_its_own_envelope_for_its_assignment_round_and_task() {
        use crate::envelope::{self, RoundContext};
        use crate::hpke_ephemeral::Ephemeral;
        use crate::ids::Capability;
        use crate::privacy_pass::issuance::{TokenClient, TokenSigner};
        let cases: Vec<std::collections::BTreeMap<String, String>> =
            serde_json::from_str(include_str!("../testdata/privacy_pass_type2_vectors.json"))
                .unwrap();
        let signer = TokenSigner::from_pem(&cases[0]["skS_pem"]).unwrap();
        let client = TokenClient::from_spki(signer.spki()).unwrap();
        let auth = DeviceAuth::new("issuer.example", vec![signer.spki().to_vec()]).unwrap();
        let (_, public) = crate::hpke::generate_keypair();
        let capability = Capability::new("assignment-one");
        let assignment_ref = capability.reference();
        let context = RoundContext {
            task_id: "task-1".into(),
            round: 2,
            policy_sha256: "p".into(),
            model_sha256: "m".into(),
        };
        let ephemeral = Ephemeral::generate().unwrap();
        let challenge =
            encoded_round_challenge("issuer.example", "task-1", 2, assignment_ref.as_str())
                .unwrap();
        let nonce = token_nonce(ephemeral.encapsulated_key());
        let (request, pending) = client.begin_with_nonce(&challenge, nonce).unwrap();
        let token = client
            .finish(pending, &signer.sign(&request).unwrap())
            .unwrap();
        let sealed =
            envelope::seal_with_token(ephemeral, &token, &public, "k", &context, &capability, b"u")
                .unwrap();
        let parsed = envelope::Envelope::from_cbor(&sealed.to_cbor()).unwrap();
        let check = |token: Option<&[u8]>, enc: &[u8], task: &str, round: u64, r: &str| {
            auth.verify(token, enc, task, round, r)
        };
        let (t, enc, r) = (
            parsed.token.as_deref(),
            parsed.encapsulated_key.as_slice(),
            assignment_ref.as_str(),
        );
        assert_eq!(check(t, enc, "task-1", 2, r), Ok(()));
        let other_ref = Capability::new("assignment-two").reference();
        for (task, round, r) in [
            ("task-1", 3, r),
            ("task-2", 2, r),
            ("task-1", 2, other_ref.as_str()),
        ] {
            assert_eq!(check(t, enc, task, round, r), Err(TokenRefusal::Challenge));
        }
        // The operator's own envelope for the same assignment, carrying the stolen token.
        let own = envelope::seal(&public, "k", &context, &capability, b"mine").unwrap();
        assert_eq!(
            check(t, &own.encapsulated_key, "task-1", 2, r),
            Err(TokenRefusal::NotBound)
        );
        assert_eq!(
            check(None, enc, "task-1", 2, r),
            Err(TokenRefusal::Missing("issuer.example".into()))
        );
        let mut forged = token.clone();
        forged.authenticator[5] ^= 1;
        assert_eq!(
            check(Some(&forged.encode()), enc, "task-1", 2, r),
            Err(TokenRefusal::Signature)
        );
        let mut foreign = token.clone();
        foreign.token_key_id[0] ^= 1;
        assert_eq!(
            check(Some(&foreign.encode()), enc, "task-1", 2, r),
            Err(TokenRefusal::UnknownKey)
        );
        assert!(matches!(
            check(Some(&[0u8; 10]), enc, "task-1", 2, r),
            Err(TokenRefusal::Malformed(_))
        ));
        // A token whose nonce binds another key is not sealed at all.
        let mismatched = Ephemeral::generate().unwrap();
        assert!(
            envelope::seal_with_token(
                mismatched,
                &token,
                &public,
                "k",
                &context,
                &capability,
                b"u"
            )
            .is_err()
        );
    }
}
