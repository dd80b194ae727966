//! HPKE (RFC 9180) as confed uses it: base mode, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
//! AES-128-GCM (the fast AEAD on AES-NI hardware). `info` strings separate every use by label and
//! by what the ciphertext is for, so a ciphertext made for one purpose never opens for another.

use hpke::{Deserializable, Kem as KemTrait, OpModeR, OpModeS, Serializable};
use thiserror::Error;
use zeroize::Zeroizing;

pub(crate) type Kem = hpke::kem::X25519HkdfSha256;
pub(crate) type Kdf = hpke::kdf::HkdfSha256;
pub(crate) type Aead = hpke::aead::AesGcm128;

/// The suite's name in key sets and envelopes.
pub const SUITE: &str = "DHKEM-X25519-HKDF-SHA256/HKDF-SHA256/AES-128-GCM";
pub const KEY_BYTES: usize = 32;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum HpkeError {
    #[error("not a valid X25519 {0} (32 bytes expected)")]
    BadKey(&'static str),
    #[error("HPKE seal failed")]
    Seal,
    #[error("HPKE open failed: wrong key, wrong info or associated data, or tampered ciphertext")]
    Open,
}

/// An X25519 public key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey(pub [u8; KEY_BYTES]);

/// An X25519 private key; wiped from memory when dropped.
pub struct PrivateKey(Zeroizing<[u8; KEY_BYTES]>);

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrivateKey(<redacted>)")
    }
}

impl PrivateKey {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HpkeError> {
        let array: [u8; KEY_BYTES] = bytes
            .try_into()
            .map_err(|_| HpkeError::BadKey("private key"))?;
        <Kem as KemTrait>::PrivateKey::from_bytes(&array)
            .map_err(|_| HpkeError::BadKey("private key"))?;
        Ok(Self(Zeroizing::new(array)))
    }

    pub fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    fn inner(&self) -> Result<<Kem as KemTrait>::PrivateKey, HpkeError> {
        <Kem as KemTrait>::PrivateKey::from_bytes(self.0.as_slice())
            .map_err(|_| HpkeError::BadKey("private key"))
    }

    /// The matching public key.
    pub fn public_key(&self) -> Result<PublicKey, HpkeError> {
        let public = Kem::sk_to_pk(&self.inner()?);
        Ok(PublicKey(public.to_bytes().into()))
    }
}

impl PublicKey {
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HpkeError> {
        let array: [u8; KEY_BYTES] = bytes
            .try_into()
            .map_err(|_| HpkeError::BadKey("public key"))?;
        <Kem as KemTrait>::PublicKey::from_bytes(&array)
            .map_err(|_| HpkeError::BadKey("public key"))?;
        Ok(Self(array))
    }

    /// `from_bytes`, also refusing a key nothing can be sealed to: a low-order X25519 point
    /// (e.g. all zeros) makes the Diffie-Hellman output all zeros, which RFC 9180 (7.1.4) says to
    /// refuse. Tried with one encapsulation, so a peer's key is refused before any work is done
    /// on its behalf rather than when the answer is sealed.
    pub fn from_peer_bytes(bytes: &[u8]) -> Result<Self, HpkeError> {
        let key = Self::from_bytes(bytes)?;
        seal(&key, b"confed-key-check", b"", b"").map_err(|_| {
            HpkeError::BadKey("public key (low order: nothing can be sealed to it)")
        })?;
        Ok(key)
    }
}

/// A fresh key pair from the operating system's random generator.
pub fn generate_keypair() -> (PrivateKey, PublicKey) {
    let (private, public) = Kem::gen_keypair();
    let private_bytes: [u8; KEY_BYTES] = private.to_bytes().into();
    (
        PrivateKey(Zeroizing::new(private_bytes)),
        PublicKey(public.to_bytes().into()),
    )
}

