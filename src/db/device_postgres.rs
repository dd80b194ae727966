//! The device hot paths on PostgreSQL. On SQLite they run on the single writer's raw handle
//! (`device.rs`), where being serial makes every guarded statement atomic. Here many servers
//! run them at once, each as one READ COMMITTED transaction on a pooled connection, kept apart
//! by row locks:
//! - check-in: the guarded `UPDATE rounds ... live_assignments < capacity` locks the round row;
//!   PostgreSQL re-checks the guard after waiting for the lock, so no round is over-filled;
//! - upload: the guarded `UPDATE assignments` (compare-and-set on the state) locks the
//!   assignment; a repeated upload waits and then sees the stored digest;
//! - completed report: locks the round row first (`FOR UPDATE`), so completions and the goal's
//!   closing are serial per round: exactly one report closes the round, and none completes an
//!   assignment of a round already closed (its contribution would miss the aggregation).

use super::device::{
    Assigned, CandidateRow, ReportOutcome, Stored, insert_row, report_slow, upload_refused,
};
use super::history;
use super::{Db, DbError, device::Refusal};
use crate::states::{AssignmentState, RoundState, StateMachine};

pub(super) async fn checkin_candidates(
    db: &Db,
    population: &str,
) -> Result<Vec<CandidateRow>, DbError> {
    Ok(sqlx::query_as(
        "SELECT r.id, t.id, t.tenant_id, r.round_number, r.deadline_at, r.key_id, \
         t.model_version, r.live_assignments, t.spec_json, r.attempt \
         FROM rounds r JOIN tasks t ON t.id = r.task_id \
         WHERE t.population = $1 AND t.state = 'OPEN' AND r.state = 'COLLECTING'",
    )
    .bind(population.to_string())
    .fetch_all(db.pool())
    .await?)
}

pub(super) async fn assign(
    db: &Db,
    round_id: String,
    id: String,
    capacity: i64,
    key_if_unset: String,
    expires_at: i64,
    now: i64,
) -> Result<Option<Assigned>, DbError> {
    db.write(move |tx| {
        Box::pin(async move {
            let key_id: Option<(Option<String>,)> = sqlx::query_as(
                "UPDATE rounds SET key_id = COALESCE(key_id, $2), \
                 live_assignments = live_assignments + 1 \
                 WHERE id = $1 AND state = 'COLLECTING' AND live_assignments < $3 \
                 RETURNING key_id",
            )
            .bind(&round_id)
            .bind(&key_if_unset)
            .bind(capacity)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((Some(key_id),)) = key_id else {
                return Ok(None);
            };
            insert_row(tx, &id, &round_id, expires_at, "device checked in", now).await?;
            Ok(Some(Assigned { key_id, expires_at }))
        })
    })
    .await
}

pub(super) async fn record_upload(
    db: &Db,
    id: String,
    sha256_hex: String,
    size: i64,
    blob_key: String,
    now: i64,
) -> Result<Result<Stored, Refusal>, DbError> {
    db.write(move |tx| {
        Box::pin(async move {
            let changed = sqlx::query(
                "UPDATE assignments SET state = 'UPLOADED', updated_at = $1, \
                 contribution_sha256 = $2, contribution_bytes = $3, blob_key = $4 \
                 WHERE id = $5 AND state = 'ASSIGNED' AND contribution_sha256 IS NULL \
                 AND expires_at > $1 AND EXISTS (SELECT 1 FROM rounds r \
                 WHERE r.id = assignments.round_id AND r.state = 'COLLECTING')",
            )
            .bind(now)
            .bind(&sha256_hex)
            .bind(size)
            .bind(&blob_key)
            .bind(&id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if changed == 0 {
                return upload_refused(tx, &id, &sha256_hex, now).await;
            }
            history::append(
                tx,
                "assignment",
                &id,
                Some("ASSIGNED"),
                "UPLOADED",
                "contribution stored",
                now,
            )
            .await?;
            Ok(Ok(Stored::New))
        })
    })
    .await
}

pub(super) async fn record_completed(
    db: &Db,
    id: String,
    now: i64,
) -> Result<Result<AssignmentState, Refusal>, DbError> {
    db.write(move |tx| {
        Box::pin(async move {
            use AssignmentState::{Completed, Uploaded};
            debug_assert!(Uploaded.can_become(Completed));
            // The round row first: completions and the goal's closing are serial per round.
            let round: Option<(String, String, i64)> = sqlx::query_as(
                "SELECT r.id, r.state, r.report_goal FROM rounds r \
                 WHERE r.id = (SELECT round_id FROM assignments WHERE id = $1) FOR UPDATE",
            )
            .bind(&id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((round_id, round_state, goal)) = round else {
                return Ok(Err(Refusal::UnknownAssignment));
            };
            let changed = if round_state == RoundState::Collecting.as_str() {
                sqlx::query(
                    "UPDATE assignments SET state = 'COMPLETED', updated_at = $1 \
                     WHERE id = $2 AND state = 'UPLOADED' AND expires_at > $1",
                )
                .bind(now)
                .bind(&id)
                .execute(&mut *tx)
                .await?
                .rows_affected()
            } else {
                0
            };
            if changed == 0 {
                return report_slow(tx, &id, ReportOutcome::Completed, None, now).await;
            }
            history::append(tx, "assignment", &id, Some("UPLOADED"), "COMPLETED", "device reported completion", now).await?;
            let (completed,): (i64,) = sqlx::query_as(
                "UPDATE rounds SET completed_reports = completed_reports + 1 WHERE id = $1 \
                 RETURNING completed_reports",
            )
            .bind(&round_id)
            .fetch_one(&mut *tx)
            .await?;
            if completed != goal {
                return Ok(Ok(Completed));
            }
            debug_assert!(RoundState::Collecting.can_become(RoundState::Aggregating));
            sqlx::query(
                "UPDATE rounds SET state = 'AGGREGATING', updated_at = $2 \
                 WHERE id = $1 AND state = 'COLLECTING'",
            )
            .bind(&round_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            history::append(
                tx,
                "round",
                &round_id,
                Some("COLLECTING"),
                "AGGREGATING",
                &format!("report goal {goal} reached"),
                now,
            )
            .await?;
            sqlx::query(
                "INSERT INTO aggregation_jobs (round_id, task_id, state, not_before, created_at, updated_at) \
                 SELECT id, task_id, 'PENDING', $2, $2, $2 FROM rounds WHERE id = $1",
            )
            .bind(&round_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            Ok(Ok(Completed))
        })
    })
    .await
}
