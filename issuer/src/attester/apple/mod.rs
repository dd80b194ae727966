//! The Apple App Attest attester. An iOS app makes a key in the Secure Enclave
//! (`DCAppAttestService.generateKey`), has Apple attest it once (`attestKey`), and from then on
//! signs assertions with it (`generateAssertion`). Both are made over a `clientDataHash` that
//! binds the issuer's challenge (`issuer_api::app_attest_client_data_hash`).
//!
//! An attestation is checked as Apple documents it ("Validating apps that connect to your
//! server"), each refusal naming its check (`docs/protocol.md`, "Device tokens"):
//! 1. `evidence`: `key_id` is 32 bytes; exactly one of `attestation` and `assertion`.
//! 2. `attestation_object`, `fmt`, `certificate_chain`: the CBOR object, `fmt` "apple-appattest",
//!    `x5c` of 2 to 4 DER certificates, the credential's first.
//! 3. `root`: the last certificate was issued by a trusted root (Apple's App Attestation Root CA
//!    by default, whose certificate the issuer holds: Apple's `x5c` leaves the root out).
//! 4. `chain_signatures`: each certificate names the next as issuer and carries its signature.
//! 5. `validity`: every certificate, the root's included, is valid now.
//! 6. `authenticator_data`: the authenticator data is well formed, with attested credential data.
//! 7. `nonce`: the credential certificate's extension 1.2.840.113635.100.8.2 holds
//!    SHA-256(authData || clientDataHash).
//! 8. `key_id`: SHA-256 of the credential certificate's public key (uncompressed P-256) is `key_id`.
//! 9. `rp_id`: the RP ID hash is SHA-256 of an allowed App ID (`TEAMID.BUNDLEID`).
//! 10. `counter`: 0.
//! 11. `aaguid`: `appattest` followed by seven zero bytes (production), or `appattestdevelop`
//!     only when the issuer allows development builds.
//! 12. `credential_id`: the credential id is `key_id`.
//!
//! The key is then registered (`registry.rs`). In later windows the device sends an assertion:
//! `key_id` must be registered (`key_id`), the `assertion` CBOR well formed, its `signature` (ECDSA
//! P-256 over SHA-256(authenticatorData || clientDataHash)) verify under the registered key, its
//! `rp_id` be the registered app's (still allowed), its `counter` exceed every counter the key
//! showed before (recorded before any token is granted), and a development key is refused once
//! development builds are no longer allowed (`aaguid`).
//!
//! The device identity the limiter counts is the key's registry name, an HMAC of its key id:
//! re-attesting the same key, or asserting with it, draws on the same allowance. What it does not
//! bound, a second key made by the same install, is said in `docs/threat-model.md` ("Device
//! tokens").

pub mod object;
pub mod registry;

use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::privacy_pass::issuer_api::app_attest_client_data_hash;
use ring::signature::{ECDSA_P256_SHA256_ASN1, UnparsedPublicKey};
use sha2::{Digest, Sha256};
use thiserror::Error;
use x509_parser::certificate::X509Certificate;

use self::object::{Assertion, AttestationObject, AuthenticatorData, nonce_of_extension};
use self::registry::{Registered, Registry, RegistryError};
use super::chain;
use super::{AttestError, Attester, DeviceIdentity, Evidence, FailedCheck, Seconds};

pub const FORMAT: &str = "apple-app-attest";
/// The credential certificate's extension holding the attestation's nonce.
pub const NONCE_OID: &str = "1.2.840.113635.100.8.2";
/// Apple's App Attestation Root CA, the default trust anchor.
pub const APPLE_ROOT_PEM: &str = include_str!("apple_app_attest_root.pem");
pub const PRODUCTION_AAGUID: &[u8; 16] = b"appattest\0\0\0\0\0\0\0";
pub const DEVELOPMENT_AAGUID: &[u8; 16] = b"appattestdevelop";

#[derive(Debug, Error)]
pub enum AppleConfigError {
    #[error(
        "{0}: expected TEAMID.BUNDLEID (the 10-character Apple team id, a dot, then the bundle id), e.g. A1B2C3D4E5.com.example.app"
    )]
    App(String),
    #[error("the roots file holds no readable certificate: {0}")]
    Roots(String),
    #[error("the attester needs at least one allowed app (--apple-app)")]
    NoApps,
    #[error("the App Attest key registry: {0}")]
    Registry(#[from] RegistryError),
}

/// An app whose App Attest keys may attest, by its App ID (`TEAMID.BUNDLEID`), which Apple
/// hashes into the RP ID hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedAppId {
    pub app_id: String,
    pub rp_id_hash: [u8; 32],
}

