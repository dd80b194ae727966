//! Android key attestation chains of the real shape, under a test root: leaf (with the key
//! description extension) <- RKP attestation key (with Google's provisioning-info extension) <-
//! intermediate ("Droid CA") <- root. Each field the attester checks can be set, so every refusal
//! has a chain that differs from an accepted one in that field alone.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DistinguishedName, DnType, IsCa, Issuer,
    KeyPair, date_time_ymd,
};

pub(crate) const KEY_DESCRIPTION_OID: &[u64] = &[1, 3, 6, 1, 4, 1, 11129, 2, 1, 17];
pub(crate) const PROVISIONING_INFO_OID: &[u64] = &[1, 3, 6, 1, 4, 1, 11129, 2, 1, 30];

pub(crate) const PACKAGE: &str = "com.example.fl";
pub(crate) const SIGNATURE_DIGEST: [u8; 32] = [0x5a; 32];

/// Unix seconds inside every generated certificate's validity: 2026-06-01.
pub(crate) fn now() -> confed_protocol::clock::Seconds {
    confed_protocol::clock::Seconds(date_time_ymd(2026, 6, 1).unix_timestamp())
}

/// The key description's fields, as a TEE would state them.
#[derive(Debug, Clone)]
pub(crate) struct Description {
    pub attestation_level: u8,
    pub keymint_level: u8,
    pub challenge: Vec<u8>,
    pub boot_state: u8,
    pub locked_byte: u8,
    pub packages: Vec<String>,
    pub digests: Vec<[u8; 32]>,
    pub os_patch_level: u32,
    /// Where the root of trust sits: the hardware-enforced list (true) or the software one.
    pub root_of_trust_in_hardware_list: bool,
    pub duplicate_root_of_trust: bool,
    pub with_application_id: bool,
    pub with_os_patch_level: bool,
}

impl Description {
    pub(crate) fn genuine(challenge: &[u8]) -> Self {
        Self {
            attestation_level: 1,
            keymint_level: 1,
            challenge: challenge.to_vec(),
            boot_state: 0,
            locked_byte: 0xff,
            packages: vec![PACKAGE.into()],
            digests: vec![SIGNATURE_DIGEST],
            os_patch_level: 202_605,
            root_of_trust_in_hardware_list: true,
            duplicate_root_of_trust: false,
            with_application_id: true,
            with_os_patch_level: true,
        }
    }

    pub(crate) fn der(&self) -> Vec<u8> {
        let root_of_trust = tlv(
            0x30,
            &[
                tlv(0x04, &[0u8; 32]),
                tlv(0x01, &[self.locked_byte]),
                tlv(0x0a, &[self.boot_state]),
                tlv(0x04, &[7u8; 32]),
            ]
            .concat(),
        );
        let package_infos: Vec<u8> = self
            .packages
            .iter()
            .flat_map(|p| tlv(0x30, &[tlv(0x04, p.as_bytes()), tlv(0x02, &[1])].concat()))
            .collect();
        let digests: Vec<u8> = self.digests.iter().flat_map(|d| tlv(0x04, d)).collect();
        let application_id = tlv(
            0x30,
            &[tlv(0x31, &package_infos), tlv(0x31, &digests)].concat(),
        );
        let mut rot_entries = explicit(704, &root_of_trust);
        if self.duplicate_root_of_trust {
            let mut unlocked = Description {
                locked_byte: 0,
                boot_state: 2,
                ..self.clone()
            };
            unlocked.duplicate_root_of_trust = false;
            rot_entries.extend(explicit(704, &unlocked.root_of_trust_only()));
        }
        let patch = self.os_patch_level.to_be_bytes();
        let patch_entry = if self.with_os_patch_level {
            explicit(706, &tlv(0x02, &patch[1..]))
        } else {
            Vec::new()
        };
        let application_entry = if self.with_application_id {
            explicit(709, &tlv(0x04, &application_id))
        } else {
            Vec::new()
        };
        let hardware_common = [
            explicit(1, &tlv(0x31, &tlv(0x02, &[2]))),
            explicit(2, &tlv(0x02, &[3])),
        ]
        .concat();
        let (software, hardware) = if self.root_of_trust_in_hardware_list {
            (
                application_entry,
                [hardware_common, rot_entries, patch_entry].concat(),
            )
        } else {
            (
                [rot_entries, application_entry].concat(),
                [hardware_common, patch_entry].concat(),
            )
        };
        tlv(
            0x30,
            &[
                tlv(0x02, &[0x01, 0x90]),
                tlv(0x0a, &[self.attestation_level]),
                tlv(0x02, &[0x01, 0x90]),
                tlv(0x0a, &[self.keymint_level]),
                tlv(0x04, &self.challenge),
                tlv(0x04, &[]),
                tlv(0x30, &software),
                tlv(0x30, &hardware),
            ]
            .concat(),
        )
    }

