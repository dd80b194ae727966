//! The enclave's HPKE receiver with ring's AES-128-GCM: the same suite and construction as
//! `hpke_awslc` (RFC 9180 base mode, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM), for
//! CPUs where ring's AEAD is the faster one.
//!
//! Why a second receiver: AWS-LC (0.47) has AES-GCM for AVX-512 with VAES and the older AVX
//! code, but none for VAES on AVX2 (AMD Zen 3, the EPYC Milan behind N2D Confidential VMs; Intel
//! client parts). ring (0.17) has that one from BoringSSL. On the AVX2 + VAES VM of
//! docs/performance.md, ring opens 1 MB at 5.1-5.6 GB/s and AWS-LC's HPKE at 3.5-3.7 (the
//! aggregation bench's first summary line), and the AEAD is the largest share of the
//! aggregation loop. `Backend::for_this_cpu` picks one per
//! process.
//!
//! Only the AEAD is ring's. The key schedule is RFC 9180's, over AWS-LC's X25519 and HKDF
//! (section 4, 5.1 and 7.1): nothing of HPKE is reimplemented beyond the labels, and
//! `tests/rfc9180.rs` checks it against the RFC's known answers and against AWS-LC's HPKE.
//! Secrets (the private key, the Diffie-Hellman output, the derived secrets, the AEAD key and
//! nonce) live in `Zeroizing` buffers; ring's expanded AES key schedule is not wiped when a
//! context is dropped (ring offers no way to), a residual noted in docs/threat-model.md.

use aws_lc_sys as lc;
use ring::aead::{AES_128_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use zeroize::Zeroizing;

use crate::hpke::HpkeError;

/// `suite_id` of the KEM: "KEM" || I2OSP(0x0020, 2) (DHKEM(X25519, HKDF-SHA256)).
const KEM_SUITE: &[u8] = b"KEM\x00\x20";
/// `suite_id` of the HPKE suite: "HPKE" || kem_id || kdf_id (HKDF-SHA256, 0x0001) || aead_id
/// (AES-128-GCM, 0x0001).
const HPKE_SUITE: &[u8] = b"HPKE\x00\x20\x00\x01\x00\x01";
const VERSION_LABEL: &[u8] = b"HPKE-v1";
/// X25519 keys and shared secrets, and SHA-256 outputs.
const LEN: usize = 32;
/// AES-128-GCM's key.
const KEY_LEN: usize = 16;

/// Which AES-GCM opens contributions in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// AWS-LC's HPKE: its AVX-512 AES-GCM where the CPU has it, and on non-x86 CPUs.
    AwsLc,
    /// ring's AES-GCM after the key schedule here: x86-64 without AVX-512 VAES.
    Ring,
}

impl Backend {
    /// AWS-LC where its AES-GCM is at least ring's (AVX-512F with VAES and VPCLMULQDQ on
    /// x86-64, and every other architecture, as before), ring on other x86-64 CPUs.
    pub fn for_this_cpu() -> Self {
        static CHOSEN: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx512_vaes = std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("vaes")
                    && std::arch::is_x86_feature_detected!("vpclmulqdq");
                if !avx512_vaes {
                    return Backend::Ring;
                }
            }
            Backend::AwsLc
        })
    }
}

/// A recipient's X25519 key pair, for the key schedule.
pub(crate) struct RingKey {
    private: Zeroizing<[u8; LEN]>,
    public: [u8; LEN],
}

impl RingKey {
    pub(crate) fn new(private: &[u8]) -> Result<Self, HpkeError> {
        if private.len() != LEN {
            return Err(HpkeError::BadKey("private key"));
        }
        // Copied straight into its wiped home: no unwiped array on the way.
        let mut key = Zeroizing::new([0u8; LEN]);
        key.copy_from_slice(private);
        let private = key;
        let mut public = [0u8; LEN];
        // SAFETY: both pointers describe live 32-byte buffers, as X25519_public_from_private
        // requires.
        unsafe { lc::X25519_public_from_private(public.as_mut_ptr(), private.as_ptr()) };
        Ok(Self { private, public })
    }