impl FromStr for AllowedAppId {
    type Err = AppleConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || AppleConfigError::App(text.into());
        let (team, bundle) = text.split_once('.').ok_or_else(bad)?;
        let team_ok = team.len() == 10
            && team
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit());
        let bundle_ok = !bundle.is_empty()
            && bundle.len() <= 255
            && bundle
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-.".contains(&b));
        if !team_ok || !bundle_ok {
            return Err(bad());
        }
        Ok(Self {
            app_id: text.into(),
            rp_id_hash: Sha256::digest(text.as_bytes()).into(),
        })
    }
}

/// What the attester accepts.
#[derive(Debug, Clone)]
pub struct ApplePolicy {
    /// DER certificates of the trusted roots (the whole certificate: Apple's `x5c` leaves the
    /// root out, so its subject and key come from here).
    pub trusted_roots: Vec<Vec<u8>>,
    pub apps: Vec<AllowedAppId>,
    /// Accept keys of development builds (`appattestdevelop`).
    pub allow_development: bool,
}

/// The certificates of a PEM bundle, DER.
pub fn root_certificates_from_pem(pem: &[u8]) -> Result<Vec<Vec<u8>>, AppleConfigError> {
    chain::pem_certificates(pem).map_err(AppleConfigError::Roots)
}

/// Apple's App Attestation Root CA.
pub fn apple_roots() -> Vec<Vec<u8>> {
    root_certificates_from_pem(APPLE_ROOT_PEM.as_bytes())
        .unwrap_or_else(|e| unreachable!("the built-in Apple root parses: {e}"))
}

/// What a verified attestation shows about its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttestedKey {
    pub public_key: [u8; 65],
    pub rp_id_hash: [u8; 32],
    pub development: bool,
}

#[derive(Debug)]
pub struct AppleAttester {
    policy: ApplePolicy,
    registry: Registry,
}

fn refused(check: &'static str, reason: impl Into<String>) -> FailedCheck {
    FailedCheck::new(check, reason)
}

fn decode_base64(text: &str, max: usize, check: &'static str) -> Result<Vec<u8>, FailedCheck> {
    if text.len() > max * 4 / 3 + 4 {
        return Err(refused(check, format!("is larger than {max} bytes")));
    }
    URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|_| refused(check, "is not base64url without padding"))
}

impl AppleAttester {
    pub fn new(policy: ApplePolicy, registry: Registry) -> Result<Self, AppleConfigError> {
        if policy.apps.is_empty() {
            return Err(AppleConfigError::NoApps);
        }
        // The roots are parsed per attestation as strictly as chain certificates: a root that
        // would fail then fails the start instead.
        if policy.trusted_roots.is_empty() {
            return Err(AppleConfigError::Roots("no root".into()));
        }
        chain::parse(&policy.trusted_roots)
            .map_err(|e| AppleConfigError::Roots(e.reason.replace("certificate_chain", "root")))?;
        Ok(Self { policy, registry })
    }

    fn allowed_app(&self, rp_id_hash: &[u8]) -> bool {
        self.policy
            .apps
            .iter()
            .any(|app| app.rp_id_hash.as_slice() == rp_id_hash)
    }