    fn root_of_trust_only(&self) -> Vec<u8> {
        tlv(
            0x30,
            &[
                tlv(0x04, &[0u8; 32]),
                tlv(0x01, &[self.locked_byte]),
                tlv(0x0a, &[self.boot_state]),
                tlv(0x04, &[7u8; 32]),
            ]
            .concat(),
        )
    }
}

fn length(len: usize) -> Vec<u8> {
    if len < 0x80 {
        vec![len as u8]
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|&b| b == 0)
            .collect();
        [vec![0x80 | bytes.len() as u8], bytes].concat()
    }
}

fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    [vec![tag], length(content.len()), content.to_vec()].concat()
}

/// `[tag] EXPLICIT`, in the high-tag-number form for tags above 30.
fn explicit(tag: u32, content: &[u8]) -> Vec<u8> {
    let mut out = if tag < 31 {
        vec![0xa0 | tag as u8]
    } else {
        let mut groups = vec![(tag & 0x7f) as u8];
        let mut rest = tag >> 7;
        while rest > 0 {
            groups.push(0x80 | (rest & 0x7f) as u8);
            rest >>= 7;
        }
        groups.reverse();
        [vec![0xbf], groups].concat()
    };
    out.extend(length(content.len()));
    out.extend_from_slice(content);
    out
}

/// The chain's shape, field by field.
#[derive(Debug, Clone)]
pub(crate) struct ChainSpec {
    pub description: Description,
    /// Put Google's provisioning-info extension on the attestation key's certificate (RKP).
    pub remotely_provisioned: bool,
    /// Also put a key description on the attestation key's certificate.
    pub description_on_attestation_key: bool,
    /// The attestation key's certificate validity, as (year, month, day) pairs.
    pub attestation_key_valid: ((i32, u8, u8), (i32, u8, u8)),
    pub attestation_key_serial: Vec<u8>,
    /// Key descriptions on the leaf (1 in a genuine chain).
    pub leaf_descriptions: usize,
    pub leaf_valid: ((i32, u8, u8), (i32, u8, u8)),
}

impl ChainSpec {
    pub(crate) fn genuine(challenge: &[u8]) -> Self {
        Self {
            description: Description::genuine(challenge),
            remotely_provisioned: true,
            description_on_attestation_key: false,
            attestation_key_valid: ((2026, 5, 25), (2026, 6, 8)),
            attestation_key_serial: vec![0x2c, 0x85, 0xcd, 0xc1],
            leaf_descriptions: 1,
            leaf_valid: ((1970, 1, 1), (2048, 1, 1)),
        }
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "Test LLC");
    name.push(DnType::CommonName, common_name);
    name
}

fn ca_params(common_name: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.not_before = date_time_ymd(2025, 1, 1);
    params.not_after = date_time_ymd(2035, 1, 1);
    params
}

/// A test PKI: the root and the intermediate, reused across chains (and an attestation key per
/// `attestation_key`, so two chains from one "device" share it).
pub(crate) struct TestPki {
    pub root_pem: String,
    root_der: Vec<u8>,
    intermediate: Issuer<'static, KeyPair>,
    intermediate_der: Vec<u8>,
}

impl TestPki {
    pub(crate) fn new() -> Self {
        Self::with_intermediate_valid((2025, 1, 1), (2035, 1, 1))
    }