    /// RFC 9180 `SetupBaseR(enc, skR, info)`: `Decap` (4.1, 7.1), then `KeyScheduleR` in base
    /// mode (5.1).
    pub(crate) fn context(&self, enc: &[u8], info: &[u8]) -> Result<RingContext, HpkeError> {
        let enc: &[u8; LEN] = enc.try_into().map_err(|_| HpkeError::Open)?;
        let mut dh = Zeroizing::new([0u8; LEN]);
        // SAFETY: all three pointers describe live 32-byte buffers. X25519 returns 0 for an
        // all-zero output (a small-order `enc`), which RFC 9180 7.1.4 says to refuse.
        let ok = unsafe { lc::X25519(dh.as_mut_ptr(), self.private.as_ptr(), enc.as_ptr()) };
        if ok != 1 {
            return Err(HpkeError::Open);
        }
        // ExtractAndExpand(dh, kem_context = enc || pkR)
        let eae_prk = labeled_extract(KEM_SUITE, &[], b"eae_prk", &[&dh[..]])?;
        let mut shared_secret = Zeroizing::new([0u8; LEN]);
        labeled_expand(
            KEM_SUITE,
            &eae_prk,
            b"shared_secret",
            &[enc, &self.public],
            &mut shared_secret[..],
        )?;
        // KeySchedule(mode_base, shared_secret, info, psk = "", psk_id = "")
        let psk_id_hash = psk_id_hash()?;
        let info_hash = labeled_extract(HPKE_SUITE, &[], b"info_hash", &[info])?;
        let mut context = [0u8; 1 + 2 * LEN];
        context[1..1 + LEN].copy_from_slice(&psk_id_hash[..]);
        context[1 + LEN..].copy_from_slice(&info_hash[..]);
        let secret = labeled_extract(HPKE_SUITE, &shared_secret[..], b"secret", &[])?;
        let mut key = Zeroizing::new([0u8; KEY_LEN]);
        labeled_expand(HPKE_SUITE, &secret, b"key", &[&context], &mut key[..])?;
        let mut base_nonce = Zeroizing::new([0u8; NONCE_LEN]);
        labeled_expand(
            HPKE_SUITE,
            &secret,
            b"base_nonce",
            &[&context],
            &mut base_nonce[..],
        )?;
        let key = UnboundKey::new(&AES_128_GCM, &key[..]).map_err(|_| HpkeError::Open)?;
        Ok(RingContext {
            key: LessSafeKey::new(key),
            base_nonce,
            sequence: 0,
        })
    }
}

/// `LabeledExtract("", "psk_id_hash", "")`: the same for every context of base mode, so computed
/// once per process rather than once per contribution.
fn psk_id_hash() -> Result<[u8; LEN], HpkeError> {
    static HASH: std::sync::OnceLock<Option<[u8; LEN]>> = std::sync::OnceLock::new();
    HASH.get_or_init(|| {
        labeled_extract(HPKE_SUITE, &[], b"psk_id_hash", &[])
            .ok()
            .map(|hash| *hash)
    })
    .ok_or(HpkeError::Open)
}

/// One receiving context: opens a sequence of ciphertexts sealed by one sender context.
pub(crate) struct RingContext {
    key: LessSafeKey,
    base_nonce: Zeroizing<[u8; NONCE_LEN]>,
    sequence: u64,
}

