//! The Android key attestation extension (`KeyDescription`, OID 1.3.6.1.4.1.11129.2.1.17) as the
//! attested key's certificate carries it, read far enough for the issuer's checks: the two
//! security levels, the challenge, the root of trust (`[704]`, hardware-enforced list), the
//! attestation application id (`[709]`, software-enforced list) and the OS patch level (`[706]`).
//!
//! The layout is the same in every attestation version seen (3 to 500; the field names changed
//! at 100, the encoding did not), so it is read by structure, not by version. Lengths and tags are
//! DER (definite, minimal); values are read leniently where real devices are known to deviate
//! (a BOOLEAN encoded 0x01, tags out of order). The bytes are signed by the device's secure
//! hardware and read only after the chain verified, so leniency accepts only what a TEE or
//! Android's keystore emitted. Everything else unexpected is refused.

use thiserror::Error;
use x509_parser::asn1_rs::{Any, Class, FromDer, Tag};

/// The extension's OID, as dotted text.
pub const OID: &str = "1.3.6.1.4.1.11129.2.1.17";

const TAG_OS_PATCH_LEVEL: u32 = 706;
const TAG_ROOT_OF_TRUST: u32 = 704;
const TAG_APPLICATION_ID: u32 = 709;

#[derive(Debug, Error, PartialEq, Eq)]
#[error("the key description is malformed: {0}")]
pub struct Malformed(pub String);

fn malformed(what: impl Into<String>) -> Malformed {
    Malformed(what.into())
}

/// Where the key lives, as the attestation states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecurityLevel {
    Software,
    TrustedEnvironment,
    StrongBox,
}

