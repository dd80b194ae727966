//! Contributions stored in the task database before the contribution log: read-only now
//! (`blob::LegacyDatabaseContributions`).

use super::{Db, DbError};

impl Db {
    /// An object of the `blobs` table (contributions stored before the contribution log).
    pub async fn get_blob(&self, key: &str) -> Result<Option<Vec<u8>>, DbError> {
        Ok(sqlx::query_scalar("SELECT bytes FROM blobs WHERE key = $1")
            .bind(key)
            .fetch_optional(self.pool())
            .await?)
    }
}
