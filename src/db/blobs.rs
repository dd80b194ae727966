//! The `blobs` table, where releases before the contribution log kept contributions: only counted
//! now, so a data directory that still holds some is refused at start (`blob::open_stores`).

use super::{Db, DbError};

impl Db {
    /// Whether the `blobs` table still holds any contribution (without scanning it).
    pub async fn has_contributions_in_database(&self) -> Result<bool, DbError> {
        let any: Option<i64> = sqlx::query_scalar("SELECT 1 FROM blobs LIMIT 1")
            .fetch_optional(self.pool())
            .await?;
        Ok(any.is_some())
    }
}
