//! The contribution envelope a device uploads: a CBOR map holding the key id, the HPKE
//! encapsulated key and the ciphertext of the device's update (safetensors). The front end checks
//! its shape and stores it; only the enclave opens it.
//!
//! ```text
//! { "v": 2, "key_id": text, "enc": bytes(32), "ct": bytes }      (CBOR map, exactly these keys,
//!   plus "chunk": uint when the update is sealed in chunks, see `hpke::seal_chunked`, and
//!   "token": bytes(354), a device token, when the task requires one: `privacy_pass::context`,
//!   and "seeds": bytes, the mask seeds sealed to each key service, in a masked task: `masking`)
//! info = "confed contribution v2" 0x00 key_id 0x00
//! aad  = "confed contribution v2" 0x00 task_id 0x00 decimal(round) 0x00 assignment_ref 0x00
//!        policy_sha256 0x00 model_sha256 0x00
//! assignment_ref = lowercase hex SHA-256 of the assignment id
//! policy_sha256  = lowercase hex SHA-256 of the task policy text (`policy.rs`)
//! model_sha256   = lowercase hex SHA-256 of the model version the device trained from
//! ```
//!
//! The associated data binds the task, round and assignment, so a ciphertext moved into another
//! round or assignment does not open; and the task policy and the model version the device agreed
//! to, so an enclave given other privacy parameters or another model opens nothing. It names the
//! assignment by the hash of its id: the id is a capability the server does not keep, the hash is
//! what the server stores and the enclave reads.

use ciborium::Value;
use thiserror::Error;

use crate::hpke::{self, HpkeError, PublicKey, Sealer};
use crate::ids::Capability;

pub const LABEL: &str = "confed contribution v2";
pub const VERSION: u64 = 2;
/// Fixed CBOR overhead besides the key id and ciphertext (map header, keys, length prefixes).
pub const OVERHEAD_BYTES: usize = 64;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("not a CBOR envelope: {0}")]
    Cbor(String),
    #[error("the envelope must be a CBOR map with exactly the keys v, key_id, enc, ct: {0}")]
    Shape(String),
    #[error(
        "unsupported envelope version {0}; this server accepts version 2 (contributions bound to the task policy)"
    )]
    Version(u64),
    #[error(transparent)]
    Hpke(#[from] HpkeError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub key_id: String,
    pub encapsulated_key: Vec<u8>,
    pub ciphertext: Vec<u8>,
    /// Plaintext bytes per chunk when sealed in chunks (large updates); `None` for one piece.
    pub chunk: Option<u32>,
    /// A Privacy Pass token of type 0x0002 whose nonce binds `encapsulated_key`
    /// (`privacy_pass::context::token_nonce`).
    pub token: Option<Vec<u8>>,
    /// In a masked task, the mask seeds sealed to each key service, service 1 first
    /// (`masking::envelope_seeds`); the token's nonce binds them.
    pub seeds: Option<Vec<u8>>,
}

/// Updates larger than this are sealed in chunks of this size, so the enclave opens them in
/// constant memory.
pub const CHUNK_THRESHOLD: usize = 1024 * 1024;

fn fields(parts: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in parts {
        out.extend_from_slice(part.as_bytes());
        out.push(0);
    }
    out
}

pub fn info(key_id: &str) -> Vec<u8> {
    fields(&[LABEL, key_id])
}

/// Lowercase hex SHA-256 of an assignment id: how the server and the enclave name an assignment.
pub fn assignment_ref(assignment_id: &str) -> String {
    crate::hex::sha256_hex(assignment_id.as_bytes())
}

/// What every contribution of one round is bound to, besides its assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundContext {
    pub task_id: String,
    pub round: u64,
    /// Lowercase hex SHA-256 of the task policy text.
    pub policy_sha256: String,
    /// Lowercase hex SHA-256 of the model version the round trains from.
    pub model_sha256: String,
}

pub fn aad(context: &RoundContext, assignment_ref: &str) -> Vec<u8> {
    fields(&[
        LABEL,
        &context.task_id,
        &context.round.to_string(),
        assignment_ref,
        &context.policy_sha256,
        &context.model_sha256,
    ])
}

