//! The enclave's HPKE receiver, over AWS-LC's HPKE (`EVP_HPKE_*`): the same suite as `hpke.rs`
//! (DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, base mode) at about twice the speed of
//! the RustCrypto `hpke` crate on AES-NI hardware (measured in `benches/hpke.rs`), so opening
//! contributions runs near the AES-GCM bound. Devices seal here too (`SealContext`, `seal`,
//! `seal_chunked`): X25519 in AWS-LC costs a device (and the load generator) about half of what
//! it costs in RustCrypto. Key services seal their shares with the `hpke` crate; tests check that
//! each implementation opens what the other sealed, and the RustCrypto one against RFC 9180.
//!
//! Opening uses AWS-LC's AES-GCM or ring's, whichever is faster on the CPU (`hpke_ring`,
//! `Backend::for_this_cpu`); the key and both contexts are this module's either way.
//!
//! This and `hpke_ring` are the enclave's only `unsafe` FFI (the AVX2 loops of
//! `aggregate/quantize.rs` are its other `unsafe` code): a small wrapper whose every call checks AWS-LC's
//! return value, owns its C objects (freed, and by AWS-LC cleansed, on drop) and bounds every
//! buffer by the lengths AWS-LC is told.

use aws_lc_sys as lc;
use zeroize::Zeroizing;

use crate::hpke::{HpkeError, PrivateKey, PublicKey};
pub use crate::hpke_ring::Backend;
use crate::hpke_ring::{RingContext, RingKey};

/// A recipient key loaded into AWS-LC, and kept for the ring receiver (`hpke_ring`) where that
/// one opens. Immutable after creation, so shareable across threads.
pub struct Recipient {
    key: *mut lc::EVP_HPKE_KEY,
    /// The key pair again for ring's receiver; `None` where AWS-LC opens (no second copy of the
    /// private key then).
    ring: Option<RingKey>,
}

// SAFETY: the EVP_HPKE_KEY is written only in `new` and read-only afterwards (AWS-LC takes it as
// `const` in EVP_HPKE_CTX_setup_recipient), so sharing it between threads is sound.
unsafe impl Send for Recipient {}
unsafe impl Sync for Recipient {}

impl Drop for Recipient {
    fn drop(&mut self) {
        // SAFETY: `key` came from EVP_HPKE_KEY_new and is freed exactly once.
        unsafe { lc::EVP_HPKE_KEY_free(self.key) }
    }
}

/// One receiving HPKE context: opens a sequence of ciphertexts sealed by one sender context.
pub struct OpenContext(Opening);

#[expect(
    clippy::large_enum_variant,
    reason = "one context per contribution, on the stack while it opens: boxing ring's key \
              schedule would add an allocation per contribution to save nothing"
)]
enum Opening {
    AwsLc(AwsLcContext),
    Ring(RingContext),
}

/// AWS-LC's receiving context.
struct AwsLcContext {
    ctx: *mut lc::EVP_HPKE_CTX,
}

// SAFETY: the context is used through `&mut self` only, so never from two threads at once.
unsafe impl Send for AwsLcContext {}

impl Drop for AwsLcContext {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from EVP_HPKE_CTX_new and is freed exactly once.
        unsafe { lc::EVP_HPKE_CTX_free(self.ctx) }
    }
}

impl Recipient {
    /// The recipient of `private_key`, opening with the AES-GCM that is faster on this CPU
    /// (`Backend::for_this_cpu`).
    pub fn new(private_key: &PrivateKey) -> Result<Self, HpkeError> {
        Self::with_backend(private_key, Backend::for_this_cpu())
    }

