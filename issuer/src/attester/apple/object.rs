//! The CBOR of App Attest evidence, as Apple documents it ("Validating apps that connect to your
//! server"), read into borrowed parts; nothing here decides whether to trust them.
//!
//! ```text
//! attestation object = { "fmt": "apple-appattest",
//!                        "attStmt": { "x5c": [credCert, intermediate, ...], "receipt": bytes },
//!                        "authData": bytes }
//! assertion          = { "signature": bytes (DER ECDSA), "authenticatorData": bytes }
//! authData           = rpIdHash (32) | flags (1) | counter (4, big-endian)
//!                      [ | aaguid (16) | credentialIdLength (2) | credentialId | COSE key | ... ]
//! ```
//!
//! The attested-credential part follows in an attestation's authData. Apple sets flag 0x40 in
//! assertions too (the recorded iOS 14.4 assertion has it with no credential data), so the part is
//! read by where the data comes from, not by the flag. Bytes after the COSE key are not read: since 2026 Apple appends a CBOR map there (`apple_bundle_version_01`, ...)
//! without setting the extension flag, and the nonce in Apple's certificate covers them anyway.

use ciborium::Value;

use crate::attester::FailedCheck;

pub const FORMAT: &str = "apple-appattest";
/// Largest attestation object accepted (Apple's are about 5.5 KB: two certificates and a receipt).
pub const MAX_ATTESTATION_BYTES: usize = 16 * 1024;
/// Largest assertion accepted (Apple's are about 120 bytes).
pub const MAX_ASSERTION_BYTES: usize = 1024;
/// Most certificates `x5c` may hold (Apple's holds 2: the credential's and the intermediate's).
pub const MAX_CERTIFICATES: usize = 4;

pub struct AttestationObject {
    pub x5c: Vec<Vec<u8>>,
    pub auth_data: Vec<u8>,
}

pub struct Assertion {
    pub signature: Vec<u8>,
    pub authenticator_data: Vec<u8>,
}

/// The parts of authenticator data the checks read.
pub struct AuthenticatorData<'a> {
    pub rp_id_hash: &'a [u8],
    pub counter: u32,
}

pub struct AttestedCredential<'a> {
    pub aaguid: &'a [u8],
    pub credential_id: &'a [u8],
}

fn refused(check: &'static str, reason: impl Into<String>) -> FailedCheck {
    FailedCheck::new(check, reason)
}

/// One CBOR item filling all of `bytes`.
fn whole_item(bytes: &[u8], check: &'static str, what: &str) -> Result<Value, FailedCheck> {
    let mut rest = bytes;
    let value: Value = ciborium::from_reader(&mut rest)
        .map_err(|_| refused(check, format!("the {what} is not CBOR")))?;
    if !rest.is_empty() {
        return Err(refused(
            check,
            format!("{} bytes follow the {what}'s CBOR", rest.len()),
        ));
    }
    Ok(value)
}

/// The value of text key `key` in a CBOR map, if the map has exactly one.
fn field<'v>(map: &'v [(Value, Value)], key: &str) -> Option<&'v Value> {
    let mut found = map
        .iter()
        .filter(|(k, _)| k.as_text() == Some(key))
        .map(|(_, v)| v);
    match (found.next(), found.next()) {
        (Some(value), None) => Some(value),
        _ => None,
    }
}

fn bytes_field(
    map: &[(Value, Value)],
    key: &str,
    check: &'static str,
) -> Result<Vec<u8>, FailedCheck> {
    field(map, key)
        .and_then(Value::as_bytes)
        .cloned()
        .ok_or_else(|| {
            refused(
                check,
                format!("`{key}` is missing, repeated or not a byte string"),
            )
        })
}