impl Envelope {
    pub fn to_cbor(&self) -> Vec<u8> {
        let text = |t: &str| Value::Text(t.into());
        let mut entries = vec![
            (text("v"), Value::Integer(VERSION.into())),
            (text("key_id"), Value::Text(self.key_id.clone())),
            (text("enc"), Value::Bytes(self.encapsulated_key.clone())),
            (text("ct"), Value::Bytes(self.ciphertext.clone())),
        ];
        if let Some(chunk) = self.chunk {
            entries.push((text("chunk"), Value::Integer(chunk.into())));
        }
        if let Some(token) = &self.token {
            entries.push((text("token"), Value::Bytes(token.clone())));
        }
        if let Some(seeds) = &self.seeds {
            entries.push((text("seeds"), Value::Bytes(seeds.clone())));
        }
        let mut out =
            Vec::with_capacity(self.ciphertext.len() + OVERHEAD_BYTES + self.key_id.len());
        ciborium::into_writer(&Value::Map(entries), &mut out)
            .expect("writing CBOR to a Vec cannot fail");
        out
    }

    /// Parses an envelope strictly: a map with exactly `v`, `key_id`, `enc` (32 bytes), `ct`, and
    /// optionally `chunk` (`envelope_cbor.rs`).
    pub fn from_cbor(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        crate::envelope_cbor::parse(bytes).map(|view| view.to_owned())
    }
}

/// An envelope borrowing its fields from the stored bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeRef<'a> {
    pub key_id: &'a str,
    pub encapsulated_key: &'a [u8],
    pub ciphertext: &'a [u8],
    pub chunk: Option<u32>,
    pub token: Option<&'a [u8]>,
    pub seeds: Option<&'a [u8]>,
}

impl EnvelopeRef<'_> {
    /// Parses stored bytes without copying the ciphertext.
    pub fn parse(bytes: &[u8]) -> Result<EnvelopeRef<'_>, EnvelopeError> {
        crate::envelope_cbor::parse(bytes)
    }

    pub fn to_owned(&self) -> Envelope {
        Envelope {
            key_id: self.key_id.to_string(),
            encapsulated_key: self.encapsulated_key.to_vec(),
            ciphertext: self.ciphertext.to_vec(),
            chunk: self.chunk,
            token: self.token.map(<[u8]>::to_vec),
            seeds: self.seeds.map(<[u8]>::to_vec),
        }
    }
}

/// The envelope's checks after decoding: every field present, the version, the encapsulated key's
/// length, the ciphertext's minimum length and its chunk structure.
pub fn validate<'a>(
    version: Option<u64>,
    key_id: Option<&'a str>,
    enc: Option<&'a [u8]>,
    ct: Option<&'a [u8]>,
    chunk: Option<u64>,
    token: Option<&'a [u8]>,
    seeds: Option<&'a [u8]>,
) -> Result<EnvelopeRef<'a>, EnvelopeError> {
    let missing = |name: &str| EnvelopeError::Shape(format!("`{name}` is missing"));
    let version = version.ok_or_else(|| missing("v"))?;
    if version != VERSION {
        return Err(EnvelopeError::Version(version));
    }
    let encapsulated_key = enc.ok_or_else(|| missing("enc"))?;
    if encapsulated_key.len() != hpke::KEY_BYTES {
        return Err(EnvelopeError::Shape("`enc` must be 32 bytes".into()));
    }
    let ciphertext = ct.ok_or_else(|| missing("ct"))?;
    if ciphertext.len() < 16 {
        return Err(EnvelopeError::Shape(
            "`ct` is shorter than an AEAD tag".into(),
        ));
    }
    let chunk = match chunk {
        None => None,
        Some(c) if (hpke::MIN_CHUNK as u64..=hpke::MAX_CHUNK as u64).contains(&c) => {
            if hpke::split_chunks(ciphertext, c as usize).is_none() {
                return Err(EnvelopeError::Shape(
                    "`ct` is not a sequence of sealed chunks".into(),
                ));
            }
            Some(c as u32)
        }
        Some(c) => {
            return Err(EnvelopeError::Shape(format!(
                "`chunk` {c} is outside {}..={}",
                hpke::MIN_CHUNK,
                hpke::MAX_CHUNK
            )));
        }
    };
    if let Some(token) = token
        && token.len() != crate::privacy_pass::TOKEN_BYTES
    {
        return Err(EnvelopeError::Shape(format!(
            "`token` must be {} bytes (a Privacy Pass token of type 0x0002)",
            crate::privacy_pass::TOKEN_BYTES
        )));
    }
    if let Some(seeds) = seeds
        && (seeds.is_empty() || seeds.len() > crate::masking::MAX_ENVELOPE_SEEDS_BYTES)
    {
        return Err(EnvelopeError::Shape(format!(
            "`seeds` must be 1 to {} bytes (the mask seeds sealed to each key service)",
            crate::masking::MAX_ENVELOPE_SEEDS_BYTES
        )));
    }
    Ok(EnvelopeRef {
        key_id: key_id.ok_or_else(|| missing("key_id"))?,
        encapsulated_key,
        ciphertext,
        chunk,
        token,
        seeds,
    })
}

