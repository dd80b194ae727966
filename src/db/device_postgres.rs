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

use super::device::{Assigned, CandidateRow, ReportOutcome, Stored, report_slow, upload_refused};
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
         JOIN populations p ON p.name = t.population AND p.tenant_id = t.tenant_id \
         WHERE t.population = $1 AND t.state = 'OPEN' AND r.state = 'COLLECTING'",
    )
    .bind(population.to_string())
    .fetch_all(db.pool())
    .await?)
}

/// One statement, so one round trip and an implicit transaction: the round row's lock (taken by
/// the guarded UPDATE, which PostgreSQL re-checks after waiting for it) is held only for this
/// statement and its commit, not across a BEGIN ... COMMIT conversation. Every check-in of a
/// round takes that lock, so its hold time bounds the round's check-in rate.
pub(super) async fn assign(
    db: &Db,
    round_id: String,
    id: String,
    capacity: i64,
    key_if_unset: String,
    expires_at: i64,
    now: i64,
) -> Result<Option<Assigned>, DbError> {
    debug_assert!(AssignmentState::Assigned.as_str() == "ASSIGNED");
    let key_id: Option<(Option<String>,)> = sqlx::query_as(
        "WITH r AS (UPDATE rounds SET key_id = COALESCE(key_id, $2), \
         live_assignments = live_assignments + 1 \
         WHERE id = $1 AND state = 'COLLECTING' AND live_assignments < $3 RETURNING key_id), \
         a AS (INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
         SELECT $4, $1, 'ASSIGNED', $5, $6, $6 FROM r RETURNING id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $7, 'assignment', a.id, 1, NULL, 'ASSIGNED', 'device checked in', $6 FROM a) \
         SELECT key_id FROM r",
    )
    .bind(&round_id)
    .bind(&key_if_unset)
    .bind(capacity)
    .bind(&id)
    .bind(expires_at)
    .bind(now)
    .bind(super::new_history_id())
    .fetch_optional(db.pool())
    .await?;
    Ok(match key_id {
        Some((Some(key_id),)) => Some(Assigned { key_id, expires_at }),
        _ => None,
    })
}

pub(super) async fn record_upload(
    db: &Db,
    id: String,
    sha256_hex: String,
    size: i64,
    blob_key: String,
    now: i64,
) -> Result<Result<Stored, Refusal>, DbError> {
    // The common case in one statement (one round trip, implicit transaction): the guarded
    // ASSIGNED -> UPLOADED transition and its history row. Only a refusal or a repeated upload
    // takes the transaction below to say why.
    debug_assert!(AssignmentState::Assigned.can_become(AssignmentState::Uploaded));
    let (changed,): (i64,) = sqlx::query_as(
        "WITH u AS (UPDATE assignments SET state = 'UPLOADED', updated_at = $1, \
         contribution_sha256 = $2, contribution_bytes = $3, blob_key = $4 \
         WHERE id = $5 AND state = 'ASSIGNED' AND contribution_sha256 IS NULL \
         AND expires_at > $1 AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = assignments.round_id AND r.state = 'COLLECTING') RETURNING id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $6, 'assignment', u.id, \
         (SELECT COALESCE(MAX(seq), 0) + 1 FROM state_history WHERE entity_id = $5), \
         'ASSIGNED', 'UPLOADED', 'contribution stored', $1 FROM u) \
         SELECT COUNT(*) FROM u",
    )
    .bind(now)
    .bind(&sha256_hex)
    .bind(size)
    .bind(&blob_key)
    .bind(&id)
    .bind(super::new_history_id())
    .fetch_one(db.pool())
    .await?;
    if changed == 1 {
        return Ok(Ok(Stored::New));
    }
    db.write(move |tx| Box::pin(async move { upload_refused(tx, &id, &sha256_hex, now).await }))
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
            // With the round locked, the transition, its history row and the round's counter
            // go in one statement (one round trip instead of three).
            let completed: Option<(i64,)> = if round_state == RoundState::Collecting.as_str() {
                sqlx::query_as(
                    "WITH u AS (UPDATE assignments SET state = 'COMPLETED', updated_at = $1 \
                     WHERE id = $2 AND state = 'UPLOADED' AND expires_at > $1 RETURNING id), \
                     h AS (INSERT INTO state_history \
                     (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                     SELECT $3, 'assignment', u.id, \
                     (SELECT COALESCE(MAX(seq), 0) + 1 FROM state_history WHERE entity_id = $2), \
                     'UPLOADED', 'COMPLETED', 'device reported completion', $1 FROM u) \
                     UPDATE rounds SET completed_reports = completed_reports + 1 \
                     WHERE id = $4 AND EXISTS (SELECT 1 FROM u) RETURNING completed_reports",
                )
                .bind(now)
                .bind(&id)
                .bind(super::new_history_id())
                .bind(&round_id)
                .fetch_optional(&mut *tx)
                .await?
            } else {
                None
            };
            let Some((completed,)) = completed else {
                return report_slow(tx, &id, ReportOutcome::Completed, None, now).await;
            };
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