    /// Checks an attestation object of key `key_id` made over `client_data_hash` at `now`
    /// (checks 2 to 12 of the module's list).
    pub fn verify_attestation(
        &self,
        key_id: &[u8],
        object: &[u8],
        client_data_hash: &[u8; 32],
        now: Seconds,
    ) -> Result<AttestedKey, Vec<FailedCheck>> {
        let object = AttestationObject::parse(object).map_err(|e| vec![e])?;
        let roots = chain::parse(&self.policy.trusted_roots).map_err(|e| vec![e])?;
        let mut certs = chain::parse(&object.x5c).map_err(|e| vec![e])?;
        let last_issuer = certs[certs.len() - 1].issuer().as_raw();
        let Some(root) = roots
            .into_iter()
            .find(|root| root.subject().as_raw() == last_issuer)
        else {
            return Err(vec![refused(
                "root",
                "the chain was not issued by a trusted root (Apple's App Attestation Root CA)",
            )]);
        };
        certs.push(root);
        chain::verify_links(&certs).map_err(|e| vec![e])?;
        if let Some(i) = certs.iter().position(|cert| !chain::valid_at(cert, now)) {
            return Err(vec![refused(
                "validity",
                if i == certs.len() - 1 {
                    "the trusted root is not valid now".to_string()
                } else {
                    format!("x5c[{i}] is not valid now (expired or not yet valid)")
                },
            )]);
        }
        let (auth_data, credential) =
            AuthenticatorData::of_attestation(&object.auth_data).map_err(|e| vec![e])?;
        let leaf = &certs[0];
        let mut failed = Vec::new();
        let expected_nonce: [u8; 32] = Sha256::new()
            .chain_update(&object.auth_data)
            .chain_update(client_data_hash)
            .finalize()
            .into();
        match leaf_nonce(leaf) {
            Some(nonce) if nonce == expected_nonce => {}
            Some(_) => failed.push(refused(
                "nonce",
                "the credential certificate's nonce is not SHA-256(authData || clientDataHash) for this challenge; attest with the clientDataHash of the challenge POST /v1/challenge returned",
            )),
            None => failed.push(refused(
                "nonce",
                format!(
                    "the credential certificate must carry exactly one nonce extension ({NONCE_OID}) of the documented shape"
                ),
            )),
        }
        let public_key = match p256_point(leaf) {
            Some(point) => {
                if Sha256::digest(point)[..] != *key_id {
                    failed.push(refused(
                        "key_id",
                        "is not the SHA-256 of the attested public key",
                    ));
                }
                point
            }
            None => {
                failed.push(refused(
                    "key_id",
                    "the credential certificate's key is not a P-256 point",
                ));
                [0; 65]
            }
        };
        if !self.allowed_app(auth_data.rp_id_hash) {
            failed.push(refused(
                "rp_id",
                "the RP ID hash is not the SHA-256 of an App ID (TEAMID.BUNDLEID) on the issuer's allow-list",
            ));
        }
        if auth_data.counter != 0 {
            failed.push(refused(
                "counter",
                format!("is {}; an attestation's counter is 0", auth_data.counter),
            ));
        }
        let development = credential.aaguid == DEVELOPMENT_AAGUID;
        if development && !self.policy.allow_development {
            failed.push(refused(
                "aaguid",
                "the key belongs to a development build (appattestdevelop), which this issuer does not accept",
            ));
        } else if !development && credential.aaguid != PRODUCTION_AAGUID {
            failed.push(refused(
                "aaguid",
                "is neither App Attest's production nor its development AAGUID",
            ));
        }
        if credential.credential_id != key_id {
            failed.push(refused("credential_id", "is not key_id"));
        }
        if !failed.is_empty() {
            return Err(failed);
        }
        Ok(AttestedKey {
            public_key,
            rp_id_hash: auth_data
                .rp_id_hash
                .try_into()
                .unwrap_or_else(|_| unreachable!("32 bytes")),
            development,
        })
    }

    /// Checks an assertion of the registered key over `client_data_hash`; the counter it shows.
    pub fn verify_assertion(
        &self,
        registered: &Registered,
        assertion: &[u8],
        client_data_hash: &[u8; 32],
    ) -> Result<u32, Vec<FailedCheck>> {
        let assertion = Assertion::parse(assertion).map_err(|e| vec![e])?;
        let auth_data =
            AuthenticatorData::of_assertion(&assertion.authenticator_data).map_err(|e| vec![e])?;
        let nonce = Sha256::new()
            .chain_update(&assertion.authenticator_data)
            .chain_update(client_data_hash)
            .finalize();
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, registered.public_key)
            .verify(&nonce, &assertion.signature)
            .map_err(|_| {
                vec![refused(
                    "signature",
                    "does not verify under the registered key over SHA-256(authenticatorData || clientDataHash) for this challenge",
                )]
            })?;
        let mut failed = Vec::new();
        if auth_data.rp_id_hash != registered.rp_id_hash || !self.allowed_app(auth_data.rp_id_hash)
        {
            failed.push(refused(
                "rp_id",
                "the RP ID hash is not the App ID the key was attested for, or that app is no longer on the issuer's allow-list",
            ));
        }
        if auth_data.counter <= registered.counter {
            failed.push(refused(
                "counter",
                format!(
                    "is {}, not above the {} this key showed before (a replayed assertion?)",
                    auth_data.counter, registered.counter
                ),
            ));
        }
        if registered.development && !self.policy.allow_development {
            failed.push(refused(
                "aaguid",
                "the key belongs to a development build, which this issuer no longer accepts",
            ));
        }
        if !failed.is_empty() {
            return Err(failed);
        }
        Ok(auth_data.counter)
    }
}

