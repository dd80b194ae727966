//! A blob store inside the task database. Contributions of the embedded default lived here before
//! the contribution log (`log.rs`); it stays as the log's fallback so those can still be read.

use sha2::{Digest, Sha256};

use super::{BlobError, BlobFuture, BlobKey, BlobStore, PutOutcome};
use crate::db::{Db, StoredBlob};

#[derive(Debug, Clone)]
pub struct DatabaseBlobStore {
    db: Db,
}

impl DatabaseBlobStore {
    pub fn new(db: Db) -> Self {
        Self { db }
    }
}

fn io(key: &BlobKey, error: impl std::fmt::Display) -> BlobError {
    BlobError::Io {
        key: key.as_str().to_string(),
        source: std::io::Error::other(error.to_string()),
    }
}

impl BlobStore for DatabaseBlobStore {
    fn put<'a>(&'a self, key: &'a BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            let digest: String = Sha256::digest(bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            match self
                .db
                .put_blob(key.as_str(), &digest, bytes.to_vec())
                .await
                .map_err(|e| io(key, e))?
            {
                StoredBlob::Created => Ok(PutOutcome::Created),
                StoredBlob::SameBytes => Ok(PutOutcome::AlreadyPresent),
                StoredBlob::DifferentBytes => Err(BlobError::Conflict(key.as_str().to_string())),
            }
        })
    }

    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            self.db
                .get_blob(key.as_str())
                .await
                .map_err(|e| io(key, e))?
                .ok_or_else(|| BlobError::NotFound(key.as_str().to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn write_once_semantics_match_the_directory_store() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        let store = DatabaseBlobStore::new(db);
        let key = BlobKey::new("a/b.cbor").unwrap();
        assert_eq!(store.put(&key, b"one").await.unwrap(), PutOutcome::Created);
        assert_eq!(
            store.put(&key, b"one").await.unwrap(),
            PutOutcome::AlreadyPresent
        );
        assert!(matches!(
            store.put(&key, b"two").await,
            Err(BlobError::Conflict(_))
        ));
        assert_eq!(store.get(&key).await.unwrap(), b"one");
        let missing = BlobKey::new("a/none").unwrap();
        assert!(matches!(
            store.get(&missing).await,
            Err(BlobError::NotFound(_))
        ));
    }
}
