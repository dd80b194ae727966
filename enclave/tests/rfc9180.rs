#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! RFC 9180 Appendix A.1.1 (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode):
//! both HPKE implementations confed uses -- the RustCrypto `hpke` crate (devices, key services) and
//! AWS-LC (the enclave) -- must reproduce the RFC's known answers, and so must the enclave's
//! receiver over ring's AES-GCM (`Backend::Ring`, chosen on CPUs without AVX-512 VAES), which
//! must also open whatever AWS-LC sealed and refuse whatever AWS-LC refuses.

use ::hpke::Kem as _;
use ::hpke::Serializable as _;
use confed_enclave::hpke::{self, PrivateKey};
use confed_enclave::hpke_awslc::{Backend, Recipient};

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
/// The second message of the same context: sequence number 1, so its nonce is the base nonce
/// with the last bit flipped.
const AAD_1: &str = "436f756e742d31";
const CIPHERTEXT_1: &str =
    "af2d7e9ac9ae7e270f46ba1f975be53c09f8d875bdc8535458c2494e8a6eab251c03d0c22a56b8ca42c2063b84";

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

#[test]
fn both_enclave_backends_open_the_rfc_sequence() {
    let private = PrivateKey::from_bytes(&hex(SK_RM)).unwrap();
    for backend in [Backend::AwsLc, Backend::Ring] {
        let recipient = Recipient::with_backend(&private, backend).unwrap();
        let mut context = recipient.context(&hex(ENC), &hex(INFO)).unwrap();
        let first = context.open(&hex(AAD_0), &hex(CIPHERTEXT_0)).unwrap();
        assert_eq!(first.to_vec(), hex(PLAINTEXT), "{backend:?}, sequence 0");
        let second = context.open(&hex(AAD_1), &hex(CIPHERTEXT_1)).unwrap();
        assert_eq!(second.to_vec(), hex(PLAINTEXT), "{backend:?}, sequence 1");
    }
}

/// A case to refuse: its name, the encapsulated key, info, aad and ciphertext.
type Refusal = (&'static str, Vec<u8>, &'static [u8], &'static [u8], Vec<u8>);

#[test]
fn the_ring_backend_opens_what_aws_lc_sealed_in_chunks_and_refuses_what_it_refuses() {
    let (private, public) = hpke::generate_keypair();
    let ring = Recipient::with_backend(&private, Backend::Ring).unwrap();
    let aws_lc = Recipient::with_backend(&private, Backend::AwsLc).unwrap();
    let plaintext: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let chunk = 16 * 1024;
    let (enc, ciphertext) = ring_opens_what_aws_lc_sealed(&ring, &public, &plaintext, chunk);
    let mut opened = Vec::new();
    let (enc_one, one) =
        confed_enclave::hpke_awslc::seal(&public, b"info", b"aad", &plaintext).unwrap();
    ring.open_into(&enc_one, b"info", b"aad", &one, None, &mut opened)
        .unwrap();
    assert_eq!(opened, plaintext, "one piece");

    let refusals: [Refusal; 5] = [
        (
            "another info",
            enc_one.clone(),
            b"other",
            b"aad",
            one.clone(),
        ),
        (
            "another aad",
            enc_one.clone(),
            b"info",
            b"other",
            one.clone(),
        ),
        ("a flipped byte", enc_one.clone(), b"info", b"aad", {
            let mut c = one.clone();
            c[100] ^= 1;
            c
        }),
        (
            "another encapsulated key",
            enc.clone(),
            b"info",
            b"aad",
            one.clone(),
        ),
        // All zeros is a small-order point: the Diffie-Hellman output would be all zeros.
        (
            "a small-order encapsulated key",
            vec![0; 32],
            b"info",
            b"aad",
            one.clone(),
        ),
    ];
    for (case, enc, info, aad, ciphertext) in refusals {
        for (name, recipient) in [("ring", &ring), ("AWS-LC", &aws_lc)] {
            let mut out = b"earlier bytes".to_vec();
            assert!(
                recipient
                    .open_into(&enc, info, aad, &ciphertext, None, &mut out)
                    .is_err(),
                "{name} refuses {case}"
            );
            assert!(out.is_empty(), "{name} leaves nothing of {case}");
        }
    }
    // A chunked message with its last chunk cut off fails on both.
    let cut = &ciphertext[..ciphertext.len() - 100];
    for recipient in [&ring, &aws_lc] {
        assert!(
            recipient
                .open_into(&enc, b"info", b"aad", cut, Some(chunk), &mut opened)
                .is_err()
        );
    }
}

#[test]
fn the_ring_backend_counts_sequence_numbers_past_one_byte_and_not_on_failure() {
    let (private, public) = hpke::generate_keypair();
    let ring = Recipient::with_backend(&private, Backend::Ring).unwrap();
    // 300 chunks of the smallest size: sequence numbers 0 to 299 cross a byte boundary.
    let chunk = confed_enclave::hpke::MIN_CHUNK;
    let plaintext: Vec<u8> = (0..300 * chunk as u32).map(|i| (i % 253) as u8).collect();
    ring_opens_what_aws_lc_sealed(&ring, &public, &plaintext, chunk);

    // A refused open leaves the context's sequence number where it was.
    let private = PrivateKey::from_bytes(&hex(SK_RM)).unwrap();
    let recipient = Recipient::with_backend(&private, Backend::Ring).unwrap();
    let mut context = recipient.context(&hex(ENC), &hex(INFO)).unwrap();
    assert!(context.open(&hex(AAD_1), &hex(CIPHERTEXT_0)).is_err());
    let first = context.open(&hex(AAD_0), &hex(CIPHERTEXT_0)).unwrap();
    assert_eq!(first.to_vec(), hex(PLAINTEXT));
    let second = context.open(&hex(AAD_1), &hex(CIPHERTEXT_1)).unwrap();
    assert_eq!(second.to_vec(), hex(PLAINTEXT));
}

/// Seals `plaintext` in chunks of `chunk` with AWS-LC and checks that `ring` opens it whole;
/// returns the encapsulated key and the ciphertext.
fn ring_opens_what_aws_lc_sealed(
    ring: &Recipient,
    public: &hpke::PublicKey,
    plaintext: &[u8],
    chunk: usize,
) -> (Vec<u8>, Vec<u8>) {
    let (enc, ciphertext) =
        confed_enclave::hpke_awslc::seal_chunked(public, b"info", b"aad", plaintext, chunk)
            .unwrap();
    let mut opened = Vec::new();
    ring.open_into(&enc, b"info", b"aad", &ciphertext, Some(chunk), &mut opened)
        .unwrap();
    assert_eq!(
        opened,
        plaintext,
        "{} chunks",
        plaintext.len().div_ceil(chunk)
    );
    (enc, ciphertext)
}