    /// The recipient of `private_key`, opening with `backend` (tests use both).
    pub fn with_backend(private_key: &PrivateKey, backend: Backend) -> Result<Self, HpkeError> {
        let ring = match backend {
            Backend::Ring => Some(RingKey::new(private_key.as_bytes())?),
            Backend::AwsLc => None,
        };
        // SAFETY: EVP_HPKE_KEY_new returns an owned allocation or null (checked); the private key
        // pointer and length describe a live 32-byte buffer.
        unsafe {
            let key = lc::EVP_HPKE_KEY_new();
            if key.is_null() {
                return Err(HpkeError::BadKey("private key (allocation failed)"));
            }
            let recipient = Self { key, ring };
            let bytes = private_key.as_bytes();
            let ok = lc::EVP_HPKE_KEY_init(
                key,
                lc::EVP_hpke_x25519_hkdf_sha256(),
                bytes.as_ptr(),
                bytes.len(),
            );
            if ok != 1 {
                return Err(HpkeError::BadKey("private key"));
            }
            Ok(recipient)
        }
    }

    /// Sets up a receiving context for one encapsulated key and `info`.
    pub fn context(&self, encapsulated_key: &[u8], info: &[u8]) -> Result<OpenContext, HpkeError> {
        let opening = match &self.ring {
            Some(ring) => Opening::Ring(ring.context(encapsulated_key, info)?),
            None => Opening::AwsLc(self.aws_lc_context(encapsulated_key, info)?),
        };
        Ok(OpenContext(opening))
    }

    fn aws_lc_context(
        &self,
        encapsulated_key: &[u8],
        info: &[u8],
    ) -> Result<AwsLcContext, HpkeError> {
        // SAFETY: EVP_HPKE_CTX_new returns an owned allocation or null (checked); all pointers
        // and lengths describe live slices; `self.key` is initialised.
        unsafe {
            let ctx = lc::EVP_HPKE_CTX_new();
            if ctx.is_null() {
                return Err(HpkeError::Open);
            }
            let context = AwsLcContext { ctx };
            let ok = lc::EVP_HPKE_CTX_setup_recipient(
                ctx,
                self.key,
                lc::EVP_hpke_hkdf_sha256(),
                lc::EVP_hpke_aes_128_gcm(),
                encapsulated_key.as_ptr(),
                encapsulated_key.len(),
                info.as_ptr(),
                info.len(),
            );
            if ok != 1 {
                return Err(HpkeError::Open);
            }
            Ok(context)
        }
    }

    /// Opens a chunked ciphertext (`hpke::seal_chunked`), handing each chunk's plaintext to
    /// `each` as soon as it is authenticated: memory stays one chunk, whatever the message size.
    /// A truncated, reordered or altered sequence fails at the first bad chunk.
    pub fn open_chunks(
        &self,
        encapsulated_key: &[u8],
        info: &[u8],
        aad: &[u8],
        ciphertext: &[u8],
        chunk: usize,
        mut each: impl FnMut(&[u8]),
    ) -> Result<(), HpkeError> {
        let parts = crate::hpke::split_chunks(ciphertext, chunk).ok_or(HpkeError::Open)?;
        let mut context = self.context(encapsulated_key, info)?;
        for (index, part) in parts.iter().enumerate() {
            let last = index + 1 == parts.len();
            let index = u32::try_from(index).map_err(|_| HpkeError::Open)?;
            let plain = context.open(&crate::hpke::chunk_aad(aad, index, last), part)?;
            each(&plain);
        }
        Ok(())
    }

    /// Opens a one-piece (`chunk` None) or chunked ciphertext into `out` (cleared first), with no
    /// copy besides the decryption itself: the enclave's hot path.
    pub fn open_into(
        &self,
        encapsulated_key: &[u8],
        info: &[u8],
        aad: &[u8],
        ciphertext: &[u8],
        chunk: Option<usize>,
        out: &mut Vec<u8>,
    ) -> Result<(), HpkeError> {
        out.clear();
        let mut context = self.context(encapsulated_key, info)?;
        let Some(chunk) = chunk else {
            return context.open_append(aad, ciphertext, out);
        };
        let parts = crate::hpke::split_chunks(ciphertext, chunk).ok_or(HpkeError::Open)?;
        out.reserve(ciphertext.len());
        for (index, part) in parts.iter().enumerate() {
            let last = index + 1 == parts.len();
            let index = u32::try_from(index).map_err(|_| HpkeError::Open)?;
            context.open_append(&crate::hpke::chunk_aad(aad, index, last), part, out)?;
        }
        Ok(())
    }

