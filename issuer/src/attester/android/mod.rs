//! The Android key attestation attester: a device generates a key in its secure hardware with the
//! issuer's challenge as the attestation challenge and sends the key's certificate chain. The
//! chain proves, under Google's hardware attestation roots, what the secure hardware saw when it
//! made the key: the challenge, the verified boot state and bootloader lock, and (from Android's
//! keystore) the app that asked.
//!
//! What is checked, in order (each refusal names its check; `docs/protocol.md`, "Device tokens"):
//! 1. `certificate_chain`: 2-10 base64url DER certificates, leaf first.
//! 2. `chain_signatures`: each certificate names the next as issuer and carries its signature.
//! 3. `root`: the last certificate's public key is a trusted root's (Google's by default).
//! 4. `validity`: every certificate between the leaf and the root is valid now (the leaf's dates
//!    are the device's, meaningless; the root is trusted by key).
//! 5. `revocation`: no certificate's serial is on the operator's copy of Google's status list.
//! 6. `key_description`: the leaf, and only the leaf, carries the attestation extension.
//! 7. `provisioning`: the key that signed the leaf was provisioned remotely (RKP: its certificate
//!    carries Google's provisioning-info extension), so it belongs to one device and one app for
//!    about two weeks. Factory-provisioned attestation keys are shared by batches of devices, so
//!    they cannot bound tokens per device and are refused.
//! 8. The key description: `security_level` (TEE or StrongBox for both levels), `challenge`,
//!    `verified_boot` (Verified), `device_locked`, `application` (an allowed package with its
//!    signing certificate's digest) and, when configured, `os_patch_level`.
//!
//! The device identity the limiter counts is the SHA-256 of the RKP attestation key's
//! SubjectPublicKeyInfo: one per (device, app, TEE or StrongBox) per provisioning period.

pub mod key_description;
pub mod revocation;

use std::str::FromStr;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use thiserror::Error;
use x509_parser::certificate::X509Certificate;

use self::key_description::{KeyDescription, SecurityLevel, VerifiedBootState};
use self::revocation::{StatusFile, StatusList};
pub use super::chain;
use super::{AttestError, Attester, DeviceIdentity, Evidence, FailedCheck, Seconds};

pub const FORMAT: &str = "android-key-attestation";
/// Google's provisioning-info extension, on certificates its remote key provisioning issued.
pub const PROVISIONING_INFO_OID: &str = "1.3.6.1.4.1.11129.2.1.30";
/// Google's hardware attestation roots (RSA-4096 and ECDSA P-384), the default trust anchors.
pub const GOOGLE_ROOTS_PEM: &str = include_str!("google_roots.pem");

const IDENTITY_LABEL: &[u8] = b"confed-android-rkp-attestation-key-v1\0";

#[derive(Debug, Error)]
pub enum AndroidConfigError {
    #[error(
        "{0}: expected PACKAGE:SHA256HEX (the app's package name, then the lowercase hex SHA-256 of its signing certificate)"
    )]
    App(String),
    #[error("the roots file holds no readable certificate: {0}")]
    Roots(String),
    #[error("the attester needs at least one allowed app (--android-app)")]
    NoApps,
}

/// An app whose keys may attest: its package name and the SHA-256 of its signing certificate,
/// as Android's attestation application id lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedApp {
    pub package: String,
    pub signature_digest: [u8; 32],
}

impl FromStr for AllowedApp {
    type Err = AndroidConfigError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || AndroidConfigError::App(text.into());
        let (package, digest) = text.split_once(':').ok_or_else(bad)?;
        let valid_package = !package.is_empty()
            && package.len() <= 256
            && package
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._".contains(&b));
        let digest = confed_protocol::hex::decode(digest)
            .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
            .ok_or_else(bad)?;
        if !valid_package {
            return Err(bad());
        }
        Ok(Self {
            package: package.into(),
            signature_digest: digest,
        })
    }
}

/// What the attester accepts.
#[derive(Debug, Clone)]
pub struct AndroidPolicy {
    /// DER SubjectPublicKeyInfo of each trusted root.
    pub trusted_roots: Vec<Vec<u8>>,
    pub apps: Vec<AllowedApp>,
    pub status_list: StatusList,
    /// Lowest `osPatchLevel` (YYYYMM) accepted, if any.
    pub min_os_patch_level: Option<i64>,
}

