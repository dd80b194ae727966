//! Progress views for the console: per-round assignment counts (the funnel: how many devices were
//! assigned to each attempt of each round and where they ended) and each task's privacy spent.
//! Retention may delete the assignment rows of old rounds; their counts then read zero.

use std::collections::HashMap;

use super::device::AssignmentRef;
use super::jobs::ReleaseRecord;
use super::{Db, DbError, tasks};
use crate::states::{AssignmentState, StateMachine};

/// Assignments of one round attempt in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunnelCount {
    pub round_number: i64,
    pub attempt: i64,
    pub state: AssignmentState,
    pub assignments: i64,
    /// Of these, how many carry an uploaded contribution.
    pub with_contribution: i64,
    /// Of these, how many tried to deliver a contribution after the round closed.
    pub late: i64,
}

impl Db {
    /// Assignment counts by round, attempt and state for one tenant's task, from round
    /// `min_round` on.
    pub async fn round_funnel(
        &self,
        tenant_id: &str,
        task_id: &str,
        min_round: i64,
    ) -> Result<Vec<FunnelCount>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        let rows: Vec<(i64, i64, String, i64, i64, i64)> = sqlx::query_as(
            "SELECT r.round_number, r.attempt, a.state, COUNT(*), \
             SUM(CASE WHEN a.contribution_bytes IS NULL THEN 0 ELSE 1 END), \
             SUM(CASE WHEN a.late_at IS NULL THEN 0 ELSE 1 END) \
             FROM assignments a JOIN rounds r ON r.id = a.round_id \
             WHERE r.task_id = $1 AND r.round_number >= $2 \
             GROUP BY r.round_number, r.attempt, a.state \
             ORDER BY r.round_number, r.attempt, a.state",
        )
        .bind(task_id)
        .bind(min_round)
        .fetch_all(&mut *conn)
        .await?;
        rows.into_iter()
            .map(|(round_number, attempt, state, assignments, with, late)| {
                Ok(FunnelCount {
                    round_number,
                    attempt,
                    state: <AssignmentState as StateMachine>::parse(&state)
                        .ok_or_else(|| DbError::Corrupt(format!("assignment state {state:?}")))?,
                    assignments,
                    with_contribution: with,
                    late,
                })
            })
            .collect()
    }

    /// Privacy spent so far (epsilon through the latest release) of each of a tenant's tasks
    /// that has a release. Spending only grows from round to round, so the largest is the latest.
    pub async fn privacy_spent_by_task(
        &self,
        tenant_id: &str,
    ) -> Result<HashMap<String, f64>, DbError> {
        let rows: Vec<(String, f64)> = sqlx::query_as(
            "SELECT r.task_id, MAX(r.epsilon_spent) FROM releases r \
             JOIN tasks t ON t.id = r.task_id WHERE t.tenant_id = $1 GROUP BY r.task_id",
        )
        .bind(tenant_id)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.into_iter().collect())
    }

    /// (round, epsilon spent through it) of every release of a tenant's task, in round order:
    /// the privacy plot's series, without loading manifests and proofs.
    pub async fn release_series(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<(i64, f64)>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        Ok(sqlx::query_as(
            "SELECT round_number, epsilon_spent FROM releases WHERE task_id = $1 \
             ORDER BY round_number",
        )
        .bind(task_id)
        .fetch_all(&mut *conn)
        .await?)
    }

    /// The releases of a tenant's task from round `min_round` on, in round order (the newest
    /// rounds a page shows, without loading every release of a long task).
    pub async fn releases_from(
        &self,
        tenant_id: &str,
        task_id: &str,
        min_round: i64,
    ) -> Result<Vec<ReleaseRecord>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT round_id FROM releases WHERE task_id = $1 AND round_number >= $2 \
             ORDER BY round_number",
        )
        .bind(task_id)
        .bind(min_round)
        .fetch_all(&mut *conn)
        .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.extend(super::jobs::load_release(&mut conn, &id).await?);
        }
        Ok(out)
    }

    /// When each round attempt of a tenant's task (from round `min_round` on) stopped
    /// collecting: the time of its move to AGGREGATING in the state history, by round id.
    pub async fn aggregating_since(
        &self,
        tenant_id: &str,
        task_id: &str,
        min_round: i64,
    ) -> Result<HashMap<String, i64>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT h.entity_id, MIN(h.at) FROM state_history h \
             JOIN rounds r ON r.id = h.entity_id \
             WHERE r.task_id = $1 AND r.round_number >= $2 AND h.entity = 'round' \
             AND h.to_state = $3 GROUP BY h.entity_id",
        )
        .bind(task_id)
        .bind(min_round)
        .bind(crate::states::RoundState::Aggregating.as_str())
        .fetch_all(&mut *conn)
        .await?;
        Ok(rows.into_iter().collect())
    }

    /// Marks an assignment as late (it tried to deliver its contribution after its round
    /// closed), once: whether this call was the first. A read first, so a device that keeps
    /// trying costs no write after the first.
    pub async fn mark_late(&self, assignment: &AssignmentRef) -> Result<bool, DbError> {
        let now = self.now().0;
        let already: Option<Option<i64>> =
            sqlx::query_scalar("SELECT late_at FROM assignments WHERE id = $1")
                .bind(assignment.as_str())
                .fetch_optional(self.pool())
                .await?;
        if !matches!(already, Some(None)) {
            return Ok(false);
        }
        let id = assignment.as_str().to_string();
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query("UPDATE assignments SET late_at = $1 WHERE id = $2 AND late_at IS NULL")
                    .bind(now)
                    .bind(id)
                    .execute(&mut *conn)
                    .await
                    .map(|done| done.rows_affected() == 1)
                    .map_err(DbError::from)
            })
        })
        .await
    }
}
