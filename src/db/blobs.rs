//! The `blobs` table, where releases before the contribution log kept contributions: only counted
//! now, so a data directory that still holds some is refused at start (`blob::open_stores`).

use super::{Db, DbError};

impl Db {
    /// How many contributions the `blobs` table still holds.
    pub async fn contributions_in_database(&self) -> Result<i64, DbError> {
        Ok(sqlx::query_scalar("SELECT COUNT(*) FROM blobs")
            .fetch_one(self.pool())
            .await?)
    }
}
