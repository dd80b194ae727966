//! Where bytes live: models, plans, contributions and aggregates. Callers name objects by a
//! `BlobKey` and never learn which backend holds them, so a cloud store slots in behind the same
//! trait. Objects are write-once: a key that exists is never overwritten.

mod cache;
mod gcs;
mod keys;
mod local;
mod log;

use std::future::Future;
use std::pin::Pin;

use thiserror::Error;

pub use gcs::{Gcs, GcsBlobStore, GcsConfig};
pub use keys::is_partition_key;
pub use local::LocalBlobStore;
pub use log::ContributionLog;

/// A validated object name: `/`-separated segments of `A-Z a-z 0-9 . _ -`, no `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlobKey(String);

impl BlobKey {
    pub fn new(key: impl Into<String>) -> Result<Self, BlobError> {
        let key = key.into();
        // No segment starts with a dot: `.`, `..`, and the local store's temporary names
        // (`.<name>.<uuid>.partial`, swept at open) are never keys.
        let segment_ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if key.len() <= 1024 && key.split('/').all(segment_ok) {
            Ok(Self(key))
        } else {
            Err(BlobError::InvalidKey(key))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Debug, Error)]
pub enum BlobError {
    #[error("invalid blob key {0:?}")]
    InvalidKey(String),
    #[error("blob {0} already exists with different content")]
    Conflict(String),
    #[error("blob {0} not found")]
    NotFound(String),
    #[error("blob store error on {key}: {message}")]
    Remote { key: String, message: String },
    #[error("blob store setup: {0}")]
    Setup(String),
    #[error("blob store I/O error on {key}: {source}")]
    Io {
        key: String,
        #[source]
        source: std::io::Error,
    },
}

/// Whether an I/O error means the disk (or a quota) is full: ENOSPC, EDQUOT.
pub fn is_disk_full(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::ENOSPC) | Some(libc::EDQUOT)
    ) || error.kind() == std::io::ErrorKind::StorageFull
        || error.kind() == std::io::ErrorKind::QuotaExceeded
}

/// A file's whole content, read by offset (its position is not used or moved).
pub(crate) fn read_whole(file: &std::fs::File) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    FileFromStart::new(file).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Reads a file from its start by offset (`pread`), leaving its position alone: the same open
/// file can be read this way more than once.
pub(crate) struct FileFromStart<'a> {
    file: &'a std::fs::File,
    at: u64,
}

impl<'a> FileFromStart<'a> {
    pub(crate) fn new(file: &'a std::fs::File) -> Self {
        Self { file, at: 0 }
    }
}

impl std::io::Read for FileFromStart<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buffer, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// The stores of one process: GCS when configured (`blobs/` and `contributions/` under the
/// bucket's prefix), else `<data dir>/blobs` and the contribution log.
pub async fn open_stores(
    data_dir: &std::path::Path,
    gcs: Option<&GcsConfig>,
) -> Result<(std::sync::Arc<dyn BlobStore>, std::sync::Arc<dyn BlobStore>), BlobError> {
    if let Some(config) = gcs {
        let gcs = Gcs::connect(config.clone()).await?;
        return Ok((
            std::sync::Arc::new(gcs.cached_store("blobs")),
            std::sync::Arc::new(gcs.store("contributions")),
        ));
    }
    Ok((
        std::sync::Arc::new(LocalBlobStore::open(data_dir.join("blobs"))?),
        embedded_contributions(data_dir)?,
    ))
}

/// The embedded default's contribution store: the log in `<data dir>/contributions`.
pub fn embedded_contributions(
    data_dir: &std::path::Path,
) -> Result<std::sync::Arc<dyn BlobStore>, BlobError> {
    Ok(std::sync::Arc::new(ContributionLog::open(
        data_dir.join("contributions"),
    )?))
}

/// Counts and logs a full disk under the database, the blob store or a spool.
pub fn note_disk_full(cause: &dyn std::fmt::Display) {
    metrics::counter!("confed_disk_full_total").increment(1);
    tracing::error!(%cause, "storage is full; requests that write are refused");
}

impl BlobError {
    /// Counts and logs this error if it is an outage (a cloud store's failure, a full disk)
    /// and says whether it was, as `DbError::note_outage` does for the database.
    pub fn note_outage(&self) -> bool {
        match self {
            BlobError::Remote { .. } => {
                metrics::counter!("confed_blob_store_errors_total").increment(1);
                tracing::warn!(error = %self, "blob store unavailable");
                true
            }
            BlobError::Io { source, .. } if is_disk_full(source) => {
                note_disk_full(self);
                true
            }
            _ => false,
        }
    }
}

pub type BlobFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BlobError>> + Send + 'a>>;

/// Whether `put` created the object or found the same bytes already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    AlreadyPresent,
}

/// What the server learns of an object it did not write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    /// `<algorithm>:<hex>`: `md5:` from GCS metadata, `sha256:` where the store reads the bytes.
    pub digest: String,
}

impl ObjectInfo {
    pub fn of(bytes: &[u8]) -> Self {
        let hex = confed_protocol::hex::sha256_hex(bytes);
        Self {
            size: bytes.len() as u64,
            digest: format!("sha256:{hex}"),
        }
    }
}

/// Reads sealed objects on the calling thread (`BlobStore::sealed_reader`).
pub trait SealedReader: Send + Sync {
    /// `BlobStore::get_sealed_into`, on the calling thread.
    fn get_sealed_into(&self, key: &BlobKey, buffer: Vec<u8>) -> Result<Vec<u8>, BlobError>;
}

