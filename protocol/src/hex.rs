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
}