/// The nonce of the credential certificate's single nonce extension.
fn leaf_nonce(leaf: &X509Certificate<'_>) -> Option<[u8; 32]> {
    let mut found = leaf
        .extensions()
        .iter()
        .filter(|e| e.oid.to_id_string() == NONCE_OID);
    match (found.next(), found.next()) {
        (Some(extension), None) => nonce_of_extension(extension.value),
        _ => None,
    }
}

/// The credential certificate's key as an uncompressed P-256 point.
fn p256_point(leaf: &X509Certificate<'_>) -> Option<[u8; 65]> {
    let key = leaf.public_key();
    let curve = key.algorithm.parameters.as_ref()?.as_oid().ok()?;
    if key.algorithm.algorithm != x509_parser::oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY
        || curve != x509_parser::oid_registry::OID_EC_P256
    {
        return None;
    }
    let point: [u8; 65] = key.subject_public_key.data.as_ref().try_into().ok()?;
    (point[0] == 0x04).then_some(point)
}

impl Attester for AppleAttester {
    fn format(&self) -> &'static str {
        FORMAT
    }

    fn insecure(&self) -> bool {
        false
    }

    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        now: Seconds,
    ) -> Result<DeviceIdentity, AttestError> {
        let Evidence::AppleAppAttest {
            key_id,
            attestation,
            assertion,
        } = evidence
        else {
            return Err(FailedCheck::format(&[FORMAT]).into());
        };
        let key_id = URL_SAFE_NO_PAD
            .decode(key_id)
            .ok()
            .filter(|bytes| bytes.len() == 32)
            .ok_or_else(|| refused("evidence", "key_id is not 32 bytes of base64url"))?;
        let client_data_hash = app_attest_client_data_hash(challenge);
        match (attestation, assertion) {
            (Some(attestation), None) => {
                let object = decode_base64(
                    attestation,
                    object::MAX_ATTESTATION_BYTES,
                    "attestation_object",
                )?;
                // Verified before the key's record is locked: a client repeating one key id
                // makes others of its shard wait for a file write, never for signatures.
                let attested = self.verify_attestation(&key_id, &object, &client_data_hash, now)?;
                let held = self.registry.hold(&key_id);
                let known = usable(held.read())?;
                let record = Registered {
                    development: attested.development,
                    rp_id_hash: attested.rp_id_hash,
                    public_key: attested.public_key,
                    // Attesting the same key again never lowers the counter an assertion showed.
                    counter: known.as_ref().map_or(0, |k| k.counter),
                };
                if known.as_ref() != Some(&record) {
                    held.write(&record)
                        .map_err(|e| AttestError::Storage(e.to_string()))?;
                }
                Ok(DeviceIdentity(held.name()))
            }
            (None, Some(assertion)) => {
                let bytes = decode_base64(assertion, object::MAX_ASSERTION_BYTES, "assertion")?;
                // The signature is checked against the record read without the lock (replaced
                // whole by a rename, so read old or new); the counter again under the lock, so of
                // two assertions showing one counter only one is accepted.
                let known = usable(self.registry.read(&key_id))?.ok_or_else(never_attested)?;
                let counter = self.verify_assertion(&known, &bytes, &client_data_hash)?;
                let held = self.registry.hold(&key_id);
                let current = usable(held.read())?.ok_or_else(never_attested)?;
                if current.public_key != known.public_key || counter <= current.counter {
                    return Err(refused(
                        "counter",
                        format!(
                            "is {counter}, not above the {} this key showed before (a replayed assertion?)",
                            current.counter
                        ),
                    )
                    .into());
                }
                held.write(&Registered { counter, ..current })
                    .map_err(|e| AttestError::Storage(e.to_string()))?;
                Ok(DeviceIdentity(held.name()))
            }
            _ => Err(refused(
                "evidence",
                "send exactly one of attestation (the first time a key is used) and assertion (afterwards)",
            )
            .into()),
        }
    }
}

fn never_attested() -> AttestError {
    refused(
        "key_id",
        "this key was never attested to this issuer; send an attestation (attestKey) first",
    )
    .into()
}

/// A registry read as the attester answers it: a damaged record refuses the key (the device
/// attests a new one), an unreadable registry is a storage failure (503).
fn usable(
    read: Result<Option<Registered>, RegistryError>,
) -> Result<Option<Registered>, AttestError> {
    match read {
        Ok(known) => Ok(known),
        Err(RegistryError::Damaged(path)) => {
            tracing::error!(path = %path.display(), "an App Attest key record is damaged; the device must attest a new key");
            Err(refused(
                "key_id",
                "the issuer's record of this key is unusable; generate a new key and attest it",
            )
            .into())
        }
        Err(error) => Err(AttestError::Storage(error.to_string())),
    }
}
