//! App Attest evidence of the real shape under a test root: credential certificate (with the nonce
//! extension) <- intermediate ("App Attestation CA 1", P-384) <- root (P-384), the root left out
//! of `x5c` as Apple leaves it out. Each field the attester checks can be set, so every refusal has
//! evidence that differs from an accepted one in that field alone.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ciborium::Value;
use confed_issuer::attester::Evidence;
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DistinguishedName, DnType, IsCa, Issuer,
    KeyPair, date_time_ymd,
};
use ring::rand::SystemRandom;
use ring::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair as _};
use sha2::{Digest, Sha256};

pub(crate) const NONCE_OID: &[u64] = &[1, 2, 840, 113_635, 100, 8, 2];
pub(crate) const APP_ID: &str = "A1B2C3D4E5.com.example.fl";

/// A device's App Attest key (a Secure Enclave key, here a software one).
pub(crate) struct TestDevice {
    pkcs8: Vec<u8>,
    pub key_id: [u8; 32],
}

impl TestDevice {
    pub(crate) fn new() -> Self {
        let pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &SystemRandom::new())
                .unwrap()
                .as_ref()
                .to_vec();
        let pair = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_ASN1_SIGNING,
            &pkcs8,
            &SystemRandom::new(),
        )
        .unwrap();
        let key_id = Sha256::digest(pair.public_key().as_ref()).into();
        Self { pkcs8, key_id }
    }

    fn pair(&self) -> EcdsaKeyPair {
        EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_ASN1_SIGNING,
            &self.pkcs8,
            &SystemRandom::new(),
        )
        .unwrap()
    }

    fn point(&self) -> Vec<u8> {
        self.pair().public_key().as_ref().to_vec()
    }

    /// An assertion over `client_data_hash`, as `generateAssertion` makes it.
    pub(crate) fn assertion(
        &self,
        client_data_hash: &[u8; 32],
        app_id: &str,
        counter: u32,
    ) -> Vec<u8> {
        let mut auth_data = Sha256::digest(app_id.as_bytes()).to_vec();
        auth_data.push(0x40);
        auth_data.extend(counter.to_be_bytes());
        let nonce = Sha256::new()
            .chain_update(&auth_data)
            .chain_update(client_data_hash)
            .finalize();
        let signature = self.pair().sign(&SystemRandom::new(), &nonce).unwrap();
        cbor(&Value::Map(vec![
            (text("signature"), Value::Bytes(signature.as_ref().to_vec())),
            (text("authenticatorData"), Value::Bytes(auth_data)),
        ]))
    }
}

fn text(s: &str) -> Value {
    Value::Text(s.into())
}

pub(crate) fn cbor(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    ciborium::into_writer(value, &mut out).unwrap();
    out
}

/// The attestation's shape, field by field.
#[derive(Debug, Clone)]
pub(crate) struct AttestationSpec {
    pub fmt: String,
    pub app_id: String,
    pub flags: u8,
    pub counter: u32,
    pub aaguid: [u8; 16],
    /// The credential id in authData (the key id when `None`).
    pub credential_id: Option<Vec<u8>>,
    /// The nonce the certificate states (the right one when `None`).
    pub nonce: Option<[u8; 32]>,
    pub nonce_extensions: usize,
    pub credential_valid: ((i32, u8, u8), (i32, u8, u8)),
    /// Leave the intermediate out of `x5c`.
    pub without_intermediate: bool,
    /// Append the map Apple has put after the COSE key since 2026.
    pub trailing_map: bool,
    /// Cut the authenticator data short (after its head and the AAGUID).
    pub truncated: bool,
}

impl AttestationSpec {
    pub(crate) fn genuine() -> Self {
        Self {
            fmt: "apple-appattest".into(),
            app_id: APP_ID.into(),
            flags: 0x40,
            counter: 0,
            aaguid: *b"appattest\0\0\0\0\0\0\0",
            credential_id: None,
            nonce: None,
            nonce_extensions: 1,
            credential_valid: ((2026, 5, 30), (2026, 6, 2)),
            without_intermediate: false,
            trailing_map: true,
            truncated: false,
        }
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::CommonName, common_name);
    name.push(DnType::OrganizationName, "Test Inc.");
    name
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.not_before = date_time_ymd(2025, 1, 1);
    params.not_after = date_time_ymd(2035, 1, 1);
    params
}

