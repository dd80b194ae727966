//! Lowercase hex, the one encoding of digests and ids in confed (the `hex` crate), and the
//! SHA-256 digest every party names bytes by.

use sha2::{Digest, Sha256};

/// Lowercase hex of `bytes`.
pub fn encode(bytes: impl AsRef<[u8]>) -> String {
    hex::encode(bytes)
}

/// The bytes of lowercase or uppercase hex text, or `None` if it is not hex.
pub fn decode(text: &str) -> Option<Vec<u8>> {
    hex::decode(text).ok()
}

/// Whether `text` is a 32-byte digest (SHA-256, BLAKE3) as confed writes one: exactly 64
/// lowercase hex digits. The one check of that form; uppercase is refused so that one digest has
/// one spelling.
pub fn is_digest_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The 32 bytes of a digest written as `is_digest_hex` requires, or `None`.
pub fn parse_digest(text: &str) -> Option<[u8; 32]> {
    if !is_digest_hex(text) {
        return None;
    }
    decode(text)?.try_into().ok()
}

/// Lowercase hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    encode(Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_the_empty_string_is_the_well_known_digest() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(decode("00ff"), Some(vec![0, 255]));
        assert_eq!(decode("0g"), None);
    }

    #[test]
    fn a_digest_is_64_lowercase_hex_digits_and_nothing_else() {
        let digest = sha256_hex(b"");
        assert!(is_digest_hex(&digest));
        assert_eq!(parse_digest(&digest).map(encode), Some(digest.clone()));
        assert!(
            !is_digest_hex(&digest.to_uppercase()),
            "one spelling per digest"
        );
        assert!(!is_digest_hex(&digest[..63]));
        assert!(!is_digest_hex(&format!("{digest}0")));
        assert_eq!(parse_digest("g".repeat(64).as_str()), None);
    }
}
