//! Contributions of the embedded default stored inside the task database (the `blobs` table)
//! before the contribution log (`log.rs`) existed: read-only, the log's fallback for keys that are
//! not log locations. Nothing writes here any more, and retention deletes these rows with their
//! rounds, so after one retention window past an upgrade the table is empty and this reader can go.

use super::{BlobError, BlobFuture, BlobKey, BlobStore, PutOutcome};
use crate::db::Db;

#[derive(Debug, Clone)]
pub struct LegacyDatabaseContributions {
    db: Db,
}

impl LegacyDatabaseContributions {
    pub fn new(db: Db) -> Self {
        Self { db }
    }
}

impl BlobStore for LegacyDatabaseContributions {
    fn put<'a>(&'a self, key: &'a BlobKey, _bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            Err(BlobError::Io {
                key: key.as_str().to_string(),
                source: std::io::Error::other(
                    "contributions stored in the task database are read-only (the contribution log stores new ones)",
                ),
            })
        })
    }

    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            self.db
                .get_blob(key.as_str())
                .await
                .map_err(|e| BlobError::Io {
                    key: key.as_str().to_string(),
                    source: std::io::Error::other(e),
                })?
                .ok_or_else(|| BlobError::NotFound(key.as_str().to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rows_written_before_the_log_are_read_and_nothing_new_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        sqlx::query("INSERT INTO blobs (key, sha256, bytes) VALUES ($1, $2, $3)")
            .bind("a/b.cbor")
            .bind("digest")
            .bind(b"one".to_vec())
            .execute(db.pool())
            .await
            .unwrap();
        let store = LegacyDatabaseContributions::new(db);
        let key = BlobKey::new("a/b.cbor").unwrap();
        assert_eq!(store.get(&key).await.unwrap(), b"one");
        let missing = BlobKey::new("a/none").unwrap();
        assert!(matches!(
            store.get(&missing).await,
            Err(BlobError::NotFound(_))
        ));
        let refused = store.put(&missing, b"two").await.unwrap_err().to_string();
        assert!(
            refused.contains("read-only") || refused.contains("a/none"),
            "{refused}"
        );
    }
}