/// Seals a device's update (safetensors bytes) for one assignment (the id the device was given),
/// with the protocol's own HPKE (`hpke::RustCrypto`). Updates above `CHUNK_THRESHOLD` bytes are
/// sealed in chunks.
pub fn seal(
    public_key: &PublicKey,
    key_id: &str,
    context: &RoundContext,
    capability: &Capability,
    update: &[u8],
) -> Result<Envelope, EnvelopeError> {
    seal_with(
        &hpke::RustCrypto,
        public_key,
        key_id,
        context,
        capability,
        update,
    )
}

/// `seal` with a chosen HPKE implementation.
pub fn seal_with(
    sealer: &dyn Sealer,
    public_key: &PublicKey,
    key_id: &str,
    context: &RoundContext,
    capability: &Capability,
    update: &[u8],
) -> Result<Envelope, EnvelopeError> {
    sealed(
        key_id,
        context,
        capability,
        update,
        None,
        |info, aad, chunk| match chunk {
            Some(chunk) => sealer.seal_chunked(public_key, info, aad, update, chunk),
            None => sealer.seal(public_key, info, aad, update),
        },
    )
}

/// `seal` under an ephemeral key drawn ahead, carrying the device token obtained for it (its
/// nonce must be `token_nonce` of the ephemeral's encapsulated key: checked here, so a device
/// never uploads a token that cannot count).
pub fn seal_with_token(
    ephemeral: crate::hpke_ephemeral::Ephemeral,
    token: &crate::privacy_pass::Token,
    public_key: &PublicKey,
    key_id: &str,
    context: &RoundContext,
    capability: &Capability,
    update: &[u8],
) -> Result<Envelope, EnvelopeError> {
    if token.nonce != crate::privacy_pass::context::token_nonce(ephemeral.encapsulated_key()) {
        return Err(EnvelopeError::Shape(
            "the token's nonce does not bind this envelope's encapsulated key".into(),
        ));
    }
    let token = Some(token.encode());
    sealed(
        key_id,
        context,
        capability,
        update,
        token,
        |info, aad, chunk| match chunk {
            Some(chunk) => ephemeral.seal_chunked(public_key, info, aad, update, chunk),
            None => ephemeral.seal(public_key, info, aad, update),
        },
    )
}

/// What binds a masked contribution's envelope (docs/secure-aggregation.md): the ephemeral key
/// drawn ahead, the device token obtained for it and for the seeds, and the seeds sealed to
/// each key service, service 1 first.
pub struct MaskedBinding<'a> {
    pub ephemeral: crate::hpke_ephemeral::Ephemeral,
    pub token: &'a crate::privacy_pass::Token,
    pub seeds: &'a [crate::masking::SealedSeeds],
}

/// The token nonce a masked contribution's token must carry: its encapsulated key and each key
/// service's sealed seeds.
pub fn masked_nonce(enc: &[u8], seeds: &[crate::masking::SealedSeeds]) -> [u8; 32] {
    let digests: Vec<[u8; 32]> = seeds
        .iter()
        .map(|s| crate::privacy_pass::context::seeds_digest(&s.to_bytes()))
        .collect();
    crate::privacy_pass::context::masked_token_nonce(enc, &digests)
}

