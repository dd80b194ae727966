//! The device side of key-set trust: the trust file a device is configured with, and the rule
//! that a public key is accepted only when at least T key services, among those the device was
//! configured to trust, have signed the same key entry.

use p256::ecdsa::VerifyingKey;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::keys::{DeviceKey, KeyState};
use crate::keyset::{KeySet, SignedPublicKey, decode_verifying_key, verify_key};
use crate::policy::DeviceLimits;

/// A key service a device trusts: its id and P-256 verifying key.
#[derive(Debug, Clone)]
pub struct TrustedKeyService {
    pub id: String,
    pub verifying_key: VerifyingKey,
}

impl TrustedKeyService {
    /// From the id and the base64url SEC1 point a key service publishes.
    pub fn new(id: &str, verifying_key: &str) -> Option<Self> {
        Some(Self {
            id: id.to_string(),
            verifying_key: decode_verifying_key(verifying_key)?,
        })
    }
}

// The device's trust file (`--trust`, docs/protocol.md "The device trust file").
/// Which key services a device trusts, how many must vouch for a key, and the loosest task
/// policy it contributes under.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustConfig {
    pub threshold: usize,
    pub keyservices: Vec<TrustedEntry>,
    /// n: how many key services hold a share of each task key. With `threshold` it fixes the
    /// release quorum a verifier asks for (`confed verify release`, the Python
    /// `verify_release`), whatever receipts claim. Absent: the number of key services listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<usize>,
    pub limits: DeviceLimits,
    /// The tenant the device works for, if it pins one: sent at check-in, and a policy of any
    /// other tenant is refused whatever the server assigns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// The token issuers the device accepts a task's `device_auth` from (`device_auth.rs`):
    /// a policy naming any other issuer or key is refused. Absent: no task requiring tokens is
    /// accepted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub token_issuers: Vec<TrustedIssuer>,
    /// Contribute only to masked tasks (docs/secure-aggregation.md): a policy without a
    /// `masking` line is refused, so the operator cannot serve this device's task in the clear.
    /// Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_masking: bool,
    /// Contribute only to masked tasks whose key services draw the noise (`noise=` in the
    /// `masking` line: docs/secure-aggregation.md, "Distributed noise"), so that not even a
    /// broken enclave holds the round's un-noised sum. The variance itself the key services
    /// check against the policy's budget. Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_distributed_noise: bool,
}

/// A token issuer a device trusts: its name and the token keys it may sign with.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustedIssuer {
    pub name: String,
    /// base64url DER SubjectPublicKeyInfo of each token key, as the issuer's directory lists it.
    pub token_keys: Vec<String>,
    /// Where the device obtains tokens (the issuer's base URL).
    pub url: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustedEntry {
    pub id: String,
    /// base64url SEC1 P-256 point, as the key service publishes in `GET /v1/keys`.
    pub verifying_key: String,
}

impl TrustConfig {
    /// n, the number of shares of each task key: `shares`, else the key services listed.
    pub fn shares(&self) -> usize {
        self.shares.unwrap_or(self.keyservices.len())
    }

    /// Whether the key set it pins is one: `1 <= threshold <= listed <= shares <= 65535` for the
    /// key services listed (a threshold above them can never be met; a smaller n would lower the
    /// release quorum below what the listed key services make).
    pub fn check(&self) -> Result<(), TrustFileError> {
        let (t, n, listed) = (self.threshold, self.shares(), self.keyservices.len());
        if t == 0 || t > n || t > listed || n < listed || n > usize::from(u16::MAX) {
            return Err(TrustFileError::KeySet {
                threshold: t,
                shares: n,
                listed,
            });
        }
        let mut names = std::collections::BTreeSet::new();
        if let Some(twice) = self
            .token_issuers
            .iter()
            .find(|i| !names.insert(i.name.as_str()))
        {
            return Err(TrustFileError::DuplicateIssuer(twice.name.clone()));
        }
        Ok(())
    }

    /// Refuses a policy whose `device_auth` names an issuer or a token key this trust file does
    /// not list; returns the trusted issuer to obtain tokens from, if the policy requires them.
    pub fn accept_device_auth(
        &self,
        policy: &crate::policy::TaskPolicy,
    ) -> Result<Option<&TrustedIssuer>, crate::policy::PolicyError> {
        accept_device_auth(&self.token_issuers, policy)
    }