impl SecurityLevel {
    fn from_value(value: i64) -> Result<Self, Malformed> {
        match value {
            0 => Ok(Self::Software),
            1 => Ok(Self::TrustedEnvironment),
            2 => Ok(Self::StrongBox),
            other => Err(malformed(format!("unknown security level {other}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Software => "Software",
            Self::TrustedEnvironment => "TrustedEnvironment",
            Self::StrongBox => "StrongBox",
        }
    }
}

/// `VerifiedBootState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifiedBootState {
    Verified,
    SelfSigned,
    Unverified,
    Failed,
}

impl VerifiedBootState {
    fn from_value(value: i64) -> Result<Self, Malformed> {
        match value {
            0 => Ok(Self::Verified),
            1 => Ok(Self::SelfSigned),
            2 => Ok(Self::Unverified),
            3 => Ok(Self::Failed),
            other => Err(malformed(format!("unknown verified boot state {other}"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootOfTrust {
    pub device_locked: bool,
    pub verified_boot_state: VerifiedBootState,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplicationId {
    pub package_names: Vec<Vec<u8>>,
    pub signature_digests: Vec<Vec<u8>>,
}

/// An `AuthorizationList`: its explicitly tagged entries, each the tag number and the inner TLV.
#[derive(Debug)]
pub struct AuthorizationList<'a> {
    entries: Vec<(u32, Any<'a>)>,
}

impl<'a> AuthorizationList<'a> {
    fn parse(any: Any<'a>, what: &str) -> Result<Self, Malformed> {
        expect(&any, Tag::Sequence, what)?;
        let mut entries = Vec::new();
        let mut reader = Reader(any.data);
        while !reader.0.is_empty() {
            let entry = reader.next(what)?;
            if entry.class() != Class::ContextSpecific || !entry.header.is_constructed() {
                return Err(malformed(format!(
                    "{what} holds an entry that is not an explicit context tag"
                )));
            }
            let mut inner = Reader(entry.data);
            let value = inner.next(what)?;
            if !inner.0.is_empty() {
                return Err(malformed(format!(
                    "{what} entry [{}] holds more than one value",
                    entry.tag().0
                )));
            }
            entries.push((entry.tag().0, value));
        }
        Ok(Self { entries })
    }

    /// The entry with `tag`; a tag this issuer reads must not appear twice (which copy would
    /// count is exactly the ambiguity an attacker would look for).
    fn unique(&self, tag: u32, what: &str) -> Result<Option<&Any<'a>>, Malformed> {
        let mut found = self.entries.iter().filter(|(t, _)| *t == tag);
        let first = found.next().map(|(_, v)| v);
        if found.next().is_some() {
            return Err(malformed(format!("{what} holds [{tag}] twice")));
        }
        Ok(first)
    }

    pub fn root_of_trust(&self) -> Result<Option<RootOfTrust>, Malformed> {
        let Some(any) = self.unique(TAG_ROOT_OF_TRUST, "the authorization list")? else {
            return Ok(None);
        };
        expect(any, Tag::Sequence, "rootOfTrust")?;
        let mut fields = Reader(any.data);
        expect(
            &fields.next("rootOfTrust")?,
            Tag::OctetString,
            "verifiedBootKey",
        )?;
        let locked = fields.next("rootOfTrust")?;
        expect(&locked, Tag::Boolean, "deviceLocked")?;
        let state = fields.next("rootOfTrust")?;
        expect(&state, Tag::Enumerated, "verifiedBootState")?;
        Ok(Some(RootOfTrust {
            // BER: any non-zero octet is TRUE (real devices have sent 0x01).
            device_locked: locked.data.iter().any(|&b| b != 0),
            verified_boot_state: VerifiedBootState::from_value(small_integer(
                &state,
                "verifiedBootState",
            )?)?,
        }))
    }

    pub fn application_id(&self) -> Result<Option<ApplicationId>, Malformed> {
        let Some(any) = self.unique(TAG_APPLICATION_ID, "the authorization list")? else {
            return Ok(None);
        };
        expect(any, Tag::OctetString, "attestationApplicationId")?;
        let (rest, sequence) = Any::from_der(any.data)
            .map_err(|_| malformed("attestationApplicationId is not DER"))?;
        if !rest.is_empty() {
            return Err(malformed("attestationApplicationId has trailing bytes"));
        }
        expect(&sequence, Tag::Sequence, "attestationApplicationId")?;
        let mut fields = Reader(sequence.data);
        let packages = fields.next("attestationApplicationId")?;
        expect(&packages, Tag::Set, "packageInfos")?;
        let mut package_names = Vec::new();
        let mut infos = Reader(packages.data);
        while !infos.0.is_empty() {
            let info = infos.next("packageInfos")?;
            expect(&info, Tag::Sequence, "AttestationPackageInfo")?;
            let name = Reader(info.data).next("AttestationPackageInfo")?;
            expect(&name, Tag::OctetString, "packageName")?;
            package_names.push(name.data.to_vec());
        }
        let digests = fields.next("attestationApplicationId")?;
        expect(&digests, Tag::Set, "signatureDigests")?;
        let mut signature_digests = Vec::new();
        let mut items = Reader(digests.data);
        while !items.0.is_empty() {
            let digest = items.next("signatureDigests")?;
            expect(&digest, Tag::OctetString, "signatureDigest")?;
            signature_digests.push(digest.data.to_vec());
        }
        Ok(Some(ApplicationId {
            package_names,
            signature_digests,
        }))
    }

    /// `osPatchLevel` as YYYYMM.
    pub fn os_patch_level(&self) -> Result<Option<i64>, Malformed> {
        self.unique(TAG_OS_PATCH_LEVEL, "the authorization list")?
            .map(|any| {
                expect(any, Tag::Integer, "osPatchLevel")?;
                small_integer(any, "osPatchLevel")
            })
            .transpose()
    }
}

/// The extension's fields the issuer reads.
#[derive(Debug)]
pub struct KeyDescription<'a> {
    pub attestation_version: i64,
    pub attestation_security_level: SecurityLevel,
    pub keymint_security_level: SecurityLevel,
    pub attestation_challenge: &'a [u8],
    pub software_enforced: AuthorizationList<'a>,
    pub hardware_enforced: AuthorizationList<'a>,
}

impl<'a> KeyDescription<'a> {
    /// Reads the extension's value (the content of its OCTET STRING).
    pub fn parse(value: &'a [u8]) -> Result<Self, Malformed> {
        let (rest, sequence) = Any::from_der(value).map_err(|_| malformed("not a DER SEQUENCE"))?;
        if !rest.is_empty() {
            return Err(malformed("trailing bytes after the SEQUENCE"));
        }
        expect(&sequence, Tag::Sequence, "KeyDescription")?;
        let mut fields = Reader(sequence.data);
        let version = fields.next("attestationVersion")?;
        expect(&version, Tag::Integer, "attestationVersion")?;
        let attestation_level = fields.next("attestationSecurityLevel")?;
        expect(
            &attestation_level,
            Tag::Enumerated,
            "attestationSecurityLevel",
        )?;
        expect(
            &fields.next("keyMintVersion")?,
            Tag::Integer,
            "keyMintVersion",
        )?;
        let keymint_level = fields.next("keyMintSecurityLevel")?;
        expect(&keymint_level, Tag::Enumerated, "keyMintSecurityLevel")?;
        let challenge = fields.next("attestationChallenge")?;
        expect(&challenge, Tag::OctetString, "attestationChallenge")?;
        expect(&fields.next("uniqueId")?, Tag::OctetString, "uniqueId")?;
        let software_enforced =
            AuthorizationList::parse(fields.next("softwareEnforced")?, "softwareEnforced")?;
        let hardware_enforced =
            AuthorizationList::parse(fields.next("hardwareEnforced")?, "hardwareEnforced")?;
        if !fields.0.is_empty() {
            return Err(malformed(
                "KeyDescription has fields after hardwareEnforced",
            ));
        }
        Ok(Self {
            attestation_version: small_integer(&version, "attestationVersion")?,
            attestation_security_level: SecurityLevel::from_value(small_integer(
                &attestation_level,
                "attestationSecurityLevel",
            )?)?,
            keymint_security_level: SecurityLevel::from_value(small_integer(
                &keymint_level,
                "keyMintSecurityLevel",
            )?)?,
            attestation_challenge: challenge.data,
            software_enforced,
            hardware_enforced,
        })
    }
}

/// Reads one TLV after another from a constructed value's contents.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn next(&mut self, what: &str) -> Result<Any<'a>, Malformed> {
        if self.0.is_empty() {
            return Err(malformed(format!("{what} is missing")));
        }
        let (rest, any) =
            Any::from_der(self.0).map_err(|_| malformed(format!("{what} is not DER")))?;
        self.0 = rest;
        Ok(any)
    }
}

fn expect(any: &Any<'_>, tag: Tag, what: &str) -> Result<(), Malformed> {
    let constructed = matches!(tag, Tag::Sequence | Tag::Set);
    if any.class() == Class::Universal
        && any.tag() == tag
        && any.header.is_constructed() == constructed
    {
        Ok(())
    } else {
        Err(malformed(format!(
            "{what} has tag {:?} {}, not the universal tag {}",
            any.class(),
            any.tag().0,
            tag.0
        )))
    }
}

/// A non-negative INTEGER or ENUMERATED that fits 63 bits (versions, levels, dates).
fn small_integer(any: &Any<'_>, what: &str) -> Result<i64, Malformed> {
    let bytes = any.data;
    if bytes.is_empty() || bytes[0] & 0x80 != 0 {
        return Err(malformed(format!("{what} is empty or negative")));
    }
    let significant = bytes
        .iter()
        .position(|&b| b != 0)
        .map_or(&[][..], |i| &bytes[i..]);
    if significant.len() > 7 {
        return Err(malformed(format!("{what} is too large")));
    }
    Ok(significant
        .iter()
        .fold(0i64, |value, &b| (value << 8) | i64::from(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_read_as_big_endian_and_negative_or_huge_ones_are_refused() {
        let int = |bytes: &'static [u8]| Any::from_tag_and_data(Tag::Integer, bytes);
        assert_eq!(small_integer(&int(&[0x01, 0x90]), "x"), Ok(400));
        assert_eq!(small_integer(&int(&[0x00, 0xff]), "x"), Ok(255));
        assert_eq!(small_integer(&int(&[0x03, 0x16, 0x5a]), "x"), Ok(202_330));
        assert!(small_integer(&int(&[0xff]), "x").is_err());
        assert!(small_integer(&int(&[]), "x").is_err());
        assert!(small_integer(&int(&[0x7f; 8]), "x").is_err());
    }

    #[test]
    fn a_truncated_or_foreign_structure_is_malformed_not_a_panic() {
        for bytes in [
            &[][..],
            &[0x30, 0x05, 0x02, 0x01][..],
            &[0x31, 0x00][..],
            &[0x30, 0x03, 0x02, 0x01, 0x03][..],
            &[0x30, 0x00, 0x00][..],
        ] {
            assert!(KeyDescription::parse(bytes).is_err(), "{bytes:02x?}");
        }
    }
}
