//! An envelope's fields other than its ciphertext, read from at most two small windows of a
//! stored object: its first bytes and, when fields follow the ciphertext (the reference clients
//! write `token` last), the bytes after it. The front end checks the device token of a
//! contribution uploaded straight to the blob store this way, reading kilobytes rather than the
//! update (docs/protocol.md, "Upload straight to Google Cloud Storage").
//!
//! The decoding is `envelope_cbor`'s (the same strict rules); only the ciphertext is passed over
//! unread, so its chunk structure is not checked here (the enclave checks it when it opens it).

use crate::envelope::{EnvelopeError, VERSION};
use crate::envelope_cbor::{Item, Reader, Source, cbor, item};
use crate::{hpke, privacy_pass};

/// Bytes a scan reads from the start of the object, at most.
pub const HEAD_BYTES: u64 = 4096;
/// Bytes a scan reads after the ciphertext, at most (a token is 354 bytes, a masked task's
/// sealed seeds at most `masking::MAX_ENVELOPE_SEEDS_BYTES`).
pub const TAIL_BYTES: u64 = 12 * 1024;

/// An envelope's fields but its ciphertext.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvelopeHeader {
    pub key_id: String,
    pub encapsulated_key: Vec<u8>,
    pub chunk: Option<u32>,
    pub token: Option<Vec<u8>>,
    pub seeds: Option<Vec<u8>>,
    /// Where the ciphertext lies in the object: (offset, length).
    pub ciphertext: (u64, u64),
}

/// What a scan of an object's first bytes found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scan {
    Header(EnvelopeHeader),
    /// Fields follow the ciphertext: read the object's bytes `[at, total)` (at most
    /// `TAIL_BYTES`) and call `scan_with_tail`.
    NeedTail {
        at: u64,
    },
}

/// The object's first bytes and, once read, the bytes after its ciphertext.
struct Windows<'a> {
    head: &'a [u8],
    tail: Option<(u64, &'a [u8])>,
    at: u64,
    total: u64,
    /// Where the bytes ran out, when a read went past the head and no tail was given.
    ran_out_at: Option<u64>,
}

impl<'a> Source<'a> for Windows<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        let end = self
            .at
            .checked_add(n as u64)
            .filter(|&end| end <= self.total)
            .ok_or_else(|| cbor("unexpected end of input"))?;
        let head_len = self.head.len() as u64;
        let out = if end <= head_len {
            &self.head[self.at as usize..end as usize]
        } else {
            match self.tail {
                Some((start, tail)) if self.at >= start && end - start <= tail.len() as u64 => {
                    &tail[(self.at - start) as usize..(end - start) as usize]
                }
                Some(_) => return Err(cbor("the envelope's fields are not where a scan reads")),
                None => {
                    self.ran_out_at = Some(self.at);
                    return Err(cbor("the envelope's fields go on past the bytes read"));
                }
            }
        };
        self.at = end;
        Ok(out)
    }
}

fn shape(reason: impl Into<String>) -> EnvelopeError {
    EnvelopeError::Shape(reason.into())
}

/// Scans an object of `total` bytes from its first `min(total, HEAD_BYTES)` bytes, `head`.
pub fn scan(head: &[u8], total: u64) -> Result<Scan, EnvelopeError> {
    if head.len() as u64 != total.min(HEAD_BYTES) {
        return Err(cbor("a scan starts from the object's first bytes"));
    }
    let mut windows = Windows {
        head,
        tail: None,
        at: 0,
        total,
        ran_out_at: None,
    };
    match decode(&mut windows) {
        Ok(header) => Ok(Scan::Header(header)),
        Err(error) => match windows.ran_out_at {
            Some(at) if total - at <= TAIL_BYTES => Ok(Scan::NeedTail { at }),
            Some(at) => Err(shape(format!(
                "{} bytes follow the ciphertext or the first {HEAD_BYTES}; at most {TAIL_BYTES} may",
                total - at
            ))),
            None => Err(error),
        },
    }
}

/// Scans an object of `total` bytes from its first bytes `head` and its bytes `[at, total)`,
/// `tail` (`Scan::NeedTail`).
pub fn scan_with_tail(
    head: &[u8],
    at: u64,
    tail: &[u8],
    total: u64,
) -> Result<EnvelopeHeader, EnvelopeError> {
    if head.len() as u64 != total.min(HEAD_BYTES)
        || at.checked_add(tail.len() as u64) != Some(total)
    {
        return Err(cbor("a scan reads the object's first bytes and its last"));
    }
    decode(&mut Windows {
        head,
        tail: Some((at, tail)),
        at: 0,
        total,
        ran_out_at: None,
    })
}