    /// Refuses a masked policy unless it names exactly the `threshold` and `n` this file pins
    /// and every one of its key services is listed here and signed the masking key the policy
    /// gives it (so masking needs every key service listed); returns the masking keys to seal
    /// seeds to, service 1 first, or `None` for an unmasked policy.
    pub fn accept_masking(
        &self,
        policy: &crate::policy::TaskPolicy,
    ) -> Result<Option<Vec<crate::hpke::PublicKey>>, crate::policy::PolicyError> {
        let Some(masking) = &policy.masking else {
            if self.require_masking || self.require_distributed_noise {
                let flag = match self.require_masking {
                    true => "require_masking",
                    false => "require_distributed_noise",
                };
                return Err(crate::policy::PolicyError::Limits(format!(
                    "the task does not mask its updates, and this device's trust file requires masking ({flag})"
                )));
            }
            return Ok(None);
        };
        let refuse = |why: String| crate::policy::PolicyError::Limits(why);
        if self.require_distributed_noise && masking.noise_variance.is_none() {
            return Err(refuse(
                "the task's key services do not draw its noise, and this device's trust file requires distributed noise (require_distributed_noise)".into(),
            ));
        }
        if usize::from(masking.threshold) != self.threshold
            || masking.services.len() != self.shares()
        {
            return Err(refuse(format!(
                "the task masks with {} of {} key services; this device's trust file pins {} of {}",
                masking.threshold,
                masking.services.len(),
                self.threshold,
                self.shares()
            )));
        }
        for service in &masking.services {
            let listed = self
                .keyservices
                .iter()
                .find(|k| k.id == service.keyservice_id)
                .ok_or_else(|| {
                    refuse(format!(
                        "the task seals mask seeds to key service {}, which this device's trust file does not list",
                        service.keyservice_id
                    ))
                })?;
            // The policy's verifying key must be the one this device trusts (the key services
            // check each other's receipts with it), and the masking key signed under it.
            let same_key = decode_verifying_key(&listed.verifying_key)
                .zip(decode_verifying_key(&service.verifying_key))
                .is_some_and(|(listed, named)| listed == named);
            if !(same_key && service.signed()) {
                return Err(refuse(format!(
                    "the task's masking key for key service {} is not signed by it",
                    service.keyservice_id
                )));
            }
        }
        Ok(Some(masking.public_keys()))
    }

    /// The key services as the signature checks take them; refused if a verifying key is not a
    /// P-256 point.
    pub fn trusted(&self) -> Result<Vec<TrustedKeyService>, TrustFileError> {
        self.keyservices
            .iter()
            .map(|k| {
                TrustedKeyService::new(&k.id, &k.verifying_key)
                    .ok_or_else(|| TrustFileError::VerifyingKey(k.id.clone()))
            })
            .collect()
    }
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TrustFileError {
    #[error("token issuer {0} is listed twice; list each issuer once, with all its keys")]
    DuplicateIssuer(String),
    #[error("key service {0}: verifying_key is not a base64url SEC1 P-256 point")]
    VerifyingKey(String),
    #[error(
        "threshold {threshold} of {shares} shares with {listed} key services listed: the threshold must be between 1 and the key services listed, and shares between the key services listed and 65535"
    )]
    KeySet {
        threshold: usize,
        shares: usize,
        listed: usize,
    },
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TrustError {
    #[error(
        "no active key is signed by {threshold} trusted key services (best: {best} signatures)"
    )]
    NotEnoughSignatures { threshold: usize, best: usize },
}

/// The active key (latest `not_before` first) that at least `threshold` trusted key services signed
/// identically. Key sets from unknown key services and bad signatures are ignored.
pub fn accept_public_key(
    key_sets: &[KeySet],
    trusted: &[TrustedKeyService],
    threshold: usize,
    now: i64,
) -> Result<SignedPublicKey, TrustError> {
    let mut candidates: Vec<(SignedPublicKey, Vec<&str>)> = Vec::new();
    for set in key_sets {
        let Some(service) = trusted.iter().find(|t| t.id == set.keyservice_id) else {
            continue;
        };
        for key in &set.keys {
            if KeyState::at(key.not_before, key.not_after, now) != KeyState::Active
                || !verify_key(&service.verifying_key, &service.id, key)
            {
                continue;
            }
            let same = |c: &SignedPublicKey| {
                c.key_id == key.key_id
                    && c.public_key == key.public_key
                    && c.suite == key.suite
                    && (c.not_before, c.not_after, c.threshold, c.shares)
                        == (key.not_before, key.not_after, key.threshold, key.shares)
            };
            match candidates.iter_mut().find(|(c, _)| same(c)) {
                Some((_, signers)) if !signers.contains(&service.id.as_str()) => {
                    signers.push(&service.id)
                }
                Some(_) => {}
                None => candidates.push((key.clone(), vec![&service.id])),
            }
        }
    }
    let best = candidates.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    candidates
        .into_iter()
        .filter(|(_, signers)| signers.len() >= threshold)
        .max_by_key(|(key, _)| key.not_before)
        .map(|(key, _)| key)
        .ok_or(TrustError::NotEnoughSignatures { threshold, best })
}