/// Seals `plaintext` to `recipient`; returns (encapsulated key, ciphertext).
pub fn seal(
    recipient: &PublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
    let public = <Kem as KemTrait>::PublicKey::from_bytes(&recipient.0)
        .map_err(|_| HpkeError::BadKey("public key"))?;
    let (encapsulated, ciphertext) =
        hpke::single_shot_seal::<Aead, Kdf, Kem>(&OpModeS::Base, &public, info, plaintext, aad)
            .map_err(|_| HpkeError::Seal)?;
    Ok((encapsulated.to_bytes().to_vec(), ciphertext))
}

/// An implementation of confed's HPKE sealing (base mode, the suite above, chunking as
/// `seal_chunked`). `RustCrypto` is the protocol's own; a device or load generator may bring a
/// faster one (the enclave crate's AWS-LC `hpke_awslc::AwsLc`) through `DeviceClient::with_sealer`.
/// Every implementation must produce what `open`/`open_chunked` accept.
pub trait Sealer: Send + Sync + std::fmt::Debug {
    fn seal(
        &self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError>;

    fn seal_chunked(
        &self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
        chunk: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError>;
}

/// The RustCrypto `hpke` crate: pure Rust, no C toolchain, what a device links by default.
#[derive(Debug, Default, Clone, Copy)]
pub struct RustCrypto;

impl Sealer for RustCrypto {
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

/// Opens a ciphertext sealed to `private`'s public key with the same `info` and `aad`.
pub fn open(
    private: &PrivateKey,
    encapsulated_key: &[u8],
    info: &[u8],
    aad: &[u8],
    ciphertext: &[u8],
) -> Result<Zeroizing<Vec<u8>>, HpkeError> {
    let encapsulated = <Kem as KemTrait>::EncappedKey::from_bytes(encapsulated_key)
        .map_err(|_| HpkeError::Open)?;
    hpke::single_shot_open::<Aead, Kdf, Kem>(
        &OpModeR::Base,
        &private.inner()?,
        &encapsulated,
        info,
        ciphertext,
        aad,
    )
    .map(Zeroizing::new)
    .map_err(|_| HpkeError::Open)
}

/// Smallest and largest chunk of a chunked seal (plaintext bytes per chunk).
pub const MIN_CHUNK: usize = 1024;
pub const MAX_CHUNK: usize = 16 * 1024 * 1024;

/// Associated data of chunk `index`: the message's `aad`, the chunk index (u32, big-endian) and
/// whether it is the last chunk (one byte, 1 or 0). The HPKE context's sequence number orders
/// the chunks; the last-chunk flag makes a truncated sequence fail to open.
pub fn chunk_aad(aad: &[u8], index: u32, last: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(aad.len() + 5);
    out.extend_from_slice(aad);
    out.extend_from_slice(&index.to_be_bytes());
    out.push(u8::from(last));
    out
}

/// The plaintext lengths of the chunks of a `len`-byte message: full chunks, then the remainder
/// (at least one chunk, possibly empty).
pub fn chunk_lengths(len: usize, chunk: usize) -> impl Iterator<Item = usize> {
    let count = len.div_ceil(chunk).max(1);
    (0..count).map(move |i| {
        if i + 1 < count {
            chunk
        } else {
            len - chunk * (count - 1)
        }
    })
}

/// Seals `plaintext` as a sequence of `chunk`-byte chunks under one HPKE context; the ciphertext
/// is the chunks' ciphertexts concatenated (each chunk + 16 bytes).
pub fn seal_chunked(
    recipient: &PublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
    chunk: usize,
) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) {
        return Err(HpkeError::Seal);
    }
    let public = <Kem as KemTrait>::PublicKey::from_bytes(&recipient.0)
        .map_err(|_| HpkeError::BadKey("public key"))?;
    let (encapsulated, mut context) =
        hpke::setup_sender::<Aead, Kdf, Kem>(&OpModeS::Base, &public, info)
            .map_err(|_| HpkeError::Seal)?;
    let ciphertext = seal_pieces(&mut context, aad, plaintext, chunk)?;
    Ok((encapsulated.to_bytes().to_vec(), ciphertext))
}

/// A sender's HPKE context of the suite.
pub(crate) type SenderContext = hpke::aead::AeadCtxS<Aead, Kdf, Kem>;

/// The chunked ciphertext of `plaintext` under one sender `context` (`seal_chunked`'s layout),
/// for any way of setting the context up (`hpke_ephemeral`).
pub(crate) fn seal_pieces(
    context: &mut SenderContext,
    aad: &[u8],
    plaintext: &[u8],
    chunk: usize,
) -> Result<Vec<u8>, HpkeError> {
    if !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk) {
        return Err(HpkeError::Seal);
    }
    let count = chunk_lengths(plaintext.len(), chunk).count();
    let mut out = Vec::with_capacity(plaintext.len() + 16 * count);
    let mut offset = 0;
    for (index, length) in chunk_lengths(plaintext.len(), chunk).enumerate() {
        let last = index + 1 == count;
        let index = u32::try_from(index).map_err(|_| HpkeError::Seal)?;
        let sealed = context
            .seal(
                &plaintext[offset..offset + length],
                &chunk_aad(aad, index, last),
            )
            .map_err(|_| HpkeError::Seal)?;
        out.extend_from_slice(&sealed);
        offset += length;
    }
    Ok(out)
}