/// The public keys of the certificates in a PEM bundle.
pub fn root_keys_from_pem(pem: &[u8]) -> Result<Vec<Vec<u8>>, AndroidConfigError> {
    chain::pem_certificates(pem)
        .and_then(|ders| {
            ders.iter()
                .map(|der| {
                    x509_parser::parse_x509_certificate(der)
                        .map(|(_, cert)| cert.public_key().raw.to_vec())
                        .map_err(|e| e.to_string())
                })
                .collect()
        })
        .map_err(AndroidConfigError::Roots)
}

/// Google's roots' public keys.
pub fn google_root_keys() -> Vec<Vec<u8>> {
    root_keys_from_pem(GOOGLE_ROOTS_PEM.as_bytes())
        .unwrap_or_else(|e| unreachable!("the built-in Google roots parse: {e}"))
}

#[derive(Debug)]
pub struct AndroidAttester {
    policy: AndroidPolicy,
    /// When set, the status list comes from this file instead of `policy.status_list`.
    status_file: Option<StatusFile>,
}

impl AndroidAttester {
    pub fn new(policy: AndroidPolicy) -> Result<Self, AndroidConfigError> {
        if policy.apps.is_empty() {
            return Err(AndroidConfigError::NoApps);
        }
        Ok(Self {
            policy,
            status_file: None,
        })
    }

    /// Takes the status list from `file`, reloaded when it changes and refused when stale.
    pub fn with_status_file(mut self, file: StatusFile) -> Self {
        self.status_file = Some(file);
        self
    }

    fn revoked(&self, serial_key: &str) -> bool {
        match &self.status_file {
            Some(file) => file.list().contains(serial_key),
            None => self.policy.status_list.contains(serial_key),
        }
    }

