//! The `blobs` table, where releases before the contribution log kept contributions: only counted
//! now, so a data directory that still holds some is refused at start.

use super::{Db, DbError};

impl Db {
    /// Whether the `blobs` table still holds any contribution (without scanning it).
    pub async fn has_contributions_in_database(&self) -> Result<bool, DbError> {
        let any: Option<i64> = sqlx::query_scalar("SELECT 1 FROM blobs LIMIT 1")
            .fetch_optional(self.pool())
            .await?;
        Ok(any.is_some())
    }

    /// Releases before the contribution log kept contributions in the task database's `blobs`
    /// table; this one no longer reads them. Their rounds' retention deletes them, so a data
    /// directory upgraded after one retention window holds none; one that still does is refused
    /// at start rather than failing those rounds' jobs with "not found" (docs/operations.md,
    /// "Upgrades").
    pub async fn refuse_contributions_in_the_database(&self) -> Result<(), DbError> {
        if self.has_contributions_in_database().await? {
            return Err(DbError::Upgrade(
                "the task database still holds contributions stored before the contribution log, which this release does not read; run the previous release until retention has deleted them (--retention-minutes after their rounds close), or, if their rounds are COMPLETED or FAILED, delete them with DELETE FROM blobs",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_data_directory_still_holding_contributions_in_the_database_is_refused_saying_what_to_do()
     {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open_sqlite(&dir.path().join("t.db")).await.unwrap();
        assert!(db.refuse_contributions_in_the_database().await.is_ok());
        sqlx::query("INSERT INTO blobs (key, sha256, bytes) VALUES ($1, $2, $3)")
            .bind("a/b.cbor")
            .bind("digest")
            .bind(b"stored before the log".to_vec())
            .execute(db.pool())
            .await
            .unwrap();
        let refused = db
            .refuse_contributions_in_the_database()
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(refused.contains("still holds contributions"), "{refused}");
        assert!(refused.contains("previous release"), "{refused}");
    }
}