/// A device's upload straight to the store: PUT the bytes to `url` with exactly `headers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectUpload {
    pub url: String,
    pub headers: std::collections::BTreeMap<String, String>,
}

pub trait BlobStore: Send + Sync + std::fmt::Debug {
    /// Stores `bytes` under `key` durably before returning. Storing the same bytes again is a
    /// no-op (`AlreadyPresent`); different bytes under an existing key are refused (`Conflict`).
    fn put<'a>(&'a self, key: &'a BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome>;

    /// `put` of a file's whole content (a spooled upload; read from its start whatever its
    /// position), streamed where the store can, so a large object is never held whole in
    /// memory. The default reads the file and calls `put`.
    fn put_file<'a>(
        &'a self,
        key: &'a BlobKey,
        file: &'a std::fs::File,
    ) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            let bytes = read_whole(file).map_err(|source| BlobError::Io {
                key: key.as_str().to_string(),
                source,
            })?;
            self.put(key, &bytes).await
        })
    }

    /// The whole object.
    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>>;

    /// The whole object, for a reader that authenticates it itself (a contribution envelope,
    /// whose AEAD tag the enclave checks): a store may skip its own integrity digest, which would
    /// hash every byte a second time. Whoever can rewrite the store can rewrite that digest too,
    /// so it protects against accidents only, and the AEAD catches those as well (the
    /// contribution is excluded). Same as `get` unless a store overrides it.
    fn get_sealed<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        self.get(key)
    }

    /// Bytes `[offset, offset + len)` of an object (fewer at its end): what the front end reads
    /// of a direct upload to check its device token without the update. Cloud stores read only
    /// those bytes; the default reads the object.
    fn get_range<'a>(&'a self, key: &'a BlobKey, offset: u64, len: u64) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let bytes = self.get_sealed(key).await?;
            let start = usize::try_from(offset)
                .unwrap_or(usize::MAX)
                .min(bytes.len());
            let end = start
                .saturating_add(usize::try_from(len).unwrap_or(usize::MAX))
                .min(bytes.len());
            Ok(bytes[start..end].to_vec())
        })
    }

    /// `get_sealed`, reading into `buffer` (whatever its length and contents) where the store
    /// can, so a reader going through many objects reuses its memory.
    fn get_sealed_into<'a>(&'a self, key: &'a BlobKey, buffer: Vec<u8>) -> BlobFuture<'a, Vec<u8>> {
        drop(buffer);
        self.get_sealed(key)
    }

    /// Deletes an object nothing needs any more (a completed round's sealed partitions): the
    /// one exception to write-once, for intermediates only. Deleting one that is not there is
    /// not an error. A store whose objects of that kind expire by a rule of their own keeps the
    /// default, which deletes nothing (GCS: the bucket's lifecycle rule for `*.partition`,
    /// deploy/terraform).
    fn discard<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, ()> {
        let _ = key;
        Box::pin(async { Ok(()) })
    }

    /// A reader of sealed objects on the calling thread, for a store whose reads are local file
    /// reads (the contribution log): the in-process worker reads, checks and opens each
    /// contribution on one thread. `None` (the default): reads go through `get_sealed_into`.
    fn sealed_reader(&self) -> Option<std::sync::Arc<dyn SealedReader>> {
        None
    }

    /// Size and digest of a stored object (`None` when there is none). Cloud stores answer from
    /// metadata; the default reads the object.
    fn stat<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Option<ObjectInfo>> {
        Box::pin(async move {
            match self.get(key).await {
                Ok(bytes) => Ok(Some(ObjectInfo::of(&bytes))),
                Err(BlobError::NotFound(_)) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    /// Whether devices upload straight to the store (`direct_upload`) rather than through the
    /// server's upload route.
    fn accepts_direct_uploads(&self) -> bool {
        false
    }

    /// Deletes whole storage units (the contribution log's segments) that hold nothing at or
    /// after `oldest_referenced` (the smallest key any database row still names; `None`: no row
    /// names any) and were last written more than `idle` ago; returns how many. Stores that
    /// delete per object, or not at all (GCS: its lifecycle rule), keep everything.
    fn retire_unreferenced<'a>(
        &'a self,
        _oldest_referenced: Option<&'a str>,
        _idle: std::time::Duration,
    ) -> BlobFuture<'a, usize> {
        Box::pin(async { Ok(0) })
    }

    /// Where and how a device PUTs the object itself (a short-lived signed URL on a cloud store,
    /// for 1 to `max_bytes` bytes), or `None` when uploads go through the server (the local
    /// stores).
    fn direct_upload<'a>(
        &'a self,
        _key: &'a BlobKey,
        _valid_for: std::time::Duration,
        _max_bytes: u64,
    ) -> BlobFuture<'a, Option<DirectUpload>> {
        Box::pin(async { Ok(None) })
    }

    /// Stores a new object durably and returns the key to read it back by: `key` itself on a
    /// keyed store (different bytes under an existing key are a `Conflict`), or a key naming the
    /// place on a store that places objects itself (`ContributionLog`).
    fn put_new<'a>(&'a self, key: BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, BlobKey> {
        Box::pin(async move {
            self.put(&key, bytes).await?;
            Ok(key)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_refuse_traversal_and_odd_characters() {
        for bad in [
            "", "/a", "a/", "a//b", "../x", "a/../b", "a/./b", "a b", "a\\b", "ä",
        ] {
            assert!(BlobKey::new(bad).is_err(), "{bad:?}");
        }
        assert!(BlobKey::new("tenants/t1/tasks/x/models/0-ab.safetensors").is_ok());
    }
}