/// Checks a key handed out in an assignment: T trusted signatures, active now. Returns the X25519
/// public key to encrypt to.
pub fn accept_device_key(
    key: &DeviceKey,
    trusted: &[TrustedKeyService],
    threshold: usize,
    now: i64,
) -> Result<crate::hpke::PublicKey, TrustError> {
    use base64::Engine as _;
    let accepted = accept_public_key(&key.signed_entries(), trusted, threshold, now)?;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(&accepted.public_key)
        .ok()
        .and_then(|bytes| crate::hpke::PublicKey::from_bytes(&bytes).ok())
        .ok_or(TrustError::NotEnoughSignatures { threshold, best: 0 })
}

/// Refuses a policy whose `device_auth` names an issuer or a token key not among `issuers` (a
/// trust file's `token_issuers`); returns the issuer to obtain tokens from, if the policy requires
/// them.
pub fn accept_device_auth<'a>(
    issuers: &'a [TrustedIssuer],
    policy: &crate::policy::TaskPolicy,
) -> Result<Option<&'a TrustedIssuer>, crate::policy::PolicyError> {
    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let Some(auth) = &policy.device_auth else {
        return Ok(None);
    };
    let refuse = |why: String| crate::policy::PolicyError::Limits(why);
    let issuer = issuers
            .iter()
            .find(|i| i.name == auth.issuer)
            .ok_or_else(|| {
                refuse(format!(
                    "the task requires tokens of issuer {}, which this device's trust file does not list (token_issuers)",
                    auth.issuer
                ))
            })?;
    for key in &auth.token_keys {
        let listed = issuer
            .token_keys
            .iter()
            .any(|k| URL_SAFE_NO_PAD.decode(k).is_ok_and(|k| &k == key));
        if !listed {
            return Err(refuse(format!(
                "the task names a token key of issuer {} that this device's trust file does not list",
                auth.issuer
            )));
        }
    }
    Ok(Some(issuer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trust(threshold: usize, listed: usize, shares: Option<usize>) -> TrustConfig {
        TrustConfig {
            threshold,
            keyservices: (0..listed)
                .map(|i| TrustedEntry {
                    id: format!("ks{i}"),
                    verifying_key: String::new(),
                })
                .collect(),
            shares,
            limits: DeviceLimits::ENCLAVE,
            tenant_id: None,
            token_issuers: Vec::new(),
            require_masking: false,
            require_distributed_noise: false,
        }
    }

    #[test]
    fn a_trust_file_pins_a_key_set_that_can_be() {
        assert!(trust(2, 3, None).check().is_ok());
        assert_eq!(trust(2, 3, None).shares(), 3);
        assert!(
            trust(2, 3, Some(5)).check().is_ok(),
            "n may exceed the services listed"
        );
        for (t, listed, n) in [
            (0, 3, None),
            (4, 3, None),
            (3, 2, Some(3)),
            (2, 3, Some(2)),
            (2, 3, Some(70_000)),
        ] {
            assert!(
                matches!(
                    trust(t, listed, n).check(),
                    Err(TrustFileError::KeySet { .. })
                ),
                "t={t} listed={listed} n={n:?}"
            );
        }
    }

    #[test]
    fn a_policy_naming_an_issuer_or_key_the_trust_file_lacks_is_refused() {
        use base64::Engine as _;
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let key = crate::device_auth::tests::vector_key();
        let mut policy = crate::policy::TaskPolicy::sample("t", 1);
        let listed = TrustedIssuer {
            name: "issuer.example".into(),
            token_keys: vec![URL_SAFE_NO_PAD.encode(&key)],
            url: "https://issuer.example".into(),
        };
        assert!(matches!(accept_device_auth(&[], &policy), Ok(None)));
        policy.device_auth =
            Some(crate::device_auth::DeviceAuth::new("issuer.example", vec![key.clone()]).unwrap());
        let accepted = accept_device_auth(std::slice::from_ref(&listed), &policy).unwrap();
        assert_eq!(accepted.unwrap().url, "https://issuer.example");
        assert!(
            accept_device_auth(&[], &policy)
                .unwrap_err()
                .to_string()
                .contains("does not list")
        );
        let other_key = TrustedIssuer {
            token_keys: vec![URL_SAFE_NO_PAD.encode(&key[..key.len() - 1])],
            ..listed.clone()
        };
        assert!(accept_device_auth(&[other_key], &policy).is_err());
        let other_name = TrustedIssuer {
            name: "other".into(),
            ..listed
        };
        assert!(accept_device_auth(&[other_name], &policy).is_err());
    }
}