/// The envelope's map, its ciphertext passed over; the checks of `envelope::validate` that do not
/// need the ciphertext's bytes.
fn decode(windows: &mut Windows<'_>) -> Result<EnvelopeHeader, EnvelopeError> {
    let mut reader = Reader { source: windows };
    let (major, entries) = reader.head()?;
    if major != 5 {
        return Err(shape("the top level is not a map"));
    }
    let (mut version, mut key_id, mut enc, mut ct, mut chunk) = (None, None, None, None, None);
    let (mut token, mut seeds) = (None, None);
    for _ in 0..entries {
        let key = match item(&mut reader)? {
            Item::Text(key) => key,
            _ => return Err(shape("a key is not text")),
        };
        if key == "ct" {
            let (major, length) = reader.head()?;
            if major != 2 {
                return Err(shape("`ct` has the wrong type"));
            }
            let start = reader.source.at;
            let end = start
                .checked_add(length)
                .filter(|&end| end <= reader.source.total)
                .ok_or_else(|| cbor("unexpected end of input"))?;
            reader.source.at = end;
            if ct.replace((start, length)).is_some() {
                return Err(shape("`ct` appears twice"));
            }
            continue;
        }
        let value = item(&mut reader)?;
        let duplicate = match (key, value) {
            ("v", Item::Uint(v)) => version.replace(v).is_some(),
            ("key_id", Item::Text(t)) => key_id.replace(t).is_some(),
            ("enc", Item::Bytes(b)) => enc.replace(b).is_some(),
            ("chunk", Item::Uint(c)) => chunk.replace(c).is_some(),
            ("token", Item::Bytes(b)) => token.replace(b).is_some(),
            ("seeds", Item::Bytes(b)) => seeds.replace(b).is_some(),
            (name @ ("v" | "key_id" | "enc" | "chunk" | "token" | "seeds"), _) => {
                return Err(shape(format!("`{name}` has the wrong type")));
            }
            (other, _) => return Err(shape(format!("unknown key `{other}`"))),
        };
        if duplicate {
            return Err(shape(format!("`{key}` appears twice")));
        }
    }
    if reader.source.at != reader.source.total {
        return Err(cbor("bytes follow the envelope's map"));
    }
    let missing = |name: &str| shape(format!("`{name}` is missing"));
    let version = version.ok_or_else(|| missing("v"))?;
    if version != VERSION {
        return Err(EnvelopeError::Version(version));
    }
    let encapsulated_key = enc.ok_or_else(|| missing("enc"))?;
    if encapsulated_key.len() != hpke::KEY_BYTES {
        return Err(shape("`enc` must be 32 bytes"));
    }
    let ciphertext = ct.ok_or_else(|| missing("ct"))?;
    if ciphertext.1 < 16 {
        return Err(shape("`ct` is shorter than an AEAD tag"));
    }
    let chunk = match chunk {
        None => None,
        Some(c) if (hpke::MIN_CHUNK as u64..=hpke::MAX_CHUNK as u64).contains(&c) => Some(c as u32),
        Some(c) => {
            return Err(shape(format!(
                "`chunk` {c} is outside {}..={}",
                hpke::MIN_CHUNK,
                hpke::MAX_CHUNK
            )));
        }
    };
    if token.is_some_and(|t| t.len() != privacy_pass::TOKEN_BYTES) {
        return Err(shape(format!(
            "`token` must be {} bytes (a Privacy Pass token of type 0x0002)",
            privacy_pass::TOKEN_BYTES
        )));
    }
    if seeds.is_some_and(|s| s.is_empty() || s.len() > crate::masking::MAX_ENVELOPE_SEEDS_BYTES) {
        return Err(shape(format!(
            "`seeds` must be 1 to {} bytes (the mask seeds sealed to each key service)",
            crate::masking::MAX_ENVELOPE_SEEDS_BYTES
        )));
    }
    Ok(EnvelopeHeader {
        key_id: key_id.ok_or_else(|| missing("key_id"))?.to_string(),
        encapsulated_key: encapsulated_key.to_vec(),
        chunk,
        token: token.map(<[u8]>::to_vec),
        seeds: seeds.map(<[u8]>::to_vec),
        ciphertext,
    })
}

#[cfg(test)]
mod tests;
