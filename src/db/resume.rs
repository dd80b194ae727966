//! The operator's way back from a failed aggregation: a round whose job failed for good (or was
//! given up by the operator's own tooling) is put back where it failed, and its task reopened.
//!
//! This is the one path from FAILED back to a live state, outside the state machines of
//! `src/states.rs` on purpose: the machines describe what the system does on its own, and this
//! is an operator's decision, recorded in the state history as one.

use super::{Db, DbError, history, tasks};
use crate::clock::Millis;
use crate::states::{JobState, RoundState, StateMachine, TaskState};

static FAILED_ROUND: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT r.id FROM rounds r JOIN aggregation_jobs j ON j.round_id = r.id \
         WHERE r.task_id = $1 AND r.round_number = $2 AND r.state = '{round_failed}' \
         AND j.state = '{job_failed}' ORDER BY r.attempt DESC LIMIT 1",
        round_failed = RoundState::Failed.as_str(),
        job_failed = JobState::Failed.as_str(),
    )
});
static JOB_PENDING_AGAIN: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "UPDATE aggregation_jobs SET state = '{pending}', failures = 0, attempts = 0, \
         not_before = $1, lease_owner = NULL, lease_expires_at = NULL, partitions = NULL, \
         updated_at = $1 \
         WHERE round_id = $2 AND state = '{failed}'",
        pending = JobState::Pending.as_str(),
        failed = JobState::Failed.as_str(),
    )
});

/// What a resume did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resumed {
    pub task_id: String,
    pub round_number: i64,
    /// AGGREGATING (no release yet) or APPLYING (released; the next model is still to write).
    pub round_state: RoundState,
}

impl Db {
    /// Resumes round `round_number` of `task_id` if its aggregation job failed: the job is
    /// pending again (failures reset, partitions to be planned again), the round back in
    /// AGGREGATING or APPLYING, the task OPEN.
    /// Only the task's latest round, and only while the task is FAILED because of it.
    pub async fn resume_failed_round(
        &self,
        task_id: &str,
        round_number: i64,
    ) -> Result<Resumed, DbError> {
        let now = self.now().0;
        let task_id = task_id.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                let task = tasks::load_any(&mut *tx, &task_id).await?;
                let round_id: Option<String> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(FAILED_ROUND.as_str()))
                        .bind(&task_id)
                        .bind(round_number)
                        .fetch_optional(&mut *tx)
                        .await?;
                let not_resumable = |found: String| DbError::StateConflict {
                    entity: "round",
                    id: format!("{task_id}/{round_number}"),
                    expected: "FAILED in aggregation, the latest round of a FAILED task",
                    found,
                };
                let Some(round_id) = round_id else {
                    return Err(not_resumable("no failed aggregation job".into()));
                };
                let purged: Option<i64> =
                    sqlx::query_scalar("SELECT contributions_purged_at FROM rounds WHERE id = $1")
                        .bind(&round_id)
                        .fetch_one(&mut *tx)
                        .await?;
                if purged.is_some() {
                    return Err(not_resumable(
                        "its contributions were deleted by retention".into(),
                    ));
                }
                if task.state != TaskState::Failed || task.current_round != round_number {
                    return Err(not_resumable(format!(
                        "task {} at round {}",
                        task.state.as_str(),
                        task.current_round
                    )));
                }
                let released: Option<String> =
                    sqlx::query_scalar("SELECT round_id FROM releases WHERE round_id = $1")
                        .bind(&round_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                let to = if released.is_some() {
                    RoundState::Applying
                } else {
                    RoundState::Aggregating
                };
                let reason = "resumed by the operator";
                // Guarded on the purge mark too: a retention pass that claimed the round first
                // wins (on PostgreSQL this update waits for it and re-checks).
                let moved = sqlx::query(
                    "UPDATE rounds SET state = $1, closed_at = NULL WHERE id = $2 \
                     AND state = $3 AND contributions_purged_at IS NULL",
                )
                .bind(to.as_str())
                .bind(&round_id)
                .bind(RoundState::Failed.as_str())
                .execute(&mut *tx)
                .await?
                .rows_affected();
                let reopened = sqlx::query(
                    "UPDATE tasks SET state = $1, updated_at = $2 WHERE id = $3 AND state = $4",
                )
                .bind(TaskState::Open.as_str())
                .bind(now)
                .bind(&task_id)
                .bind(TaskState::Failed.as_str())
                .execute(&mut *tx)
                .await?
                .rows_affected();
                let pending = sqlx::query(sqlx::AssertSqlSafe(JOB_PENDING_AGAIN.as_str()))
                    .bind(now)
                    .bind(&round_id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if (moved, reopened, pending) != (1, 1, 1) {
                    return Err(not_resumable("changed concurrently".into()));
                }
                // A partitioned round is planned afresh at its next lease: whatever its stored
                // partitions were (the merge may have failed on one), they are sealed again.
                sqlx::query("DELETE FROM job_partitions WHERE round_id = $1")
                    .bind(&round_id)
                    .execute(&mut *tx)
                    .await?;
                // Not `transition`: these moves are outside the machines on purpose (above), and
                // recorded as the operator's.
                history::append(
                    &mut *tx,
                    JobState::ENTITY,
                    &round_id,
                    Some(JobState::Failed.as_str()),
                    JobState::Pending.as_str(),
                    reason,
                    Millis(now),
                )
                .await?;
                history::append(
                    &mut *tx,
                    RoundState::ENTITY,
                    &round_id,
                    Some(RoundState::Failed.as_str()),
                    to.as_str(),
                    reason,
                    Millis(now),
                )
                .await?;
                history::append(
                    &mut *tx,
                    TaskState::ENTITY,
                    &task_id,
                    Some(TaskState::Failed.as_str()),
                    TaskState::Open.as_str(),
                    reason,
                    Millis(now),
                )
                .await?;
                Ok(Resumed {
                    task_id,
                    round_number,
                    round_state: to,
                })
            })
        })
        .await
    }
}
