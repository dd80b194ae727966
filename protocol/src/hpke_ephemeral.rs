//! Sealing under an ephemeral key drawn ahead of time (RFC 9180 `DeriveKeyPair` from 32 bytes of
//! fresh randomness), so a device knows its contribution's encapsulated key before it seals: a
//! device token binds it (`privacy_pass::context`), and the token is obtained while the device
//! trains. The result is ordinary HPKE base mode; `hpke::open`/`open_chunked` open it.
//!
//! The `hpke` crate draws an ephemeral key from the generator it is handed; handing it one that
//! yields the drawn bytes once (and fresh operating-system randomness after that, so the bytes
//! are never used for anything else) gives the same key, and every seal checks that the
//! encapsulated key it produced is the one announced, so a change in how the crate draws fails
//! loudly, never silently.

use hpke::{Deserializable, Kem as KemTrait, OpModeS, Serializable};
use zeroize::Zeroizing;

use crate::hpke::{Aead, HpkeError, KEY_BYTES, Kdf, Kem, PublicKey, SenderContext, seal_pieces};

/// An ephemeral key for one seal: used once (sealing consumes it), wiped when dropped.
pub struct Ephemeral {
    ikm: Zeroizing<[u8; KEY_BYTES]>,
    encapsulated_key: [u8; KEY_BYTES],
}

impl std::fmt::Debug for Ephemeral {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ephemeral")
            .field(
                "encapsulated_key",
                &crate::hex::encode(self.encapsulated_key),
            )
            .finish_non_exhaustive()
    }
}

/// Yields the drawn bytes to the first request for exactly their length, and fresh randomness
/// to any other: the drawn key material feeds one key derivation and nothing else. (Asked for
/// anything else first, the seal's check of the encapsulated key fails.)
struct Drawn<'a> {
    ikm: &'a [u8; KEY_BYTES],
    used: bool,
}

impl Drawn<'_> {
    fn fresh(dest: &mut [u8]) {
        // A generator cannot fail here (`Infallible`); zeros if the OS has no randomness only
        // make the seal's check of the announced key fail.
        if getrandom::fill(dest).is_err() {
            dest.fill(0);
        }
    }
}

impl rand_core::TryRng for Drawn<'_> {
    type Error = std::convert::Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Self::Error> {
        let mut bytes = [0u8; 4];
        Self::fresh(&mut bytes);
        Ok(u32::from_le_bytes(bytes))
    }

    fn try_next_u64(&mut self) -> Result<u64, Self::Error> {
        let mut bytes = [0u8; 8];
        Self::fresh(&mut bytes);
        Ok(u64::from_le_bytes(bytes))
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), Self::Error> {
        if !self.used && dest.len() == KEY_BYTES {
            self.used = true;
            dest.copy_from_slice(self.ikm);
        } else {
            Self::fresh(dest);
        }
        Ok(())
    }
}

impl rand_core::TryCryptoRng for Drawn<'_> {}

impl Ephemeral {
    pub fn generate() -> Result<Self, HpkeError> {
        let mut ikm = Zeroizing::new([0u8; KEY_BYTES]);
        getrandom::fill(ikm.as_mut()).map_err(|_| HpkeError::Seal)?;
        let (_, public) = Kem::derive_keypair(ikm.as_ref());
        Ok(Self {
            encapsulated_key: public.to_bytes().into(),
            ikm,
        })
    }

    /// The `enc` the seal will produce.
    pub fn encapsulated_key(&self) -> &[u8; KEY_BYTES] {
        &self.encapsulated_key
    }

    fn sender(
        self,
        recipient: &PublicKey,
        info: &[u8],
    ) -> Result<(Vec<u8>, SenderContext), HpkeError> {
        let public = <Kem as KemTrait>::PublicKey::from_bytes(&recipient.0)
            .map_err(|_| HpkeError::BadKey("public key"))?;
        let (encapsulated, context) = hpke::setup_sender_with_rng::<Aead, Kdf, Kem>(
            &OpModeS::Base,
            &public,
            info,
            &mut Drawn {
                ikm: &self.ikm,
                used: false,
            },
        )
        .map_err(|_| HpkeError::Seal)?;
        let encapsulated = encapsulated.to_bytes().to_vec();
        if encapsulated != self.encapsulated_key {
            return Err(HpkeError::Seal);
        }
        Ok((encapsulated, context))
    }

    /// `hpke::seal` under this ephemeral key.
    pub fn seal(
        self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
        let (encapsulated, mut context) = self.sender(recipient, info)?;
        let ciphertext = context.seal(plaintext, aad).map_err(|_| HpkeError::Seal)?;
        Ok((encapsulated, ciphertext))
    }

    /// `hpke::seal_chunked` under this ephemeral key.
    pub fn seal_chunked(
        self,
        recipient: &PublicKey,
        info: &[u8],
        aad: &[u8],
        plaintext: &[u8],
        chunk: usize,
    ) -> Result<(Vec<u8>, Vec<u8>), HpkeError> {
        let (encapsulated, mut context) = self.sender(recipient, info)?;
        Ok((
            encapsulated,
            seal_pieces(&mut context, aad, plaintext, chunk)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hpke::{MIN_CHUNK, generate_keypair, open, open_chunked};

    #[test]
    fn a_seal_under_a_drawn_ephemeral_produces_the_announced_key_and_opens() {
        let (private, public) = generate_keypair();
        let ephemeral = Ephemeral::generate().unwrap();
        let announced = *ephemeral.encapsulated_key();
        let (enc, ct) = ephemeral.seal(&public, b"info", b"aad", b"update").unwrap();
        assert_eq!(enc, announced);
        assert_eq!(
            open(&private, &enc, b"info", b"aad", &ct)
                .unwrap()
                .as_slice(),
            b"update"
        );

        let plaintext = vec![7u8; 3 * MIN_CHUNK + 5];
        let ephemeral = Ephemeral::generate().unwrap();
        let announced = *ephemeral.encapsulated_key();
        let (enc, ct) = ephemeral
            .seal_chunked(&public, b"info", b"aad", &plaintext, MIN_CHUNK)
            .unwrap();
        assert_eq!(enc, announced);
        let opened = open_chunked(&private, &enc, b"info", b"aad", &ct, MIN_CHUNK).unwrap();
        assert_eq!(opened.as_slice(), plaintext.as_slice());
        // Two ephemerals are two keys.
        assert_ne!(
            Ephemeral::generate().unwrap().encapsulated_key(),
            &announced
        );
    }
}