    fn check_chain(&self, certs: &[X509Certificate<'_>], now: Seconds) -> Result<(), FailedCheck> {
        // The root first: a chain under any other key costs no signature verification.
        let root = &certs[certs.len() - 1];
        if !self
            .policy
            .trusted_roots
            .iter()
            .any(|key| key.as_slice() == root.public_key().raw)
        {
            return Err(FailedCheck::new(
                "root",
                "the chain does not end at a trusted root (Google's hardware attestation roots)",
            ));
        }
        chain::verify_links(certs)?;
        if let Some(i) = (1..certs.len() - 1).find(|&i| !chain::valid_at(&certs[i], now)) {
            return Err(FailedCheck::new(
                "validity",
                format!("certificate_chain[{i}] is not valid now (expired or not yet valid)"),
            ));
        }
        if let Some(i) = certs
            .iter()
            .position(|cert| self.revoked(&chain::serial_key(cert)))
        {
            return Err(FailedCheck::new(
                "revocation",
                format!(
                    "certificate_chain[{i}] (serial {}) is revoked or suspended on Google's status list",
                    chain::serial_key(&certs[i])
                ),
            ));
        }
        Ok(())
    }

    /// The leaf's key description; refuses one anywhere else in the chain (a key description
    /// in a certificate the leaf's issuer did not make would be the attacker's).
    fn key_description<'c>(
        certs: &'c [X509Certificate<'c>],
    ) -> Result<KeyDescription<'c>, FailedCheck> {
        let with_extension = |cert: &X509Certificate<'_>| {
            cert.extensions()
                .iter()
                .filter(|e| e.oid.to_id_string() == key_description::OID)
                .count()
        };
        if let Some(i) = (1..certs.len()).find(|&i| with_extension(&certs[i]) > 0) {
            return Err(FailedCheck::new(
                "key_description",
                format!(
                    "certificate_chain[{i}] carries an attestation extension; only the attested key's certificate may"
                ),
            ));
        }
        let leaf = &certs[0];
        let mut found = leaf
            .extensions()
            .iter()
            .filter(|e| e.oid.to_id_string() == key_description::OID);
        let (Some(extension), None) = (found.next(), found.next()) else {
            return Err(FailedCheck::new(
                "key_description",
                "the attested key's certificate must carry exactly one attestation extension (1.3.6.1.4.1.11129.2.1.17)",
            ));
        };
        KeyDescription::parse(extension.value)
            .map_err(|e| FailedCheck::new("key_description", e.to_string()))
    }

    /// The policy's checks on the key description; every failing one is named.
    fn check_description(
        &self,
        description: &KeyDescription<'_>,
        challenge: &[u8],
    ) -> Vec<FailedCheck> {
        let mut failed = Vec::new();
        let hardware = |level: SecurityLevel| level != SecurityLevel::Software;
        if !hardware(description.attestation_security_level)
            || !hardware(description.keymint_security_level)
        {
            failed.push(FailedCheck::new(
                "security_level",
                format!(
                    "the key is attested at {} and kept at {}; both must be TrustedEnvironment or StrongBox",
                    description.attestation_security_level.name(),
                    description.keymint_security_level.name()
                ),
            ));
        }
        if !bool::from(description.attestation_challenge.ct_eq(challenge)) {
            failed.push(FailedCheck::new(
                "challenge",
                "the key's attestation challenge is not this request's challenge; generate a key with the challenge POST /v1/challenge returned",
            ));
        }
        match description.hardware_enforced.root_of_trust() {
            Ok(Some(root)) => {
                if root.verified_boot_state != VerifiedBootState::Verified {
                    failed.push(FailedCheck::new(
                        "verified_boot",
                        format!(
                            "the verified boot state is {:?}, not Verified",
                            root.verified_boot_state
                        ),
                    ));
                }
                if !root.device_locked {
                    failed.push(FailedCheck::new(
                        "device_locked",
                        "the bootloader is unlocked",
                    ));
                }
            }
            Ok(None) => failed.push(FailedCheck::new(
                "verified_boot",
                "the hardware-enforced list has no root of trust",
            )),
            Err(e) => failed.push(FailedCheck::new("verified_boot", e.to_string())),
        }
        match description.software_enforced.application_id() {
            Ok(Some(app)) if self.allows(&app) => {}
            Ok(Some(app)) => failed.push(FailedCheck::new(
                "application",
                format!(
                    "the key belongs to {} (signed by {}), which is not on the issuer's allow-list",
                    app.package_names
                        .iter()
                        .map(|name| String::from_utf8_lossy(name).into_owned())
                        .collect::<Vec<_>>()
                        .join(", "),
                    app.signature_digests
                        .iter()
                        .map(confed_protocol::hex::encode)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
            Ok(None) => failed.push(FailedCheck::new(
                "application",
                "the key description names no attestation application id",
            )),
            Err(e) => failed.push(FailedCheck::new("application", e.to_string())),
        }
        if let Some(minimum) = self.policy.min_os_patch_level {
            match description.hardware_enforced.os_patch_level() {
                Ok(Some(level)) if level >= minimum => {}
                Ok(level) => failed.push(FailedCheck::new(
                    "os_patch_level",
                    format!(
                        "the OS patch level is {}; this issuer needs {minimum} or later",
                        level.map_or("absent".into(), |l| l.to_string())
                    ),
                )),
                Err(e) => failed.push(FailedCheck::new("os_patch_level", e.to_string())),
            }
        }
        failed
    }

    fn allows(&self, app: &key_description::ApplicationId) -> bool {
        self.policy.apps.iter().any(|allowed| {
            app.package_names
                .iter()
                .any(|name| name.as_slice() == allowed.package.as_bytes())
                && app
                    .signature_digests
                    .iter()
                    .any(|digest| digest.as_slice() == allowed.signature_digest)
        })
    }
}

impl Attester for AndroidAttester {
    fn format(&self) -> &'static str {
        FORMAT
    }

    fn insecure(&self) -> bool {
        false
    }

    fn unavailable(&self, now: Seconds) -> Option<String> {
        self.status_file.as_ref()?.refresh(now).err()
    }

    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        now: Seconds,
    ) -> Result<DeviceIdentity, AttestError> {
        let Evidence::AndroidKeyAttestation { certificate_chain } = evidence else {
            return Err(FailedCheck::format(&[FORMAT]).into());
        };
        let ders = chain::decode(certificate_chain)?;
        let certs = chain::parse(&ders)?;
        self.check_chain(&certs, now)?;
        let description = Self::key_description(&certs)?;
        let attestation_key = &certs[1];
        if !attestation_key
            .extensions()
            .iter()
            .any(|e| e.oid.to_id_string() == PROVISIONING_INFO_OID)
        {
            return Err(AttestError::from(FailedCheck::new(
                "provisioning",
                "the attestation key was provisioned in the factory, shared by a batch of devices, so it cannot bound tokens per device; this issuer takes remotely provisioned (RKP) attestation keys only",
            )));
        }
        let failed = self.check_description(&description, challenge);
        if !failed.is_empty() {
            return Err(AttestError::Refused(failed));
        }
        let mut hash = Sha256::new();
        hash.update(IDENTITY_LABEL);
        hash.update(attestation_key.public_key().raw);
        Ok(DeviceIdentity(hash.finalize().into()))
    }
}