impl AttestationObject {
    pub fn parse(bytes: &[u8]) -> Result<Self, FailedCheck> {
        const CHECK: &str = "attestation_object";
        if bytes.len() > MAX_ATTESTATION_BYTES {
            return Err(refused(
                CHECK,
                format!("is larger than {MAX_ATTESTATION_BYTES} bytes"),
            ));
        }
        let value = whole_item(bytes, CHECK, "attestation object")?;
        let map = value
            .as_map()
            .ok_or_else(|| refused(CHECK, "is not a CBOR map"))?;
        match field(map, "fmt").and_then(Value::as_text) {
            Some(FORMAT) => {}
            Some(other) => {
                return Err(refused(
                    "fmt",
                    format!("is \"{other}\"; App Attest objects say \"{FORMAT}\""),
                ));
            }
            None => return Err(refused(CHECK, "`fmt` is missing or not text")),
        }
        let statement = field(map, "attStmt")
            .and_then(Value::as_map)
            .ok_or_else(|| refused(CHECK, "`attStmt` is missing or not a map"))?;
        let x5c = field(statement, "x5c")
            .and_then(Value::as_array)
            .ok_or_else(|| {
                refused(
                    "certificate_chain",
                    "`attStmt.x5c` is missing or not an array",
                )
            })?;
        if !(2..=MAX_CERTIFICATES).contains(&x5c.len()) {
            return Err(refused(
                "certificate_chain",
                format!(
                    "`x5c` holds {} certificates; App Attest sends the credential's and its issuers' (2 to {MAX_CERTIFICATES}), the root excluded",
                    x5c.len()
                ),
            ));
        }
        let x5c = x5c
            .iter()
            .enumerate()
            .map(|(i, cert)| {
                cert.as_bytes().cloned().ok_or_else(|| {
                    refused(
                        "certificate_chain",
                        format!("`x5c[{i}]` is not a byte string"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            x5c,
            auth_data: bytes_field(map, "authData", CHECK)?,
        })
    }
}

impl Assertion {
    pub fn parse(bytes: &[u8]) -> Result<Self, FailedCheck> {
        const CHECK: &str = "assertion";
        if bytes.len() > MAX_ASSERTION_BYTES {
            return Err(refused(
                CHECK,
                format!("is larger than {MAX_ASSERTION_BYTES} bytes"),
            ));
        }
        let value = whole_item(bytes, CHECK, "assertion")?;
        let map = value
            .as_map()
            .ok_or_else(|| refused(CHECK, "is not a CBOR map"))?;
        Ok(Self {
            signature: bytes_field(map, "signature", CHECK)?,
            authenticator_data: bytes_field(map, "authenticatorData", CHECK)?,
        })
    }
}

impl<'a> AuthenticatorData<'a> {
    /// An assertion's authenticator data (RP ID hash, flags, counter; anything after is signed
    /// but not read).
    pub fn of_assertion(bytes: &'a [u8]) -> Result<Self, FailedCheck> {
        Ok(Self::parse(bytes)?.0)
    }

    /// An attestation's authenticator data and its attested credential data.
    pub fn of_attestation(bytes: &'a [u8]) -> Result<(Self, AttestedCredential<'a>), FailedCheck> {
        const CHECK: &str = "authenticator_data";
        let (data, rest) = Self::parse(bytes)?;
        if rest.len() < 18 {
            return Err(refused(
                CHECK,
                "the attested credential data ends before its AAGUID and credential id length",
            ));
        }
        let (aaguid, rest) = rest.split_at(16);
        let length = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
        let rest = &rest[2..];
        if rest.len() < length {
            return Err(refused(
                CHECK,
                format!("the credential id of {length} bytes runs past the end"),
            ));
        }
        let (credential_id, mut key) = rest.split_at(length);
        if ciborium::from_reader::<Value, _>(&mut key).is_err() {
            return Err(refused(
                CHECK,
                "no CBOR public key follows the credential id",
            ));
        }
        Ok((
            data,
            AttestedCredential {
                aaguid,
                credential_id,
            },
        ))
    }

    /// The fixed head, and what follows it.
    fn parse(bytes: &'a [u8]) -> Result<(Self, &'a [u8]), FailedCheck> {
        const CHECK: &str = "authenticator_data";
        if bytes.len() < 37 {
            return Err(refused(
                CHECK,
                format!(
                    "holds {} bytes; it starts with an RP ID hash, flags and a counter (37 bytes)",
                    bytes.len()
                ),
            ));
        }
        let (rp_id_hash, rest) = bytes.split_at(32);
        let counter = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]);
        let rest = &rest[5..];
        Ok((
            Self {
                rp_id_hash,
                counter,
            },
            rest,
        ))
    }
}

/// The 32-byte nonce in the credential certificate's extension 1.2.840.113635.100.8.2:
/// `SEQUENCE { [1] EXPLICIT OCTET STRING (32) }`, in DER with short lengths (38 bytes in all).
pub fn nonce_of_extension(value: &[u8]) -> Option<[u8; 32]> {
    fn only_element(bytes: &[u8], tag: u8) -> Option<&[u8]> {
        match bytes {
            [t, length, content @ ..] if *t == tag && *length < 0x80 => {
                (content.len() == usize::from(*length)).then_some(content)
            }
            _ => None,
        }
    }
    let sequence = only_element(value, 0x30)?;
    let tagged = only_element(sequence, 0xa1)?;
    only_element(tagged, 0x04)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nonce_extension_is_read_only_in_its_exact_shape() {
        let mut der = vec![0x30, 0x24, 0xa1, 0x22, 0x04, 0x20];
        der.extend([7u8; 32]);
        assert_eq!(nonce_of_extension(&der), Some([7u8; 32]));
        let mut longer = der.clone();
        longer.push(0);
        assert_eq!(nonce_of_extension(&longer), None);
        let mut other_tag = der.clone();
        other_tag[2] = 0xa2;
        assert_eq!(nonce_of_extension(&other_tag), None);
        assert_eq!(nonce_of_extension(&der[..20]), None);
    }

    #[test]
    fn authenticator_data_of_an_assertion_and_of_an_attestation_with_apples_trailing_map() {
        let mut assertion = vec![9u8; 32];
        assertion.extend([0x00, 0, 0, 1, 2]);
        let parsed = AuthenticatorData::of_assertion(&assertion).unwrap();
        assert_eq!(parsed.counter, 258);
        assert!(AuthenticatorData::of_assertion(&assertion[..36]).is_err());
        // An attestation's authData must carry the credential.
        assert!(AuthenticatorData::of_attestation(&assertion).is_err());

        let mut attestation = vec![9u8; 32];
        attestation.extend([0x40, 0, 0, 0, 0]);
        attestation.extend(b"appattest\0\0\0\0\0\0\0");
        attestation.extend([0, 2, 0xaa, 0xbb]);
        attestation.extend([0xa1, 0x01, 0x02]); // the COSE key (a map)
        attestation.extend([0xa1, 0x61, b'v', 0x61, b'1']); // Apple's map since 2026
        let (_, credential) = AuthenticatorData::of_attestation(&attestation).unwrap();
        assert_eq!(credential.credential_id, [0xaa, 0xbb]);
        assert_eq!(credential.aaguid, b"appattest\0\0\0\0\0\0\0");
        // A credential id longer than what follows, or no key after it, is refused.
        let mut short = attestation[..55].to_vec();
        short.extend([0xaa, 0xbb]);
        assert_eq!(
            AuthenticatorData::of_attestation(&short)
                .err()
                .unwrap()
                .check,
            "authenticator_data"
        );
        let mut long = attestation.clone();
        long[54] = 200;
        assert!(AuthenticatorData::of_attestation(&long).is_err());
    }
}
