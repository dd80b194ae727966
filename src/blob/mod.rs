//! Where bytes live: models, plans, contributions and aggregates. Callers name objects by a
//! `BlobKey` and never learn which backend holds them, so a cloud store slots in behind the same
//! trait. Objects are write-once: a key that exists is never overwritten.

mod database;
mod local;
mod log;

use std::future::Future;
use std::pin::Pin;

use thiserror::Error;

pub use database::DatabaseBlobStore;
pub use local::LocalBlobStore;
pub use log::ContributionLog;

/// A validated object name: `/`-separated segments of `A-Z a-z 0-9 . _ -`, no `.` or `..`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlobKey(String);

impl BlobKey {
    pub fn new(key: impl Into<String>) -> Result<Self, BlobError> {
        let key = key.into();
        let segment_ok = |s: &str| {
            !s.is_empty()
                && s != "."
                && s != ".."
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        if key.len() <= 1024 && key.split('/').all(segment_ok) {
            Ok(Self(key))
        } else {
            Err(BlobError::InvalidKey(key))
        }
    }

    /// Key of a task's model version, including the content hash so a retried upload after a
    /// crash never collides with an orphan of the first attempt.
    pub fn model(
        tenant_id: &str,
        task_id: &str,
        version: i64,
        sha256_hex: &str,
    ) -> Result<Self, BlobError> {
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/models/{version}-{sha256_hex}.safetensors"
        ))
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
    #[error("blob store I/O error on {key}: {source}")]
    Io {
        key: String,
        #[source]
        source: std::io::Error,
    },
}

/// The embedded default's contribution store: the log in `<data dir>/contributions`, reading
/// older contributions from the task database.
pub fn embedded_contributions(
    data_dir: &std::path::Path,
    db: &crate::db::Db,
) -> Result<std::sync::Arc<dyn BlobStore>, BlobError> {
    let fallback = std::sync::Arc::new(DatabaseBlobStore::new(db.clone()));
    Ok(std::sync::Arc::new(ContributionLog::open(
        data_dir.join("contributions"),
        fallback,
    )?))
}

pub type BlobFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BlobError>> + Send + 'a>>;

/// Whether `put` created the object or found the same bytes already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    Created,
    AlreadyPresent,
}

pub trait BlobStore: Send + Sync + std::fmt::Debug {
    /// Stores `bytes` under `key` durably before returning. Storing the same bytes again is a
    /// no-op (`AlreadyPresent`); different bytes under an existing key are refused (`Conflict`).
    fn put<'a>(&'a self, key: &'a BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome>;

    /// The whole object.
    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>>;

    /// A URL a device can PUT the object to directly (a short-lived signed URL on a cloud store),
    /// or `None` when uploads go through the server's own upload route (the local stores).
    fn direct_upload_url(&self, _key: &BlobKey, _expires_at_unix: i64) -> Option<String> {
        None
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
