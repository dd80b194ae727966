//! HPKE (RFC 9180) as confed uses it: base mode, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
//! AES-128-GCM (the fast AEAD on AES-NI hardware). `info` strings separate every use by label and
//! by what the ciphertext is for, so a ciphertext made for one purpose never opens for another.

use hpke::{Deserializable, Kem as KemTrait, OpModeR, OpModeS, Serializable};
use thiserror::Error;
use zeroize::Zeroizing;

type Kem = hpke::kem::X25519HkdfSha256;
type Kdf = hpke::kdf::HkdfSha256;
type Aead = hpke::aead::AesGcm128;

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

/// `info` for a key service's share sealed to an enclave's ephemeral key: label, then the key
/// service, key, task and round, each followed by a zero byte so no two tuples collide.
pub fn share_release_info(keyservice_id: &str, key_id: &str, task_id: &str, round: u64) -> Vec<u8> {
    let mut info = b"confed share release v1\0".to_vec();
    for part in [keyservice_id, key_id, task_id, &round.to_string()] {
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
        let info = share_release_info("ks1", "k1", "task", 3);
        let (enc, ct) = seal(&public, &info, b"aad", b"secret share").unwrap();
        assert_eq!(
            open(&private, &enc, &info, b"aad", &ct).unwrap().as_slice(),
            b"secret share"
        );
        let other_round = share_release_info("ks1", "k1", "task", 4);
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
            share_release_info("ab", "c", "t", 1),
            share_release_info("a", "bc", "t", 1)
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
}