    /// Single-shot open, the same as `hpke::open`.
    pub fn open(
        &self,
        encapsulated_key: &[u8],
        info: &[u8],
        aad: &[u8],
        ciphertext: &[u8],
    ) -> Result<Zeroizing<Vec<u8>>, HpkeError> {
        self.context(encapsulated_key, info)?.open(aad, ciphertext)
    }
}

impl OpenContext {
    /// Opens the next ciphertext of the sequence and appends its plaintext to `out`. On failure
    /// `out` keeps its length (what was written into its spare capacity the caller wipes with
    /// the buffer).
    pub fn open_append(
        &mut self,
        aad: &[u8],
        ciphertext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HpkeError> {
        match &mut self.0 {
            Opening::AwsLc(context) => context.open_append(aad, ciphertext, out),
            Opening::Ring(context) => context.open_append(aad, ciphertext, out),
        }
    }

    /// Opens the next ciphertext of the sequence (the context's sequence number advances).
    pub fn open(&mut self, aad: &[u8], ciphertext: &[u8]) -> Result<Zeroizing<Vec<u8>>, HpkeError> {
        let mut out = Zeroizing::new(Vec::with_capacity(ciphertext.len()));
        self.open_append(aad, ciphertext, &mut out)?;
        Ok(out)
    }
}

impl AwsLcContext {
    /// Opens the next ciphertext of the sequence and appends its plaintext to `out`, without
    /// an intermediate buffer. On failure `out` keeps its length (AWS-LC may have written into
    /// its spare capacity, which the caller wipes with the buffer).
    fn open_append(
        &mut self,
        aad: &[u8],
        ciphertext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HpkeError> {
        out.reserve(ciphertext.len());
        let start = out.len();
        let room = out.capacity() - start;
        let mut written = 0usize;
        // SAFETY: `out` has `room >= ciphertext.len()` bytes of spare capacity after `start`,
        // which bounds the plaintext; AWS-LC writes at most `max_out_len = room` bytes there and
        // reports how many in `written`; only those bytes become part of `out`.
        let ok = unsafe {
            lc::EVP_HPKE_CTX_open(
                self.ctx,
                out.as_mut_ptr().add(start),
                &mut written,
                room,
                ciphertext.as_ptr(),
                ciphertext.len(),
                aad.as_ptr(),
                aad.len(),
            )
        };
        if ok != 1 || written > room {
            return Err(HpkeError::Open);
        }
        // SAFETY: AWS-LC initialised `written <= room` bytes after `start`.
        unsafe { out.set_len(start + written) };
        Ok(())
    }
}

/// One sending HPKE context (a device): seals a sequence of plaintexts to one recipient.
pub struct SealContext {
    ctx: *mut lc::EVP_HPKE_CTX,
}

// SAFETY: the context is used through `&mut self` only, so never from two threads at once.
unsafe impl Send for SealContext {}

impl Drop for SealContext {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from EVP_HPKE_CTX_new and is freed exactly once.
        unsafe { lc::EVP_HPKE_CTX_free(self.ctx) }
    }
}

impl SealContext {
    /// Sets up a sending context to `recipient` with a fresh ephemeral key (AWS-LC's RNG);
    /// returns it with the encapsulated key the recipient needs.
    pub fn new(recipient: &PublicKey, info: &[u8]) -> Result<(Self, Vec<u8>), HpkeError> {
        let mut encapsulated = vec![0u8; lc::EVP_HPKE_MAX_ENC_LENGTH as usize];
        let mut written = 0usize;
        // SAFETY: EVP_HPKE_CTX_new returns an owned allocation or null (checked); AWS-LC writes
        // at most `max_enc = encapsulated.len()` bytes into `encapsulated` and reports how many;
        // the key and info pointers describe live slices.
        unsafe {
            let ctx = lc::EVP_HPKE_CTX_new();
            if ctx.is_null() {
                return Err(HpkeError::Seal);
            }
            let context = Self { ctx };
            let ok = lc::EVP_HPKE_CTX_setup_sender(
                ctx,
                encapsulated.as_mut_ptr(),
                &mut written,
                encapsulated.len(),
                lc::EVP_hpke_x25519_hkdf_sha256(),
                lc::EVP_hpke_hkdf_sha256(),
                lc::EVP_hpke_aes_128_gcm(),
                recipient.0.as_ptr(),
                recipient.0.len(),
                info.as_ptr(),
                info.len(),
            );
            if ok != 1 || written > encapsulated.len() {
                return Err(HpkeError::Seal);
            }
            encapsulated.truncate(written);
            Ok((context, encapsulated))
        }
    }

