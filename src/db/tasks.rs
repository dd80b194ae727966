//! Tasks: creation under quota, listing, model upload (CREATED -> OPEN) and cancellation.

use super::rounds::{self, LIVE_ROUND_STATES};
use super::{Conn, Db, DbError, history, models, new_id, parse_state, transition};
use crate::clock::Millis;
use crate::states::{RoundState, StateMachine, TaskState};
use crate::task_spec::TaskSpec;

#[derive(Debug, Clone, PartialEq)]
pub struct TaskRecord {
    pub id: String,
    pub tenant_id: String,
    pub state: TaskState,
    pub spec: TaskSpec,
    /// Number of the round in progress (1-based); 0 before the first round opens.
    pub current_round: i64,
    /// Latest model version; `None` until the partner uploads version 0.
    pub model_version: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    /// Why the task failed or was cancelled (the reason of its last transition, from the state
    /// history); `None` in any other state.
    pub failure_reason: Option<String>,
}

/// Where a page of the task list continues: after this (created_at, id), newest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskCursor {
    pub created_at: i64,
    pub id: String,
}

/// A task's row, by the column names of `TASK_COLUMNS`.
#[derive(sqlx::FromRow)]
struct TaskRow {
    id: String,
    tenant_id: String,
    state: String,
    spec_json: String,
    current_round: i64,
    model_version: Option<i64>,
    created_at: i64,
    updated_at: i64,
    failure_reason: Option<String>,
}

/// The columns of a task, and the reason of its last transition when that ended it badly (the
/// state history is the record of why; one index lookup, only for such tasks).
const TASK_COLUMNS: &str = "id, tenant_id, state, spec_json, current_round, model_version, \
     created_at, updated_at, CASE WHEN state IN ('FAILED', 'CANCELLED') THEN \
     (SELECT h.reason FROM state_history h WHERE h.entity_id = tasks.id \
      ORDER BY h.seq DESC LIMIT 1) END AS failure_reason";

fn task_from_row(row: TaskRow) -> Result<TaskRecord, DbError> {
    let spec = serde_json::from_str(&row.spec_json)
        .map_err(|e| DbError::Corrupt(format!("task {} spec: {e}", row.id)))?;
    Ok(TaskRecord {
        state: parse_state(&row.state)?,
        id: row.id,
        tenant_id: row.tenant_id,
        spec,
        current_round: row.current_round,
        model_version: row.model_version,
        created_at: row.created_at,
        updated_at: row.updated_at,
        failure_reason: row.failure_reason,
    })
}

/// Loads a task of one tenant; another tenant's task is reported exactly like a missing one.
/// Refuses a task whose device-hours, with what the tenant's active tasks still plan (their
/// remaining rounds), exceed the tenant's budget, saying by how much and what to change.
async fn check_compute_budget(
    tx: &mut Conn,
    tenant_id: &str,
    spec: &TaskSpec,
    max_device_hours: i64,
) -> Result<(), DbError> {
    let active: Vec<(String, Option<i64>)> = sqlx::query_as(
        "SELECT spec_json, model_version FROM tasks \
         WHERE tenant_id = $1 AND state IN ('CREATED', 'OPEN')",
    )
    .bind(tenant_id)
    .fetch_all(&mut *tx)
    .await?;
    let mut held = 0.0;
    for (spec_json, model_version) in active {
        let other: TaskSpec = serde_json::from_str(&spec_json)
            .map_err(|e| DbError::Corrupt(format!("task spec: {e}")))?;
        held += other.device_hours(model_version.unwrap_or(0) + 1);
    }
    let needed = spec.device_hours(1);
    let limit = max_device_hours as f64;
    if held + needed <= limit {
        return Ok(());
    }
    let free = (limit - held).max(0.0);
    let per_round = spec.device_hours(i64::from(spec.rounds));
    let rounds_that_fit = (free / per_round).floor() as i64;
    let fits = if rounds_that_fit > 0 {
        format!("Plan at most {rounds_that_fit} rounds, or a smaller")
    } else {
        "Not one round fits: cancel an active task, or plan a smaller".to_string()
    };
    Err(DbError::ComputeBudget(format!(
        "this task plans up to {needed:.1} device-hours ({} rounds x at most {} devices a round x {} s); the tenant's active tasks already plan {held:.1} of its {max_device_hours}, so it is {:.1} over. {fits} report_goal, over_selection or device_seconds_per_round, cancel an active task, or ask the operator to raise max_device_hours",
        spec.rounds,
        spec.most_devices_per_round(),
        spec.device_seconds_per_round,
        held + needed - limit,
    )))
}