    /// A PKI whose intermediate ("Droid CA3") is valid between two (year, month, day) dates.
    pub(crate) fn with_intermediate_valid(
        (y0, m0, d0): (i32, u8, u8),
        (y1, m1, d1): (i32, u8, u8),
    ) -> Self {
        let root_key = KeyPair::generate().unwrap();
        let root_params = ca_params("Test Attestation Root");
        let root_cert = root_params.self_signed(&root_key).unwrap();
        let root = Issuer::new(root_params, root_key);
        let intermediate_key = KeyPair::generate().unwrap();
        let mut intermediate_params = ca_params("Droid CA3");
        intermediate_params.not_before = date_time_ymd(y0, m0, d0);
        intermediate_params.not_after = date_time_ymd(y1, m1, d1);
        let intermediate_cert = intermediate_params
            .signed_by(&intermediate_key, &root)
            .unwrap();
        Self {
            root_pem: root_cert.pem(),
            root_der: root_cert.der().to_vec(),
            intermediate: Issuer::new(intermediate_params, intermediate_key),
            intermediate_der: intermediate_cert.der().to_vec(),
        }
    }

    /// A chain made by `device` (its attestation key) to `spec`, leaf first, as base64url DER.
    pub(crate) fn chain(&self, device: &KeyPair, spec: &ChainSpec) -> Vec<String> {
        let mut key_params = CertificateParams::default();
        key_params.distinguished_name = name("2c85cdc15c3042f25698906669c35137");
        key_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ((y0, m0, d0), (y1, m1, d1)) = spec.attestation_key_valid;
        key_params.not_before = date_time_ymd(y0, m0, d0);
        key_params.not_after = date_time_ymd(y1, m1, d1);
        key_params.serial_number = Some(spec.attestation_key_serial.clone().into());
        if spec.remotely_provisioned {
            // CBOR {1: 64, 3: "Google"}, as Google's RKP server writes it.
            let info = [&[0xa2, 0x01, 0x18, 0x40, 0x03, 0x66][..], b"Google"].concat();
            key_params
                .custom_extensions
                .push(CustomExtension::from_oid_content(
                    PROVISIONING_INFO_OID,
                    info,
                ));
        }
        if spec.description_on_attestation_key {
            key_params
                .custom_extensions
                .push(CustomExtension::from_oid_content(
                    KEY_DESCRIPTION_OID,
                    spec.description.der(),
                ));
        }
        let key_cert = key_params.signed_by(device, &self.intermediate).unwrap();
        let attestation_key = Issuer::from_params(&key_params, device);

        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf_params = CertificateParams::default();
        leaf_params.distinguished_name = DistinguishedName::new();
        leaf_params
            .distinguished_name
            .push(DnType::CommonName, "Android Keystore Key");
        let ((y0, m0, d0), (y1, m1, d1)) = spec.leaf_valid;
        leaf_params.not_before = date_time_ymd(y0, m0, d0);
        leaf_params.not_after = date_time_ymd(y1, m1, d1);
        for _ in 0..spec.leaf_descriptions {
            leaf_params
                .custom_extensions
                .push(CustomExtension::from_oid_content(
                    KEY_DESCRIPTION_OID,
                    spec.description.der(),
                ));
        }
        let leaf = leaf_params.signed_by(&leaf_key, &attestation_key).unwrap();
        [
            leaf.der().to_vec(),
            key_cert.der().to_vec(),
            self.intermediate_der.clone(),
            self.root_der.clone(),
        ]
        .iter()
        .map(|der| URL_SAFE_NO_PAD.encode(der))
        .collect()
    }
}

/// A PEM chain file (leaf first), as base64url DER strings.
pub(crate) fn chain_from_pem(pem: &str) -> Vec<String> {
    pem.split("-----END CERTIFICATE-----")
        .filter_map(|block| block.split("-----BEGIN CERTIFICATE-----").nth(1))
        .map(|body| {
            let der = base64::engine::general_purpose::STANDARD
                .decode(body.split_whitespace().collect::<String>())
                .unwrap();
            URL_SAFE_NO_PAD.encode(der)
        })
        .collect()
}
