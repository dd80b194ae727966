//! A task's evaluations, read from its committed releases' manifests (evaluation rounds only).

use confed_worker_api::Manifest;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Conn, Db, DbError, tasks};
use crate::states::TaskState;
use crate::task_spec::EvaluationSpec;

/// One evaluated model version: the `evaluation` of a release manifest (docs/protocol.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EvaluationPoint {
    /// The version measured: the one round `round` trained from (`round - 1`).
    pub model_version: u64,
    /// The round whose devices measured it and whose release carries the metrics.
    #[serde(default)]
    pub round: u64,
    /// Asked for on demand rather than scheduled: only devices that still had an on-demand
    /// evaluation to grant took part, so the sums may hold few examples or none.
    #[serde(default)]
    pub on_demand: bool,
    /// Standard deviation of the noise on each sum, in examples (on `loss_sum`, in loss units,
    /// `stddev * max_loss`).
    pub stddev: f64,
    /// Noised sums: examples, correct answers, loss.
    pub examples: f64,
    pub correct: f64,
    pub loss_sum: f64,
    /// Noised mean accuracy and loss (null when the noised example count is not positive).
    pub accuracy: Option<f64>,
    pub loss: Option<f64>,
    /// The noise is 5 % or more of the noised examples (or there are none): the accuracy moves
    /// by 5 points or more with the noise alone, too much to choose a version by
    /// (docs/privacy.md, "Evaluation").
    #[serde(default)]
    pub too_noisy: bool,
}

/// The evaluation in a release manifest, if the round evaluated (a manifest that does not parse
/// has none: the release's own check reports it).
pub fn point_of(round: i64, manifest_json: &str) -> Option<EvaluationPoint> {
    let record = Manifest::evaluation_of(manifest_json)?;
    Some(EvaluationPoint {
        model_version: record.model_version,
        round: u64::try_from(round).ok()?,
        on_demand: record.on_demand,
        stddev: record.stddev,
        examples: record.examples,
        correct: record.correct,
        loss_sum: record.loss_sum,
        accuracy: record.accuracy,
        loss: record.loss,
        too_noisy: confed_dp::evaluation_too_noisy(record.stddev, record.examples),
    })
}

/// The evaluations of task `task_id` under `evaluation`, by model version: the releases of its
/// scheduled evaluation rounds and of the rounds opened to evaluate on demand, and no other
/// manifest is read (each model commit of a task with early stopping runs this). A round
/// released twice (an operator's doing: the key services' ledger allows one commitment per
/// round) counts once, its newest release.
pub(super) async fn of_task(
    conn: &mut Conn,
    task_id: &str,
    evaluation: &EvaluationSpec,
) -> Result<Vec<EvaluationPoint>, DbError> {
    // No schedule: a period no round reaches but round 1 (whose manifest is skipped below if it
    // did not evaluate), so the modulo never divides by zero.
    let every = match evaluation.policy().every {
        0 => i64::MAX,
        every => i64::from(every),
    };
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT round_number, manifest_json FROM releases \
         WHERE task_id = $1 AND ((round_number - 1) % $2 = 0 OR round_id IN \
         (SELECT id FROM rounds WHERE task_id = $1 AND on_demand_evaluation <> 0)) \
         ORDER BY round_number, created_at",
    )
    .bind(task_id)
    .bind(every)
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
    /// The evaluations of task `task_id` (any tenant's) under its `evaluation` spec.
    pub async fn evaluations_of_task(
        &self,
        task_id: &str,
        evaluation: &EvaluationSpec,
    ) -> Result<Vec<EvaluationPoint>, DbError> {
        let mut conn = self.pool().acquire().await?;
        of_task(&mut conn, task_id, evaluation).await
    }

    /// The evaluations of one of the tenant's tasks (none if it does not evaluate).
    pub async fn evaluations(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<EvaluationPoint>, DbError> {
        let mut conn = self.pool().acquire().await?;
        let task = tasks::load(&mut conn, tenant_id, task_id).await?;
        match task.spec.evaluation {
            Some(evaluation) => of_task(&mut conn, task_id, &evaluation).await,
            None => Ok(Vec::new()),
        }
    }
}

/// Where a partner's on-demand evaluation request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvaluationRequest {
    /// On-demand evaluations of rounds opened so far (distinct rounds).
    pub used: u32,
    /// What the policy allows each device.
    pub allowed: u32,
}

impl Db {
    /// Asks for an evaluation of the task's next round to open (idempotent while it waits).
    /// Refused (409) when the task allows none, has used them all, or is finished.
    pub async fn request_evaluation(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<EvaluationRequest, DbError> {
        let (tenant_id, task_id) = (tenant_id.to_string(), task_id.to_string());
        self.write(move |tx| {
            Box::pin(async move {
                // Locked first on PostgreSQL: a round opening (which takes a pending request and
                // moves current_round) commits before this reads anything, or waits for it.
                let lock = format!(
                    "SELECT id FROM tasks WHERE id = $1 AND tenant_id = $2{}",
                    super::lock_clause(&*tx, " FOR UPDATE")
                );
                sqlx::query(sqlx::AssertSqlSafe(lock))
                    .bind(&task_id)
                    .bind(&tenant_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let task = tasks::load(&mut *tx, &tenant_id, &task_id).await?;
                let allowed = task.spec.evaluation.map_or(0, |e| e.policy().on_demand);
                if allowed == 0 {
                    return Err(DbError::Conflict(format!(
                        "task {task_id} allows no on-demand evaluation (its evaluation.on_demand is 0); create the task with evaluation.on_demand >= 1"
                    )));
                }
                if !matches!(task.state, TaskState::Created | TaskState::Open) {
                    return Err(DbError::Conflict(format!(
                        "task {task_id} is {}: no round will open to evaluate",
                        task.state.as_str()
                    )));
                }
                let used: i64 = sqlx::query_scalar(
                    "SELECT COUNT(DISTINCT round_number) FROM rounds \
                     WHERE task_id = $1 AND on_demand_evaluation <> 0",
                )
                .bind(&task_id)
                .fetch_one(&mut *tx)
                .await?;
                let used = u32::try_from(used).unwrap_or(u32::MAX);
                let pending: i64 =
                    sqlx::query_scalar("SELECT evaluation_requested FROM tasks WHERE id = $1")
                        .bind(&task_id)
                        .fetch_one(&mut *tx)
                        .await?;
                if pending == 0 && used >= allowed {
                    return Err(DbError::Conflict(format!(
                        "task {task_id} has used all {allowed} of its on-demand evaluations"
                    )));
                }
                if task.current_round >= i64::from(task.spec.rounds) {
                    return Err(DbError::Conflict(format!(
                        "task {task_id} is in its last round ({}): no round will open to evaluate",
                        task.spec.rounds
                    )));
                }
                sqlx::query("UPDATE tasks SET evaluation_requested = 1 WHERE id = $1")
                    .bind(&task_id)
                    .execute(&mut *tx)
                    .await?;
                Ok(EvaluationRequest { used, allowed })
            })
        })
        .await
    }
}