    /// Seals the next plaintext of the sequence and appends its ciphertext to `out`.
    pub fn seal_append(
        &mut self,
        aad: &[u8],
        plaintext: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), HpkeError> {
        // SAFETY: reads the initialised context's AEAD overhead.
        let overhead = unsafe { lc::EVP_HPKE_CTX_max_overhead(self.ctx) };
        out.reserve(plaintext.len() + overhead);
        let start = out.len();
        let room = out.capacity() - start;
        let mut written = 0usize;
        // SAFETY: `out` has `room >= plaintext.len() + overhead` bytes of spare capacity after
        // `start`; AWS-LC writes at most `max_out_len = room` bytes there and reports how many
        // in `written`; only those bytes become part of `out`.
        let ok = unsafe {
            lc::EVP_HPKE_CTX_seal(
                self.ctx,
                out.as_mut_ptr().add(start),
                &mut written,
                room,
                plaintext.as_ptr(),
                plaintext.len(),
                aad.as_ptr(),
                aad.len(),
            )
        };
        if ok != 1 || written > room {
            return Err(HpkeError::Seal);
        }
        // SAFETY: AWS-LC initialised `written <= room` bytes after `start`.
        unsafe { out.set_len(start + written) };
        Ok(())
    }
}

/// AWS-LC as a `confed_protocol::hpke::Sealer`: for load generators and simulated devices, where
/// X25519 in AWS-LC costs half of RustCrypto's.
#[derive(Debug, Default, Clone, Copy)]
pub struct AwsLc;

impl crate::hpke::Sealer for AwsLc {
    fn seal(
        &self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
        seal(recipient, info, aad, plaintext)
    }

    fn seal_chunked(
        &self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
        chunk: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
        seal_chunked(recipient, info, aad, plaintext, chunk)
    }
}

/// Single-shot seal, the same construction as `hpke::seal`; returns (encapsulated key,
/// ciphertext).
pub fn seal(
    recipient: &PublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
    let (mut context, encapsulated) = SealContext::new(recipient, info)?;
    let mut ciphertext = Vec::new();
    context.seal_append(aad, plaintext, &mut ciphertext)?;
    Ok((encapsulated, ciphertext))
}

/// Chunked seal, the same construction as `hpke::seal_chunked` (one context, chunk associated
/// data from `hpke::chunk_aad`).
pub fn seal_chunked(
    recipient: &PublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
    chunk: usize,
) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
    if !(crate::hpke::MIN_CHUNK..=crate::hpke::MAX_CHUNK).contains(&chunk) {
        return Err(HpkeError::Seal);
    }
    let (mut context, encapsulated) = SealContext::new(recipient, info)?;
    let count = crate::hpke::chunk_lengths(plaintext.len(), chunk).count();
    let mut ciphertext = Vec::with_capacity(plaintext.len() + 16 * count);
    let mut offset = 0;
    for (index, length) in crate::hpke::chunk_lengths(plaintext.len(), chunk).enumerate() {
        let last = index + 1 == count;
        let index = u32::try_from(index).map_err(|_| HpkeError::Seal)?;
        context.seal_append(
            &crate::hpke::chunk_aad(aad, index, last),
            &plaintext[offset..offset + length],
            &mut ciphertext,
        )?;
        offset += length;
    }
    Ok((encapsulated, ciphertext))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hpke;

