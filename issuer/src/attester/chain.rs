//! Attestation certificate chains (Android key attestation, Apple App Attest): decoded, every
//! link's signature checked with ring; each attester matches the root against its trust anchors.
//!
//! The signature algorithms accepted are the pairs Google's and Apple's attestation chains use
//! (ECDSA P-256 and P-384 with SHA-256 or SHA-384, RSA PKCS#1 v1.5 2048-8192 bits with
//! SHA-256/384/512) and nothing else: no SHA-1, no RSA-PSS, no Ed25519. That is why the links are
//! checked here rather than with x509-parser's `verify` feature, which also accepts SHA-1 RSA.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{self, UnparsedPublicKey, VerificationAlgorithm};
use x509_parser::certificate::X509Certificate;
use x509_parser::certificate::X509CertificateParser;
use x509_parser::nom::Parser as _;
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
    OID_PKCS1_SHA256WITHRSA, OID_PKCS1_SHA384WITHRSA, OID_PKCS1_SHA512WITHRSA,
    OID_SIG_ECDSA_WITH_SHA256, OID_SIG_ECDSA_WITH_SHA384,
};

use crate::attester::FailedCheck;

/// Most certificates a chain may hold (Google's are 4 or 5 long).
pub const MAX_CERTIFICATES: usize = 10;
/// Largest certificate accepted, in DER bytes (Google's are under 1.5 KiB).
pub const MAX_CERTIFICATE_BYTES: usize = 8 * 1024;

/// The DER certificates of a PEM bundle (text around the blocks is ignored), each checked to
/// parse; an error says why, or that there is none.
pub fn pem_certificates(pem: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut certificates = Vec::new();
    for item in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let item = match item {
            Ok(item) => item,
            Err(x509_parser::error::PEMError::MissingHeader) => break,
            Err(e) => return Err(e.to_string()),
        };
        item.parse_x509().map_err(|e| e.to_string())?;
        certificates.push(item.contents);
    }
    if certificates.is_empty() {
        return Err("no CERTIFICATE block".into());
    }
    Ok(certificates)
}

/// Decodes the evidence's base64url certificates, leaf first.
pub fn decode(chain: &[String]) -> Result<Vec<Vec<u8>>, FailedCheck> {
    if !(2..=MAX_CERTIFICATES).contains(&chain.len()) {
        return Err(FailedCheck::new(
            "certificate_chain",
            format!(
                "holds {} certificates; an attestation chain holds 2 to {MAX_CERTIFICATES}, the attested key's first and the root's last",
                chain.len()
            ),
        ));
    }
    chain
        .iter()
        .enumerate()
        .map(|(i, text)| {
            if text.len() > MAX_CERTIFICATE_BYTES * 4 / 3 + 4 {
                return Err(FailedCheck::new(
                    "certificate_chain",
                    format!("certificate_chain[{i}] is larger than {MAX_CERTIFICATE_BYTES} bytes"),
                ));
            }
            URL_SAFE_NO_PAD.decode(text).map_err(|_| {
                FailedCheck::new(
                    "certificate_chain",
                    format!("certificate_chain[{i}] is not base64url without padding"),
                )
            })
        })
        .collect()
}

/// Parses every certificate, refusing trailing bytes. Extensions are left unparsed (only their
/// OIDs and raw values are read): less parser surface before anything is trusted.
pub fn parse(ders: &[Vec<u8>]) -> Result<Vec<X509Certificate<'_>>, FailedCheck> {
    let mut parser = X509CertificateParser::new().with_deep_parse_extensions(false);
    ders.iter()
        .enumerate()
        .map(|(i, der)| match parser.parse(der) {
            Ok((&[], cert)) => Ok(cert),
            _ => Err(FailedCheck::new(
                "certificate_chain",
                format!("certificate_chain[{i}] is not one DER X.509 certificate"),
            )),
        })
        .collect()
}