pub(crate) async fn load(
    conn: &mut Conn,
    tenant_id: &str,
    task_id: &str,
) -> Result<TaskRecord, DbError> {
    let sql = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = $1 AND tenant_id = $2");
    let row: Option<TaskRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(task_id)
        .bind(tenant_id)
        .fetch_optional(&mut *conn)
        .await?;
    let row = row.ok_or_else(|| DbError::NotFound {
        entity: "task",
        id: task_id.to_string(),
    })?;
    task_from_row(row)
}

/// Loads a task by id alone (for the scheduler, which acts for every tenant).
pub(crate) async fn load_any(conn: &mut Conn, task_id: &str) -> Result<TaskRecord, DbError> {
    let sql = format!("SELECT {TASK_COLUMNS} FROM tasks WHERE id = $1");
    let row: Option<TaskRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(task_id)
        .fetch_optional(&mut *conn)
        .await?;
    task_from_row(row.ok_or_else(|| DbError::NotFound {
        entity: "task",
        id: task_id.to_string(),
    })?)
}

impl Db {
    /// Creates a task in CREATED after checking the tenant's quotas. The tenant's row is locked
    /// first, so two concurrent creations cannot both slip under the active-task quota.
    pub async fn create_task(
        &self,
        tenant_id: &str,
        spec: &TaskSpec,
    ) -> Result<TaskRecord, DbError> {
        let now = self.now().0;
        let tenant_id = tenant_id.to_string();
        let spec = spec.clone();
        self.write(move |tx| {
            Box::pin(async move {
                let tenant_id = tenant_id.as_str();
                let spec = &spec;
                let quotas: Option<(i64, i64, i64)> = sqlx::query_as(
                    "UPDATE tenants SET lock_version = lock_version + 1 WHERE id = $1 \
                     RETURNING max_active_tasks, max_report_goal, max_device_hours",
                )
                .bind(tenant_id)
                .fetch_optional(&mut *tx)
                .await?;
                let (max_active_tasks, max_report_goal, max_device_hours) = quotas.ok_or_else(|| DbError::NotFound {
                    entity: "tenant",
                    id: tenant_id.to_string(),
                })?;
                if i64::from(spec.report_goal) > max_report_goal {
                    return Err(DbError::QuotaExceeded {
                        quota: "max_report_goal",
                        limit: max_report_goal,
                        detail: format!(
                            "report_goal {} is above it; lower report_goal or ask the operator to raise the quota",
                            spec.report_goal
                        ),
                    });
                }
                let active: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM tasks WHERE tenant_id = $1 AND state IN ('CREATED', 'OPEN')",
                )
                .bind(tenant_id)
                .fetch_one(&mut *tx)
                .await?;
                if active >= max_active_tasks {
                    return Err(DbError::QuotaExceeded {
                        quota: "max_active_tasks",
                        limit: max_active_tasks,
                        detail: format!(
                            "this tenant has {active} active tasks; cancel or finish one, or ask the operator to raise the quota"
                        ),
                    });
                }
                check_compute_budget(&mut *tx, tenant_id, spec, max_device_hours).await?;
                super::populations::claim(&mut *tx, tenant_id, &spec.population, Millis(now)).await?;
                let record = TaskRecord {
                    id: new_id(),
                    tenant_id: tenant_id.to_string(),
                    state: TaskState::Created,
                    spec: spec.clone(),
                    current_round: 0,
                    model_version: None,
                    created_at: now,
                    updated_at: now,
                    failure_reason: None,
                };
                let spec_json =
                    serde_json::to_string(spec).map_err(|e| DbError::Corrupt(format!("task spec: {e}")))?;
                sqlx::query(
                    "INSERT INTO tasks (id, tenant_id, population, state, spec_json, current_round, \
                     model_version, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, 0, NULL, $6, $6)",
                )
                .bind(&record.id)
                .bind(tenant_id)
                .bind(&spec.population)
                .bind(TaskState::Created.as_str())
                .bind(spec_json)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                history::append(
                    &mut *tx,
                    "task",
                    &record.id,
                    None,
                    TaskState::Created.as_str(),
                    "created",
                    Millis(now),
                )
                .await?;
                Ok(record)
            })
        })
        .await
    }

    /// One task of one tenant (`NotFound` for another tenant's task).
    pub async fn task(&self, tenant_id: &str, task_id: &str) -> Result<TaskRecord, DbError> {
        let mut conn = self.pool().acquire().await?;
        load(&mut conn, tenant_id, task_id).await
    }

    /// A page of one tenant's tasks, newest first, after `cursor`.
    pub async fn list_tasks(
        &self,
        tenant_id: &str,
        limit: u32,
        after: Option<&TaskCursor>,
    ) -> Result<Vec<TaskRecord>, DbError> {
        let (created_at, id) = after.map_or((i64::MAX, ""), |c| (c.created_at, c.id.as_str()));
        let sql = format!(
            "SELECT {TASK_COLUMNS} FROM tasks WHERE tenant_id = $1 \
             AND (created_at < $2 OR (created_at = $2 AND id < $3)) \
             ORDER BY created_at DESC, id DESC LIMIT $4"
        );
        let rows: Vec<TaskRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .bind(created_at)
            .bind(id)
            .bind(i64::from(limit))
            .fetch_all(self.pool())
            .await?;
        rows.into_iter().map(task_from_row).collect()
    }

    /// Records model version 0, moves the task CREATED -> OPEN and opens round 1, in one
    /// transaction.
    pub async fn open_task_with_model(
        &self,
        tenant_id: &str,
        task_id: &str,
        model: &models::NewModel,
    ) -> Result<TaskRecord, DbError> {
        let now = self.now().0;
        let tenant_id = tenant_id.to_string();
        let task_id = task_id.to_string();
        let model = model.clone();
        self.write(move |tx| {
            Box::pin(async move {
                let tenant_id = tenant_id.as_str();
                let task_id = task_id.as_str();
                let model = &model;
                let task = load(&mut *tx, tenant_id, task_id).await?;
                transition(
                    &mut *tx,
                    task_id,
                    task.state,
                    TaskState::Open,
                    "model version 0 uploaded",
                    Millis(now),
                )
                .await?;
                sqlx::query("UPDATE tasks SET model_version = 0, current_round = 1 WHERE id = $1")
                    .bind(task_id)
                    .execute(&mut *tx)
                    .await?;
                models::insert(&mut *tx, task_id, 0, model, Millis(now)).await?;
                rounds::open(&mut *tx, &task, 1, 1, Millis(now)).await?;
                let task = load(&mut *tx, tenant_id, task_id).await?;
                Ok(task)
            })
        })
        .await
    }

    /// Cancels a live task at its partner's request (see `cancel_task_because`).
    pub async fn cancel_task(&self, tenant_id: &str, task_id: &str) -> Result<TaskRecord, DbError> {
        self.cancel_task_because(tenant_id, task_id, "cancelled by partner")
            .await
    }

    /// Cancels a live task, `reason` recorded as its `failure_reason`: assignment stops at once
    /// because its live round fails in the same transaction. A finished task answers
    /// `StateConflict`.
    pub async fn cancel_task_because(
        &self,
        tenant_id: &str,
        task_id: &str,
        reason: &'static str,
    ) -> Result<TaskRecord, DbError> {
        let now = self.now().0;
        let tenant_id = tenant_id.to_string();
        let task_id = task_id.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                let tenant_id = tenant_id.as_str();
                let task_id = task_id.as_str();
                let task = load(&mut *tx, tenant_id, task_id).await?;
                if task.state.is_terminal() {
                    return Err(DbError::StateConflict {
                        entity: "task",
                        id: task_id.to_string(),
                        expected: "CREATED or OPEN",
                        found: task.state.as_str().to_string(),
                    });
                }
                transition(
                    &mut *tx,
                    task_id,
                    task.state,
                    TaskState::Cancelled,
                    reason,
                    Millis(now),
                )
                .await?;
                for round in rounds::load_for_task(&mut *tx, task_id).await? {
                    if LIVE_ROUND_STATES.contains(&round.state) {
                        rounds::close(
                            &mut *tx,
                            &round.id,
                            round.state,
                            RoundState::Failed,
                            "task cancelled",
                            Millis(now),
                        )
                        .await?;
                    }
                }
                let task = load(&mut *tx, tenant_id, task_id).await?;
                Ok(task)
            })
        })
        .await
    }
}