/// Splits a chunked ciphertext into its chunks' ciphertexts (each `chunk + 16` bytes, the last
/// the remainder); `None` if the length cannot be such a sequence.
pub fn split_chunks(ciphertext: &[u8], chunk: usize) -> Option<Vec<&[u8]>> {
    let step = chunk.checked_add(16)?;
    let parts: Vec<&[u8]> = ciphertext.chunks(step).collect();
    // Every chunk carries a 16-byte tag.
    (parts.last()?.len() >= 16).then_some(parts)
}

/// Opens a chunked ciphertext with the RustCrypto implementation (the independent reference the
/// tests compare AWS-LC against).
pub fn open_chunked(
    private: &PrivateKey,
    encapsulated_key: &[u8],
    info: &[u8],
    aad: &[u8],
    ciphertext: &[u8],
    chunk: usize,
) -> Result<Zeroizing<Vec<u8>>, HpkeError> {
    let encapsulated = <Kem as KemTrait>::EncappedKey::from_bytes(encapsulated_key)
        .map_err(|_| HpkeError::Open)?;
    let mut context = hpke::setup_receiver::<Aead, Kdf, Kem>(
        &OpModeR::Base,
        &private.inner()?,
        &encapsulated,
        info,
    )
    .map_err(|_| HpkeError::Open)?;
    let parts = split_chunks(ciphertext, chunk).ok_or(HpkeError::Open)?;
    let mut out = Zeroizing::new(Vec::with_capacity(ciphertext.len()));
    for (index, part) in parts.iter().enumerate() {
        let last = index + 1 == parts.len();
        let index = u32::try_from(index).map_err(|_| HpkeError::Open)?;
        let opened = context
            .open(part, &chunk_aad(aad, index, last))
            .map_err(|_| HpkeError::Open)?;
        out.extend_from_slice(&opened);
    }
    Ok(out)
}

