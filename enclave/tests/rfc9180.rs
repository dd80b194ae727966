#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! RFC 9180 Appendix A.1.1 (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode):
//! both HPKE implementations confed uses -- the RustCrypto `hpke` crate (devices, key services) and
//! AWS-LC (the enclave) -- must reproduce the RFC's known answers.

use ::hpke::Kem as _;
use ::hpke::Serializable as _;
use confed_enclave::hpke::{self, PrivateKey};
use confed_enclave::hpke_awslc::Recipient;

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

const IKM_R: &str = "6db9df30aa07dd42ee5e8181afdb977e538f5e1fec8a06223f33f7013e525037";
const SK_RM: &str = "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8";
const PK_RM: &str = "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d";
const ENC: &str = "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431";
const INFO: &str = "4f6465206f6e2061204772656369616e2055726e";
const PLAINTEXT: &str = "4265617574792069732074727574682c20747275746820626561757479";
const AAD_0: &str = "436f756e742d30";
const CIPHERTEXT_0: &str =
    "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a";

#[test]
fn recipient_key_derivation_matches_the_rfc() {
    let (private, public) = ::hpke::kem::X25519HkdfSha256::derive_keypair(&hex(IKM_R));
    // The hpke crate stores X25519 scalars clamped (RFC 7748); the RFC lists the raw bytes.
    let mut clamped = hex(SK_RM);
    clamped[0] &= 248;
    clamped[31] &= 127;
    clamped[31] |= 64;
    assert_eq!(private.to_bytes().to_vec(), clamped);
    assert_eq!(public.to_bytes().to_vec(), hex(PK_RM));
    let ours = PrivateKey::from_bytes(&hex(SK_RM)).unwrap();
    assert_eq!(ours.public_key().unwrap().0.to_vec(), hex(PK_RM));
}

#[test]
fn both_implementations_open_the_rfc_ciphertext() {
    let private = PrivateKey::from_bytes(&hex(SK_RM)).unwrap();
    let rustcrypto = hpke::open(
        &private,
        &hex(ENC),
        &hex(INFO),
        &hex(AAD_0),
        &hex(CIPHERTEXT_0),
    )
    .unwrap();
    assert_eq!(rustcrypto.to_vec(), hex(PLAINTEXT));
    let awslc = Recipient::new(&private)
        .unwrap()
        .open(&hex(ENC), &hex(INFO), &hex(AAD_0), &hex(CIPHERTEXT_0))
        .unwrap();
    assert_eq!(awslc.to_vec(), hex(PLAINTEXT));
}