impl RingContext {
    /// Opens the next ciphertext of the sequence and appends its plaintext to `out` (the
    /// ciphertext is copied there and decrypted in place: ring decrypts only in place). On
    /// failure `out` keeps its length; what was written past it is the caller's to wipe.
    pub(crate) fn open_append(
        &mut self,
        aad: &[u8],
        ciphertext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HpkeError> {
        // RFC 9180 5.2: a sequence number may not wrap (AWS-LC refuses at the last one too).
        if self.sequence == u64::MAX {
            return Err(HpkeError::Open);
        }
        let start = out.len();
        out.extend_from_slice(ciphertext);
        let opened = self
            .key
            .open_in_place(self.nonce(), Aad::from(aad), &mut out[start..])
            .map(|plain| plain.len());
        match opened {
            Ok(length) => {
                out.truncate(start + length);
                self.sequence += 1;
                Ok(())
            }
            Err(_) => {
                out.truncate(start);
                Err(HpkeError::Open)
            }
        }
    }

    /// RFC 9180 5.2 `ComputeNonce(seq)`: the base nonce XOR the sequence number, big-endian.
    fn nonce(&self) -> Nonce {
        let mut nonce = Zeroizing::new(*self.base_nonce);
        let sequence = self.sequence.to_be_bytes();
        for (byte, seq) in nonce[NONCE_LEN - sequence.len()..].iter_mut().zip(sequence) {
            *byte ^= seq;
        }
        Nonce::assume_unique_for_key(*nonce)
    }
}

/// RFC 9180 4: `LabeledExtract(salt, label, ikm)` = HKDF-Extract(salt, "HPKE-v1" || suite_id ||
/// label || ikm), with `ikm` given in parts.
fn labeled_extract(
    suite: &[u8],
    salt: &[u8],
    label: &[u8],
    ikm: &[&[u8]],
) -> Result<Zeroizing<[u8; LEN]>, HpkeError> {
    let mut input = Zeroizing::new(Vec::with_capacity(64));
    input.extend_from_slice(VERSION_LABEL);
    input.extend_from_slice(suite);
    input.extend_from_slice(label);
    for part in ikm {
        input.extend_from_slice(part);
    }
    let mut prk = Zeroizing::new([0u8; LEN]);
    let mut written = 0usize;
    // SAFETY: `prk` has room for SHA-256's 32 bytes, the most HKDF_extract writes (it reports
    // how many in `written`); the other pointers and lengths describe live slices.
    let ok = unsafe {
        lc::HKDF_extract(
            prk.as_mut_ptr(),
            &mut written,
            lc::EVP_sha256(),
            input.as_ptr(),
            input.len(),
            salt.as_ptr(),
            salt.len(),
        )
    };
    if ok != 1 || written != LEN {
        return Err(HpkeError::Open);
    }
    Ok(prk)
}

/// RFC 9180 4: `LabeledExpand(prk, label, info, L)` = HKDF-Expand(prk, I2OSP(L, 2) ||
/// "HPKE-v1" || suite_id || label || info, L), `L` being `out`'s length, `info` in parts.
fn labeled_expand(
    suite: &[u8],
    prk: &[u8; LEN],
    label: &[u8],
    info: &[&[u8]],
    out: &mut [u8],
) -> Result<(), HpkeError> {
    let length = u16::try_from(out.len()).map_err(|_| HpkeError::Open)?;
    let mut labeled = Vec::with_capacity(128);
    labeled.extend_from_slice(&length.to_be_bytes());
    labeled.extend_from_slice(VERSION_LABEL);
    labeled.extend_from_slice(suite);
    labeled.extend_from_slice(label);
    for part in info {
        labeled.extend_from_slice(part);
    }
    // SAFETY: `out` is a live buffer of `out.len()` bytes, which HKDF_expand fills exactly; the
    // other pointers and lengths describe live slices.
    let ok = unsafe {
        lc::HKDF_expand(
            out.as_mut_ptr(),
            out.len(),
            lc::EVP_sha256(),
            prk.as_ptr(),
            prk.len(),
            labeled.as_ptr(),
            labeled.len(),
        )
    };
    if ok != 1 {
        return Err(HpkeError::Open);
    }
    Ok(())
}