/// A test "Apple": its root and intermediate.
pub(crate) struct TestApple {
    pub root_pem: String,
    intermediate: Issuer<'static, KeyPair>,
    intermediate_der: Vec<u8>,
}

impl TestApple {
    pub(crate) fn new() -> Self {
        let root_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let root_params = ca_params("Test App Attestation Root CA");
        let root_cert = root_params.self_signed(&root_key).unwrap();
        let root = Issuer::new(root_params, root_key);
        let intermediate_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let intermediate_params = ca_params("Test App Attestation CA 1");
        let intermediate_cert = intermediate_params
            .signed_by(&intermediate_key, &root)
            .unwrap();
        Self {
            root_pem: root_cert.pem(),
            intermediate: Issuer::new(intermediate_params, intermediate_key),
            intermediate_der: intermediate_cert.der().to_vec(),
        }
    }

    /// The attestation object `attestKey` would return for `device` over `client_data_hash`.
    pub(crate) fn attestation(
        &self,
        device: &TestDevice,
        client_data_hash: &[u8; 32],
        spec: &AttestationSpec,
    ) -> Vec<u8> {
        let point = device.point();
        let credential_id = spec
            .credential_id
            .clone()
            .unwrap_or_else(|| device.key_id.to_vec());
        let mut auth_data = Sha256::digest(spec.app_id.as_bytes()).to_vec();
        auth_data.push(spec.flags);
        auth_data.extend(spec.counter.to_be_bytes());
        auth_data.extend(spec.aaguid);
        auth_data.extend(u16::try_from(credential_id.len()).unwrap().to_be_bytes());
        auth_data.extend(&credential_id);
        auth_data.extend(cbor(&Value::Map(vec![
            (Value::from(1), Value::from(2)),
            (Value::from(3), Value::from(-7)),
            (Value::from(-1), Value::from(1)),
            (Value::from(-2), Value::Bytes(point[1..33].to_vec())),
            (Value::from(-3), Value::Bytes(point[33..].to_vec())),
        ])));
        if spec.trailing_map {
            auth_data.extend(cbor(&Value::Map(vec![(
                text("apple_bundle_version_01"),
                text("1"),
            )])));
        }
        if spec.truncated {
            auth_data.truncate(53);
        }
        let nonce = spec.nonce.unwrap_or_else(|| {
            Sha256::new()
                .chain_update(&auth_data)
                .chain_update(client_data_hash)
                .finalize()
                .into()
        });
        let mut params = CertificateParams::default();
        params.distinguished_name = name(&confed_protocol::hex::encode(device.key_id));
        let ((y0, m0, d0), (y1, m1, d1)) = spec.credential_valid;
        params.not_before = date_time_ymd(y0, m0, d0);
        params.not_after = date_time_ymd(y1, m1, d1);
        let extension = [&[0x30, 0x24, 0xa1, 0x22, 0x04, 0x20][..], &nonce].concat();
        for _ in 0..spec.nonce_extensions {
            params
                .custom_extensions
                .push(CustomExtension::from_oid_content(
                    NONCE_OID,
                    extension.clone(),
                ));
        }
        let key = KeyPair::try_from(device.pkcs8.as_slice()).unwrap();
        let credential = params.signed_by(&key, &self.intermediate).unwrap();
        let mut x5c = vec![Value::Bytes(credential.der().to_vec())];
        if !spec.without_intermediate {
            x5c.push(Value::Bytes(self.intermediate_der.clone()));
        }
        cbor(&Value::Map(vec![
            (text("fmt"), text(&spec.fmt)),
            (
                text("attStmt"),
                Value::Map(vec![
                    (text("x5c"), Value::Array(x5c)),
                    (text("receipt"), Value::Bytes(vec![0x30, 0x80])),
                ]),
            ),
            (text("authData"), Value::Bytes(auth_data)),
        ]))
    }
}

pub(crate) fn attestation_evidence(key_id: &[u8], object: &[u8]) -> Evidence {
    Evidence::AppleAppAttest {
        key_id: URL_SAFE_NO_PAD.encode(key_id),
        attestation: Some(URL_SAFE_NO_PAD.encode(object)),
        assertion: None,
    }
}

pub(crate) fn assertion_evidence(key_id: &[u8], assertion: &[u8]) -> Evidence {
    Evidence::AppleAppAttest {
        key_id: URL_SAFE_NO_PAD.encode(key_id),
        attestation: None,
        assertion: Some(URL_SAFE_NO_PAD.encode(assertion)),
    }
}