/// `info` for a key service's share sealed to an enclave's ephemeral key: label, then the key
/// service, key, task, round, release commitment digest, and the key's threshold and number of
/// shares as the key service's share file states them, each followed by a zero byte so no two
/// tuples collide. Whoever relays the answer cannot change what the receipt says about t and n
/// (the enclave computes its quorum from them) nor present the share under another name.
pub fn share_release_info(
    keyservice_id: &str,
    key_id: &str,
    task_id: &str,
    round: u64,
    commitment_sha256: &str,
    threshold: u16,
    shares: u16,
) -> Vec<u8> {
    let mut info = b"confed share release v2\0".to_vec();
    for part in [
        keyservice_id,
        key_id,
        task_id,
        &round.to_string(),
        commitment_sha256,
        &threshold.to_string(),
        &shares.to_string(),
    ] {
        info.extend_from_slice(part.as_bytes());
        info.push(0);
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_then_open_round_trips_and_binds_info_and_aad() {
        let (private, public) = generate_keypair();
        assert_eq!(private.public_key().unwrap(), public);
        let info = share_release_info("ks1", "k1", "task", 3, "c", 2, 3);
        let (enc, ct) = seal(&public, &info, b"aad", b"secret share").unwrap();
        assert_eq!(
            open(&private, &enc, &info, b"aad", &ct).unwrap().as_slice(),
            b"secret share"
        );
        let other_round = share_release_info("ks1", "k1", "task", 4, "c", 2, 3);
        assert_eq!(
            open(&private, &enc, &other_round, b"aad", &ct),
            Err(HpkeError::Open)
        );
        assert_eq!(
            open(&private, &enc, &info, b"other", &ct),
            Err(HpkeError::Open)
        );
        let (stranger, _) = generate_keypair();
        assert_eq!(
            open(&stranger, &enc, &info, b"aad", &ct),
            Err(HpkeError::Open)
        );
    }

    #[test]
    fn info_fields_cannot_be_shifted_between_positions() {
        assert_ne!(
            share_release_info("ab", "c", "t", 1, "c", 2, 3),
            share_release_info("a", "bc", "t", 1, "c", 2, 3)
        );
    }

    #[test]
    fn chunked_seal_opens_and_detects_truncation_reordering_and_the_wrong_aad() {
        let (private, public) = generate_keypair();
        for len in [0usize, 1, 1023, 1024, 1025, 4096, 5000] {
            let plaintext: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
            let (enc, ct) = seal_chunked(&public, b"info", b"aad", &plaintext, MIN_CHUNK).unwrap();
            assert_eq!(ct.len(), len + 16 * chunk_lengths(len, MIN_CHUNK).count());
            let opened = open_chunked(&private, &enc, b"info", b"aad", &ct, MIN_CHUNK).unwrap();
            assert_eq!(opened.as_slice(), plaintext.as_slice(), "{len}");
            assert!(open_chunked(&private, &enc, b"info", b"other", &ct, MIN_CHUNK).is_err());
        }
        let plaintext = vec![7u8; 3 * MIN_CHUNK];
        let (enc, ct) = seal_chunked(&public, b"i", b"a", &plaintext, MIN_CHUNK).unwrap();
        let step = MIN_CHUNK + 16;
        let truncated = &ct[..2 * step];
        assert!(
            open_chunked(&private, &enc, b"i", b"a", truncated, MIN_CHUNK).is_err(),
            "dropped last chunk"
        );
        let mut swapped = ct[step..2 * step].to_vec();
        swapped.extend_from_slice(&ct[..step]);
        swapped.extend_from_slice(&ct[2 * step..]);
        assert!(
            open_chunked(&private, &enc, b"i", b"a", &swapped, MIN_CHUNK).is_err(),
            "reordered"
        );
        assert!(
            seal_chunked(&public, b"i", b"a", b"x", 10).is_err(),
            "chunk below the minimum"
        );
    }

    #[test]
    fn malformed_keys_are_refused() {
        assert_eq!(
            PublicKey::from_bytes(&[1; 31]),
            Err(HpkeError::BadKey("public key"))
        );
        assert!(PrivateKey::from_bytes(&[1; 33]).is_err());
    }

    /// Low-order X25519 points (all zeros; the order-8 point 1 and its variants) are refused as a
    /// peer's key; a real key is not.
    #[test]
    fn low_order_peer_keys_are_refused() {
        let mut one = [0u8; 32];
        one[0] = 1;
        for bad in [[0u8; 32], one] {
            assert!(PublicKey::from_bytes(&bad).is_ok(), "well-formed bytes");
            assert!(PublicKey::from_peer_bytes(&bad).is_err(), "{bad:?}");
        }
        let (_, public) = generate_keypair();
        assert!(PublicKey::from_peer_bytes(&public.0).is_ok());
    }
}
