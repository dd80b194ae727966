//! Progress views for the console: per-round assignment counts (the funnel: how many devices were
//! assigned to each attempt of each round and where they ended) and each task's privacy spent.
//! Retention may delete the assignment rows of old rounds; their counts then read zero.

use std::collections::HashMap;

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
}

impl Db {
    /// Assignment counts by round, attempt and state for one tenant's task.
    pub async fn round_funnel(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<FunnelCount>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        let rows: Vec<(i64, i64, String, i64, i64)> = sqlx::query_as(
            "SELECT r.round_number, r.attempt, a.state, COUNT(*), \
             SUM(CASE WHEN a.contribution_bytes IS NULL THEN 0 ELSE 1 END) \
             FROM assignments a JOIN rounds r ON r.id = a.round_id \
             WHERE r.task_id = $1 \
             GROUP BY r.round_number, r.attempt, a.state \
             ORDER BY r.round_number, r.attempt, a.state",
        )
        .bind(task_id)
        .fetch_all(&mut *conn)
        .await?;
        rows.into_iter()
            .map(|(round_number, attempt, state, assignments, with)| {
                Ok(FunnelCount {
                    round_number,
                    attempt,
                    state: <AssignmentState as StateMachine>::parse(&state)
                        .ok_or_else(|| DbError::Corrupt(format!("assignment state {state:?}")))?,
                    assignments,
                    with_contribution: with,
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
}
