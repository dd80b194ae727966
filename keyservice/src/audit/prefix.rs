//! The SHA-256 of an audit log's bytes, kept as the log grows. A checkpoint signs the digest of
//! the prefix it stands for, so an edit anywhere inside that prefix (a record rewritten in place,
//! the same length or not) refuses the start, at the cost of hashing the prefix once per start
//! (no signature is verified for it): `PrefixDigest::of_file`.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

#[derive(Clone, Default)]
pub struct PrefixDigest(Sha256);

impl std::fmt::Debug for PrefixDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrefixDigest({})", self.hex())
    }
}

impl PrefixDigest {
    /// The digest of the file's bytes `[0, length)`.
    pub fn of_file(path: &Path, length: u64) -> std::io::Result<Self> {
        let mut digest = Self::default();
        digest.extend_from_file(path, 0, length)?;
        Ok(digest)
    }

    /// Adds the file's bytes `[from, to)`.
    pub fn extend_from_file(&mut self, path: &Path, from: u64, to: u64) -> std::io::Result<()> {
        use std::io::Seek;
        if to <= from {
            return Ok(()); // nothing to add (a log not created yet has no bytes)
        }
        let mut file = std::fs::File::open(path)?;
        file.seek(std::io::SeekFrom::Start(from))?;
        let mut left = to.saturating_sub(from);
        let mut buffer = vec![0u8; 1 << 20];
        while left > 0 {
            let want = usize::try_from(left.min(buffer.len() as u64)).unwrap_or(buffer.len());
            let read = file.read(&mut buffer[..want])?;
            if read == 0 {
                return Err(std::io::Error::other("the log is shorter than expected"));
            }
            self.0.update(&buffer[..read]);
            left -= read as u64;
        }
        Ok(())
    }

    /// Adds bytes appended to the log.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Lowercase hex of the digest so far.
    pub fn hex(&self) -> String {
        confed_protocol::hex::encode(self.0.clone().finalize())
    }
}
