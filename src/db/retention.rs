//! Local retention: the contributions of a round that closed (COMPLETED or FAILED) longer than
//! the retention window ago are deleted — their assignment rows, the rows' state history, and
//! stored bytes kept in the database — in bounded batches. The round row (with its counters),
//! its release and its model stay. A round is purged once (`contributions_purged_at`).

use super::{Db, DbError};

impl Db {
    /// Purges the contributions of at most `max_rounds` rounds closed before `closed_before`;
    /// returns the rounds purged.
    pub async fn purge_closed_rounds(
        &self,
        closed_before: i64,
        now: i64,
        max_rounds: i64,
    ) -> Result<Vec<String>, DbError> {
        self.write(move |tx| {
            Box::pin(async move {
                let rounds: Vec<String> = sqlx::query_scalar(
                    "SELECT id FROM rounds WHERE contributions_purged_at IS NULL \
                     AND closed_at IS NOT NULL AND closed_at < $1 \
                     AND state IN ('COMPLETED', 'FAILED') ORDER BY closed_at LIMIT $2",
                )
                .bind(closed_before)
                .bind(max_rounds)
                .fetch_all(&mut *tx)
                .await?;
                for round in &rounds {
                    sqlx::query(
                        "DELETE FROM blobs WHERE key IN (SELECT blob_key FROM assignments \
                         WHERE round_id = $1 AND blob_key IS NOT NULL)",
                    )
                    .bind(round)
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query(
                        "DELETE FROM state_history WHERE entity = 'assignment' AND entity_id IN \
                         (SELECT id FROM assignments WHERE round_id = $1)",
                    )
                    .bind(round)
                    .execute(&mut *tx)
                    .await?;
                    sqlx::query("DELETE FROM assignments WHERE round_id = $1")
                        .bind(round)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("UPDATE rounds SET contributions_purged_at = $1 WHERE id = $2")
                        .bind(now)
                        .bind(round)
                        .execute(&mut *tx)
                        .await?;
                }
                Ok(rounds)
            })
        })
        .await
    }

    /// The smallest contribution-log key any assignment row still names (`log/<segment>/...`,
    /// segment numbers zero-padded, so the smallest key names the oldest segment in use).
    pub async fn oldest_log_key_in_use(&self) -> Result<Option<String>, DbError> {
        Ok(
            sqlx::query_scalar("SELECT MIN(blob_key) FROM assignments WHERE blob_key LIKE 'log/%'")
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Whether a round's contributions were purged (it can then not be aggregated again).
    pub async fn contributions_purged(&self, round_id: &str) -> Result<bool, DbError> {
        let at: Option<i64> =
            sqlx::query_scalar("SELECT contributions_purged_at FROM rounds WHERE id = $1")
                .bind(round_id)
                .fetch_optional(self.pool())
                .await?
                .flatten();
        Ok(at.is_some())
    }
}
