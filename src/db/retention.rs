//! Local retention: the contributions of a round that closed (COMPLETED or FAILED) longer than
//! the retention window ago are deleted — their assignment rows, the rows' state history, and
//! stored bytes kept in the database. The round row (with its counters), its release and its
//! model stay.
//!
//! A round is first claimed (`contributions_purged_at` set, guarded on its state, so it cannot
//! race an operator's resume), then its rows go in transactions of at most `max_rows`
//! assignments each, so a round of millions never holds the SQLite writer for long. A pass cut
//! short leaves a claimed round with rows; the next pass finishes it.

use super::{Db, DbError};

/// A claimed round whose rows are not all gone is looked for this long after its claim.
const LEFTOVER_MILLIS: i64 = 24 * 3600 * 1000;

impl Db {
    /// The next round whose contributions may go: one claimed earlier with rows left, or the
    /// oldest round closed before `closed_before`, claimed now. `None` when there is none.
    pub async fn next_round_to_purge(&self, closed_before: i64) -> Result<Option<String>, DbError> {
        let now = self.now().0;
        self.write(move |tx| {
            Box::pin(async move {
                let leftover: Option<String> = sqlx::query_scalar(
                    "SELECT r.id FROM rounds r WHERE r.contributions_purged_at IS NOT NULL \
                     AND r.contributions_purged_at > $1 \
                     AND EXISTS (SELECT 1 FROM assignments a WHERE a.round_id = r.id) LIMIT 1",
                )
                .bind(now - LEFTOVER_MILLIS)
                .fetch_optional(&mut *tx)
                .await?;
                if leftover.is_some() {
                    return Ok(leftover);
                }
                // Guarded twice (candidate and update): on PostgreSQL the update re-checks the
                // row after waiting for a concurrent resume or purge, which then wins.
                let sql = format!(
                    "UPDATE rounds SET contributions_purged_at = $1 \
                     WHERE id = (SELECT id FROM rounds WHERE contributions_purged_at IS NULL \
                       AND closed_at IS NOT NULL AND closed_at < $2 \
                       AND state IN ('COMPLETED', 'FAILED') ORDER BY closed_at LIMIT 1{}) \
                     AND contributions_purged_at IS NULL AND state IN ('COMPLETED', 'FAILED') \
                     RETURNING id",
                    super::lock_clause(tx, " FOR UPDATE SKIP LOCKED")
                );
                Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind(now)
                    .bind(closed_before)
                    .fetch_optional(&mut *tx)
                    .await?)
            })
        })
        .await
    }

    /// Deletes up to `max_rows` assignments of a claimed round, with their state history and
    /// any bytes held in the database; returns how many assignments went.
    pub async fn purge_round_rows(&self, round_id: &str, max_rows: i64) -> Result<u64, DbError> {
        let round_id = round_id.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                // The same `max_rows` assignments (first by id) in both statements.
                const CHUNK: &str =
                    "SELECT id FROM assignments WHERE round_id = $1 ORDER BY id LIMIT $2";
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM state_history WHERE entity = 'assignment' AND entity_id IN ({CHUNK})"
                )))
                .bind(&round_id)
                .bind(max_rows)
                .execute(&mut *tx)
                .await?;
                let deleted = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM assignments WHERE id IN ({CHUNK})"
                )))
                .bind(&round_id)
                .bind(max_rows)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                Ok(deleted)
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
}