/// Checks that each certificate names the next as its issuer and carries its signature, from the
/// root down: after the root's key matched a trusted one, the first forged link fails at the cost
/// of one verification, whatever the chain's length.
pub fn verify_links(certs: &[X509Certificate<'_>]) -> Result<(), FailedCheck> {
    for (i, pair) in certs.windows(2).enumerate().rev() {
        let (child, parent) = (&pair[0], &pair[1]);
        if child.issuer().as_raw() != parent.subject().as_raw() {
            return Err(FailedCheck::new(
                "chain_signatures",
                format!(
                    "certificate_chain[{i}]'s issuer is not certificate_chain[{}]'s subject",
                    i + 1
                ),
            ));
        }
        verify_signature(child, parent).map_err(|reason| {
            FailedCheck::new(
                "chain_signatures",
                format!(
                    "certificate_chain[{i}] is not signed by certificate_chain[{}]: {reason}",
                    i + 1
                ),
            )
        })?;
    }
    Ok(())
}

fn verify_signature(
    child: &X509Certificate<'_>,
    parent: &X509Certificate<'_>,
) -> Result<(), String> {
    let key = parent.public_key();
    let algorithm = &child.signature_algorithm.algorithm;
    let key_type = &key.algorithm.algorithm;
    let chosen: &'static dyn VerificationAlgorithm = if *key_type == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = key
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok())
            .ok_or("the issuer's EC key names no curve")?;
        match (curve == OID_EC_P256, curve == OID_NIST_EC_P384) {
            (true, _) if *algorithm == OID_SIG_ECDSA_WITH_SHA256 => {
                &signature::ECDSA_P256_SHA256_ASN1
            }
            (true, _) if *algorithm == OID_SIG_ECDSA_WITH_SHA384 => {
                &signature::ECDSA_P256_SHA384_ASN1
            }
            (_, true) if *algorithm == OID_SIG_ECDSA_WITH_SHA256 => {
                &signature::ECDSA_P384_SHA256_ASN1
            }
            (_, true) if *algorithm == OID_SIG_ECDSA_WITH_SHA384 => {
                &signature::ECDSA_P384_SHA384_ASN1
            }
            _ => {
                return Err(format!(
                    "unsupported EC curve {curve} or algorithm {algorithm}"
                ));
            }
        }
    } else if *key_type == OID_PKCS1_RSAENCRYPTION {
        if *algorithm == OID_PKCS1_SHA256WITHRSA {
            &signature::RSA_PKCS1_2048_8192_SHA256
        } else if *algorithm == OID_PKCS1_SHA384WITHRSA {
            &signature::RSA_PKCS1_2048_8192_SHA384
        } else if *algorithm == OID_PKCS1_SHA512WITHRSA {
            &signature::RSA_PKCS1_2048_8192_SHA512
        } else {
            return Err(format!("unsupported RSA signature algorithm {algorithm}"));
        }
    } else {
        return Err(format!("unsupported key type {key_type}"));
    };
    UnparsedPublicKey::new(chosen, &key.subject_public_key.data)
        .verify(child.tbs_certificate.as_ref(), &child.signature_value.data)
        .map_err(|_| "the signature does not verify".into())
}

/// Whether `now` (Unix seconds) lies within the certificate's validity.
pub fn valid_at(cert: &X509Certificate<'_>, now: confed_protocol::clock::Seconds) -> bool {
    let validity = cert.validity();
    validity.not_before.timestamp() <= now.0 && now.0 <= validity.not_after.timestamp()
}

/// The serial as Google's revocation list keys it: lowercase hex without leading zeros.
pub fn serial_key(cert: &X509Certificate<'_>) -> String {
    let hex = confed_protocol::hex::encode(cert.raw_serial());
    let trimmed = hex.trim_start_matches('0');
    if trimmed.is_empty() {
        "0".into()
    } else {
        trimmed.into()
    }
}