    #[test]
    fn opens_what_the_rustcrypto_implementation_sealed() {
        let (private, public) = hpke::generate_keypair();
        let recipient = Recipient::new(&private).unwrap();
        for size in [0usize, 1, 16, 1000, 70_000] {
            let plaintext: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let (enc, ct) = hpke::seal(&public, b"info", b"aad", &plaintext).unwrap();
            assert_eq!(
                recipient
                    .open(&enc, b"info", b"aad", &ct)
                    .unwrap()
                    .as_slice(),
                plaintext.as_slice()
            );
            let mut into = Vec::new();
            recipient
                .open_into(&enc, b"info", b"aad", &ct, None, &mut into)
                .unwrap();
            assert_eq!(into, plaintext);
            assert_eq!(
                recipient.open(&enc, b"info", b"other", &ct),
                Err(HpkeError::Open)
            );
            assert_eq!(
                recipient.open(&enc, b"other", b"aad", &ct),
                Err(HpkeError::Open)
            );
        }
        for len in [0usize, 1024, 5000, 70_000] {
            let plaintext: Vec<u8> = (0..len).map(|i| (i % 249) as u8).collect();
            let (enc, ct) = hpke::seal_chunked(&public, b"i", b"a", &plaintext, 4096).unwrap();
            let mut opened = Vec::new();
            recipient
                .open_chunks(&enc, b"i", b"a", &ct, 4096, |p| opened.extend_from_slice(p))
                .unwrap();
            assert_eq!(opened, plaintext);
            let mut into = vec![9u8; 3];
            recipient
                .open_into(&enc, b"i", b"a", &ct, Some(4096), &mut into)
                .unwrap();
            assert_eq!(into, plaintext);
            assert!(
                recipient
                    .open_into(&enc, b"i", b"b", &ct, Some(4096), &mut into)
                    .is_err()
            );
            assert!(
                recipient
                    .open_chunks(&enc, b"i", b"a", &ct[..ct.len() - 1], 4096, |_| {})
                    .is_err()
            );
        }
        let (stranger, _) = hpke::generate_keypair();
        let (enc, ct) = hpke::seal(&public, b"i", b"a", b"x").unwrap();
        assert!(
            Recipient::new(&stranger)
                .unwrap()
                .open(&enc, b"i", b"a", &ct)
                .is_err()
        );
        assert!(recipient.open(&enc[..31], b"i", b"a", &ct).is_err());
        assert!(
            recipient
                .open(&enc, b"i", b"a", &ct[..ct.len() - 1])
                .is_err()
        );
    }

    #[test]
    fn the_rustcrypto_implementation_opens_what_aws_lc_sealed() {
        let (private, public) = hpke::generate_keypair();
        let mut encapsulated_keys = std::collections::HashSet::new();
        for size in [0usize, 1, 16, 1000, 70_000] {
            let plaintext: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let (enc, ct) = seal(&public, b"info", b"aad", &plaintext).unwrap();
            assert_eq!(ct.len(), size + 16);
            assert!(
                encapsulated_keys.insert(enc.clone()),
                "a fresh ephemeral key per seal"
            );
            assert_eq!(
                hpke::open(&private, &enc, b"info", b"aad", &ct)
                    .unwrap()
                    .as_slice(),
                plaintext.as_slice()
            );
            assert!(hpke::open(&private, &enc, b"info", b"other", &ct).is_err());
        }
        for len in [0usize, 1024, 5000, 70_000] {
            let plaintext: Vec<u8> = (0..len).map(|i| (i % 249) as u8).collect();
            let (enc, ct) = seal_chunked(&public, b"i", b"a", &plaintext, 4096).unwrap();
            let opened = hpke::open_chunked(&private, &enc, b"i", b"a", &ct, 4096).unwrap();
            assert_eq!(opened.as_slice(), plaintext.as_slice());
            assert!(
                hpke::open_chunked(&private, &enc, b"i", b"a", &ct[..ct.len() - 1], 4096).is_err()
            );
        }
        assert!(
            seal_chunked(&public, b"i", b"a", b"x", 10).is_err(),
            "chunk below MIN_CHUNK"
        );
    }
}
