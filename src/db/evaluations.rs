//! A task's evaluations, read from its committed releases' manifests (evaluation rounds only).

use super::{Conn, Db, DbError, tasks};
use crate::evaluation::{EvaluationPoint, point_of};

/// The evaluations of task `task_id` that evaluates every `every` rounds, by model version. A
/// round released twice (an operator's doing: the key services' ledger allows one commitment
/// per round) counts once, its newest release.
pub(super) async fn of_task(
    conn: &mut Conn,
    task_id: &str,
    every: i64,
) -> Result<Vec<EvaluationPoint>, DbError> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT round_number, manifest_json FROM releases \
         WHERE task_id = $1 AND (round_number - 1) % $2 = 0 \
         ORDER BY round_number, created_at",
    )
    .bind(task_id)
    .bind(every.max(1))
    .fetch_all(&mut *conn)
    .await?;
    let mut points: Vec<EvaluationPoint> = Vec::with_capacity(rows.len());
    for (round, manifest) in rows {
        let Some(point) = point_of(round, &manifest) else {
            continue;
        };
        match points.last_mut() {
            Some(last) if last.round == point.round => *last = point,
            _ => points.push(point),
        }
    }
    Ok(points)
}

impl Db {
    /// The evaluations of one of the tenant's tasks (none if it does not evaluate).
    pub async fn evaluations(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<EvaluationPoint>, DbError> {
        let mut conn = self.pool().acquire().await?;
        let task = tasks::load(&mut conn, tenant_id, task_id).await?;
        match task.spec.evaluation {
            Some(evaluation) => of_task(&mut conn, task_id, evaluation.every).await,
            None => Ok(Vec::new()),
        }
    }
}
