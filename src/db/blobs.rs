//! Write-once objects stored in the task database (the embedded default's contribution store).

use super::{Db, DbError};

/// What storing an object did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredBlob {
    Created,
    SameBytes,
    DifferentBytes,
}

impl Db {
    /// Stores `bytes` under `key` unless the key exists; durable when this returns.
    pub async fn put_blob(
        &self,
        key: &str,
        sha256_hex: &str,
        bytes: Vec<u8>,
    ) -> Result<StoredBlob, DbError> {
        let (key, sha256_hex) = (key.to_string(), sha256_hex.to_string());
        self.write(move |conn| {
            Box::pin(async move {
                let inserted = sqlx::query(
                    "INSERT INTO blobs (key, sha256, bytes) VALUES ($1, $2, $3) ON CONFLICT (key) DO NOTHING",
                )
                .bind(&key)
                .bind(&sha256_hex)
                .bind(bytes)
                .execute(&mut *conn)
                .await?;
                if inserted.rows_affected() == 1 {
                    return Ok(StoredBlob::Created);
                }
                let existing: String = sqlx::query_scalar("SELECT sha256 FROM blobs WHERE key = $1")
                    .bind(&key)
                    .fetch_one(&mut *conn)
                    .await?;
                Ok(if existing == sha256_hex { StoredBlob::SameBytes } else { StoredBlob::DifferentBytes })
            })
        })
        .await
    }

    pub async fn get_blob(&self, key: &str) -> Result<Option<Vec<u8>>, DbError> {
        Ok(sqlx::query_scalar("SELECT bytes FROM blobs WHERE key = $1")
            .bind(key)
            .fetch_optional(self.pool())
            .await?)
    }
}
