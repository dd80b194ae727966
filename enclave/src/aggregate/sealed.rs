//! The one container in which an enclave leaves something un-noised in the untrusted store for
//! a later enclave step (docs/protocol.md, "Sealed enclave state"): the BLT state a round leaves
//! for the next (`blt_state`) and a partition's exact sums left for the round's merge
//! (`partition`).
//!
//! ```text
//! magic || u32 BE header length || header (JSON) || nonce (12) || ciphertext || tag (16)
//! ```
//!
//! AES-256-GCM under `HMAC-SHA256(private key, key label 0x00 context... )` (`noise::keyed`), so
//! only an enclave holding the task's private key (released by the key services to an attested
//! enclave only) can open or forge one. Everything before the nonce is the associated data: the
//! header says, in public, who sealed what, and each kind checks it before opening. The nonce is
//! synthetic (as in SIV): the first 12 bytes of `BLAKE3-keyed(nonce key, associated data ||
//! plaintext)`, the nonce key the same HMAC under the kind's nonce label. A nonce repeats only
//! for the same header and plaintext, which sealing then maps to the same bytes: a step redone
//! over the same inputs seals byte for byte what the first attempt did, so what names the sealed
//! bytes by their digest (a manifest, a stored intermediate) does not change with a retry.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use thiserror::Error;
use zeroize::Zeroizing;

use super::noise::keyed;
use crate::hpke::PrivateKey;

const TAG_LEN: usize = 16;

/// What distinguishes one kind of sealed thing from another: a different magic, and keys under
/// different labels, so one kind never opens as another.
pub struct Kind {
    pub magic: &'static [u8],
    pub key_label: &'static [u8],
    pub nonce_label: &'static [u8],
    /// Its headers' longest length: anything longer is not one.
    pub max_header: usize,
}

#[derive(Debug, Error, PartialEq)]
pub enum SealedError {
    #[error("{0}")]
    Malformed(String),
    #[error("authentication failed")]
    Unauthentic,
}

impl Kind {
    /// The header's JSON bytes and the length of the associated data (everything before the
    /// nonce), without opening: what can be checked before the key is asked for.
    pub fn header<'a>(&self, sealed: &'a [u8]) -> Result<(&'a [u8], usize), SealedError> {
        let malformed = |why: String| SealedError::Malformed(why);
        let rest = sealed.strip_prefix(self.magic).ok_or_else(|| {
            malformed(format!(
                "it does not start with {:?}",
                String::from_utf8_lossy(self.magic)
            ))
        })?;
        let (length, rest) = rest
            .split_first_chunk::<4>()
            .ok_or_else(|| malformed("it ends inside its header length".into()))?;
        let length = u32::from_be_bytes(*length) as usize;
        if length > self.max_header || rest.len() < length {
            return Err(malformed("its header length is out of range".into()));
        }
        Ok((&rest[..length], self.magic.len() + 4 + length))
    }

    /// Refuses sealed bytes whose ciphertext is not `body_len` bytes (the length its header's
    /// shape gives).
    pub fn check_body_len(
        &self,
        sealed: &[u8],
        ad_len: usize,
        body_len: usize,
    ) -> Result<(), SealedError> {
        let expected = body_len.checked_add(NONCE_LEN + TAG_LEN);
        if expected != Some(sealed.len() - ad_len) {
            return Err(SealedError::Malformed(
                "its length does not match its header's shape".into(),
            ));
        }
        Ok(())
    }

    fn cipher(&self, private_key: &PrivateKey, context: &[&[u8]]) -> LessSafeKey {
        let key = keyed(private_key, &label_then(self.key_label, context));
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key[..]).expect("a 32-byte AES-256 key"))
    }

    /// Seals `body` (encrypted in place, then wiped with it) under `header_json`, with keys for
    /// `context` (who may open it: the task and policy).
    pub fn seal(
        &self,
        private_key: &PrivateKey,
        context: &[&[u8]],
        header_json: &[u8],
        mut body: Zeroizing<Vec<u8>>,
    ) -> Result<Vec<u8>, SealedError> {
        let header_len = u32::try_from(header_json.len())
            .ok()
            .filter(|n| *n as usize <= self.max_header)
            .ok_or_else(|| SealedError::Malformed("its header is too long".into()))?;
        let mut out =
            Vec::with_capacity(self.magic.len() + 4 + header_json.len() + NONCE_LEN + body.len());
        out.extend_from_slice(self.magic);
        out.extend_from_slice(&header_len.to_be_bytes());
        out.extend_from_slice(header_json);
        let ad_len = out.len();
        let nonce_key = keyed(private_key, &label_then(self.nonce_label, context));
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(
            &blake3::Hasher::new_keyed(&nonce_key)
                .update(&out[..ad_len])
                .update(&body)
                .finalize()
                .as_bytes()[..NONCE_LEN],
        );
        let tag = self
            .cipher(private_key, context)
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&out[..ad_len]),
                &mut body[..],
            )
            .map_err(|_| SealedError::Malformed("it could not be sealed".into()))?;
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&body);
        out.extend_from_slice(tag.as_ref());
        Ok(out)
    }

    /// The plaintext of `sealed` (its associated data `ad_len` bytes long, from `header`),
    /// authenticated with keys for `context`.
    pub fn open(
        &self,
        private_key: &PrivateKey,
        context: &[&[u8]],
        sealed: &[u8],
        ad_len: usize,
    ) -> Result<Zeroizing<Vec<u8>>, SealedError> {
        let (ad, rest) = sealed.split_at(ad_len);
        if rest.len() < NONCE_LEN + TAG_LEN {
            return Err(SealedError::Unauthentic);
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        let nonce =
            Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealedError::Unauthentic)?;
        let mut body = Zeroizing::new(ciphertext.to_vec());
        let plain_len = self
            .cipher(private_key, context)
            .open_in_place(nonce, Aad::from(ad), &mut body[..])
            .map_err(|_| SealedError::Unauthentic)?
            .len();
        body.truncate(plain_len);
        Ok(body)
    }
}

fn label_then<'a>(label: &'a [u8], context: &[&'a [u8]]) -> Vec<&'a [u8]> {
    std::iter::once(label)
        .chain(context.iter().copied())
        .collect()
}
