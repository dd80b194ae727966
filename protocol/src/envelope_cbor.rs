//! The envelope's CBOR decoding, strict and without copying: the ciphertext stays a slice of
//! the stored bytes (for a 1 MB update, one copy and one fresh allocation fewer per contribution
//! in the enclave's hot loop). Accepted: exactly one definite-length map with text keys `v`
//! (uint), `key_id` (text), `enc` (bytes), `ct` (bytes) and optionally `chunk` (uint), `token`
//! (bytes) and `seeds` (bytes), in any
//! order, no duplicates, nothing after the map. Indefinite lengths, tags and floats are refused.
//!
//! The same decoder reads an envelope's other fields from windows of a stored object without its
//! ciphertext (`envelope_scan`): the source of the bytes is a parameter (`Source`).

use super_envelope::{EnvelopeError, EnvelopeRef, validate};

use crate::envelope as super_envelope;

/// Where the decoder's bytes come from.
pub(crate) trait Source<'a> {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError>;
}

impl<'a, S: Source<'a> + ?Sized> Source<'a> for &mut S {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        (**self).take(n)
    }
}

/// The whole envelope in memory.
struct Whole<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Source<'a> for Whole<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| cbor("unexpected end of input"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
}

pub(crate) struct Reader<S> {
    pub(crate) source: S,
}

pub(crate) fn cbor(reason: impl Into<String>) -> EnvelopeError {
    EnvelopeError::Cbor(reason.into())
}

impl<'a, S: Source<'a>> Reader<S> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], EnvelopeError> {
        self.source.take(n)
    }

    /// One item's head: (major type, argument).
    pub(crate) fn head(&mut self) -> Result<(u8, u64), EnvelopeError> {
        let first = self.take(1)?[0];
        let major = first >> 5;
        let info = first & 0x1f;
        let argument = match info {
            0..=23 => u64::from(info),
            24 => u64::from(self.take(1)?[0]),
            25 => u64::from(u16::from_be_bytes(
                self.take(2)?.try_into().expect("2 bytes"),
            )),
            26 => u64::from(u32::from_be_bytes(
                self.take(4)?.try_into().expect("4 bytes"),
            )),
            27 => u64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")),
            31 => {
                return Err(cbor(
                    "indefinite-length items are not accepted; use definite lengths",
                ));
            }
            _ => return Err(cbor(format!("reserved additional information {info}"))),
        };
        Ok((major, argument))
    }

    pub(crate) fn length(&mut self, argument: u64) -> Result<usize, EnvelopeError> {
        usize::try_from(argument).map_err(|_| cbor("length out of range"))
    }
}

/// A value of the envelope's map.
pub(crate) enum Item<'a> {
    Uint(u64),
    Bytes(&'a [u8]),
    Text(&'a str),
}

pub(crate) fn item<'a, S: Source<'a>>(reader: &mut Reader<S>) -> Result<Item<'a>, EnvelopeError> {
    match reader.head()? {
        (0, value) => Ok(Item::Uint(value)),
        (2, length) => {
            let length = reader.length(length)?;
            Ok(Item::Bytes(reader.take(length)?))
        }
        (3, length) => {
            let length = reader.length(length)?;
            std::str::from_utf8(reader.take(length)?)
                .map(Item::Text)
                .map_err(|_| cbor("a text string is not UTF-8"))
        }
        (major, _) => Err(EnvelopeError::Shape(format!(
            "a value has CBOR major type {major}; the envelope holds only unsigned integers, byte strings and text"
        ))),
    }
}

/// Parses an envelope, borrowing its byte strings from `bytes`.
pub(crate) fn parse(bytes: &[u8]) -> Result<EnvelopeRef<'_>, EnvelopeError> {
    let mut reader = Reader {
        source: Whole { bytes, at: 0 },
    };
    let (major, entries) = reader.head()?;
    if major != 5 {
        return Err(EnvelopeError::Shape("the top level is not a map".into()));
    }
    let (mut version, mut key_id, mut enc, mut ct, mut chunk) = (None, None, None, None, None);
    let (mut token, mut seeds) = (None, None);
    for _ in 0..entries {
        let key = match item(&mut reader)? {
            Item::Text(key) => key,
            _ => return Err(EnvelopeError::Shape("a key is not text".into())),
        };
        let value = item(&mut reader)?;
        let duplicate = match (key, value) {
            ("v", Item::Uint(v)) => version.replace(v).is_some(),
            ("key_id", Item::Text(t)) => key_id.replace(t).is_some(),
            ("enc", Item::Bytes(b)) => enc.replace(b).is_some(),
            ("ct", Item::Bytes(b)) => ct.replace(b).is_some(),
            ("chunk", Item::Uint(c)) => chunk.replace(c).is_some(),
            ("token", Item::Bytes(b)) => token.replace(b).is_some(),
            ("seeds", Item::Bytes(b)) => seeds.replace(b).is_some(),
            (name @ ("v" | "key_id" | "enc" | "ct" | "chunk" | "token" | "seeds"), _) => {
                return Err(EnvelopeError::Shape(format!("`{name}` has the wrong type")));
            }
            (other, _) => return Err(EnvelopeError::Shape(format!("unknown key `{other}`"))),
        };
        if duplicate {
            return Err(EnvelopeError::Shape(format!("`{key}` appears twice")));
        }
    }
    if reader.source.at != bytes.len() {
        return Err(cbor("bytes follow the envelope's map"));
    }
    validate(version, key_id, enc, ct, chunk, token, seeds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for length in 0..400 {
            let bytes: Vec<u8> = (0..length)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let _ = parse(&bytes);
            // Also every prefix of a valid envelope.
        }
        let envelope = super_envelope::Envelope {
            key_id: "k".into(),
            encapsulated_key: vec![1; 32],
            ciphertext: vec![2; 100],
            chunk: None,
            token: None,
            seeds: None,
        }
        .to_cbor();
        for end in 0..envelope.len() {
            assert!(parse(&envelope[..end]).is_err());
        }
        assert!(parse(&envelope).is_ok());
    }

    #[test]
    fn indefinite_lengths_trailing_bytes_and_huge_lengths_are_refused() {
        assert!(
            parse(&[0xbf])
                .unwrap_err()
                .to_string()
                .contains("indefinite")
        );
        let mut trailing = super_envelope::Envelope {
            key_id: "k".into(),
            encapsulated_key: vec![1; 32],
            ciphertext: vec![2; 16],
            chunk: None,
            token: None,
            seeds: None,
        }
        .to_cbor();
        trailing.push(0);
        assert!(parse(&trailing).unwrap_err().to_string().contains("follow"));
        // A map claiming 2^64-1 entries, a byte string claiming 2^64-1 bytes.
        assert!(parse(&[0xbb, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(
            parse(&[
                0xa1, 0x62, b'c', b't', 0x5b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
            ])
            .is_err()
        );
    }
}