/// The nonce a masked contribution's token must carry, from its envelope: `None` when the
/// envelope has no `seeds` or they are not the layout's length (no token can authenticate it).
pub fn masked_nonce_of(
    layout: &crate::masking::Layout,
    enc: &[u8],
    seeds: Option<&[u8]>,
) -> Option<[u8; 32]> {
    let items = crate::masking::split_seeds(layout, seeds?).ok()?;
    let digests: Vec<[u8; 32]> = items
        .iter()
        .map(|item| crate::privacy_pass::context::seeds_digest(item))
        .collect();
    Some(crate::privacy_pass::context::masked_token_nonce(
        enc, &digests,
    ))
}

/// Seals a masked update (`masking::encode_masked`) with its sealed seeds and its token, whose
/// nonce must bind both the ephemeral's encapsulated key and the seeds (checked here).
pub fn seal_masked(
    binding: MaskedBinding<'_>,
    public_key: &PublicKey,
    key_id: &str,
    context: &RoundContext,
    capability: &Capability,
    masked_update: &[u8],
) -> Result<Envelope, EnvelopeError> {
    let MaskedBinding {
        ephemeral,
        token,
        seeds,
    } = binding;
    if token.nonce != masked_nonce(ephemeral.encapsulated_key(), seeds) {
        return Err(EnvelopeError::Shape(
            "the token's nonce does not bind this envelope's encapsulated key and seeds".into(),
        ));
    }
    let mut envelope = sealed(
        key_id,
        context,
        capability,
        masked_update,
        Some(token.encode()),
        |info, aad, chunk| match chunk {
            Some(chunk) => ephemeral.seal_chunked(public_key, info, aad, masked_update, chunk),
            None => ephemeral.seal(public_key, info, aad, masked_update),
        },
    )?;
    envelope.seeds = Some(crate::masking::envelope_seeds(seeds));
    Ok(envelope)
}

/// The envelope of `update` for the assignment: `seal(info, aad, chunk)` seals it (in chunks of
/// `CHUNK_THRESHOLD` bytes above that size) and returns (enc, ct).
fn sealed(
    key_id: &str,
    context: &RoundContext,
    capability: &Capability,
    update: &[u8],
    token: Option<Vec<u8>>,
    seal: impl FnOnce(&[u8], &[u8], Option<usize>) -> Result<(Vec<u8>, Vec<u8>), HpkeError>,
) -> Result<Envelope, EnvelopeError> {
    let aad = aad(context, capability.reference().as_str());
    let chunk = (update.len() > CHUNK_THRESHOLD).then_some(CHUNK_THRESHOLD);
    let (encapsulated_key, ciphertext) = seal(&info(key_id), &aad, chunk)?;
    Ok(Envelope {
        key_id: key_id.to_string(),
        encapsulated_key,
        ciphertext,
        chunk: chunk.map(|c| c as u32),
        token,
        seeds: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_envelopes_say_what_is_wrong() {
        let good = Envelope {
            key_id: "k1".into(),
            encapsulated_key: vec![1; 32],
            ciphertext: vec![2; 40],
            chunk: None,
            token: None,
            seeds: None,
        };
        let build = |entries: Vec<(Value, Value)>| {
            let mut out = Vec::new();
            ciborium::into_writer(&Value::Map(entries), &mut out).unwrap();
            out
        };
        let t = |s: &str| Value::Text(s.into());
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"\xff\xff".to_vec(), "not a CBOR"),
            (build(vec![]), "`v` is missing"),
            (build(vec![(t("v"), Value::Integer(1.into()))]), "version 1"),
            (build(vec![(t("v"), t("1"))]), "wrong type"),
            (
                build(vec![(t("v"), Value::Integer(2.into())), (t("x"), t("y"))]),
                "unknown key `x`",
            ),
            (
                build(vec![
                    (t("v"), Value::Integer(2.into())),
                    (t("key_id"), t("k")),
                    (t("enc"), Value::Bytes(vec![1; 31])),
                    (t("ct"), Value::Bytes(vec![0; 20])),
                ]),
                "32 bytes",
            ),
            (
                build(vec![
                    (t("v"), Value::Integer(2.into())),
                    (t("v"), Value::Integer(2.into())),
                ]),
                "twice",
            ),
        ];
        for (bytes, expected) in cases {
            let error = Envelope::from_cbor(&bytes).unwrap_err().to_string();
            assert!(error.contains(expected), "{expected}: {error}");
        }
        assert!(Envelope::from_cbor(&good.to_cbor()).is_ok());
    }
}
