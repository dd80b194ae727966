//! Partner task routes: create, list, get, cancel, rounds.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::{ApiError, Problem};
use super::extract::{ApiJson, ApiPath, ApiQuery, Tenant};
use crate::app::AppState;
use crate::clock::{Millis, rfc3339};
use crate::db::{RoundRecord, TaskRecord};
use crate::states::{RoundState, TaskState};
use crate::task_spec::{CreateTaskRequest, TaskSpec};

pub const DEFAULT_PAGE_SIZE: u32 = 20;
pub const MAX_PAGE_SIZE: u32 = 100;

/// A task as partners see it: its validated definition plus its progress.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TaskResponse {
    pub id: String,
    pub state: TaskState,
    /// Round in progress (1-based); 0 until the model is uploaded.
    pub current_round: i64,
    /// Latest model version; null until version 0 is uploaded.
    pub model_version: Option<i64>,
    pub created_at: String,
    pub updated_at: String,
    /// Why the task failed or was cancelled, in words (e.g. "round 2 aggregation failed: ...");
    /// null in any other state. It says what the server saw, never anything a device's data
    /// decided (docs/api.md, "Why a task or round failed").
    pub failure_reason: Option<String>,
    /// Check-ins of the last 15 minutes that meet this task's version range and constraints
    /// (only on `GET /v1/tasks/{id}`): why a round fills slowly. Check-ins, not devices: devices
    /// check in anonymously, so one that checked in twice counts twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent_eligible_checkins: Option<u64>,
    /// The same number under its first, misleading name (deprecated: read
    /// `recent_eligible_checkins`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recent_eligible_devices: Option<u64>,
    /// The task policy text devices are shown and bind their contributions to
    /// (docs/protocol.md, "Task policy"); `confed verify release --policy` checks a release
    /// against it.
    pub policy: String,
    /// Lowercase hex SHA-256 of `policy`: what each release's manifest names.
    pub policy_sha256: String,
    #[serde(flatten)]
    pub spec: TaskSpec,
}

impl From<TaskRecord> for TaskResponse {
    fn from(task: TaskRecord) -> Self {
        let policy = task.spec.policy(&task.id, &task.tenant_id);
        Self {
            policy: policy.encode(),
            policy_sha256: policy.sha256_hex(),
            id: task.id,
            state: task.state,
            current_round: task.current_round,
            model_version: task.model_version,
            created_at: rfc3339(Millis(task.created_at)),
            updated_at: rfc3339(Millis(task.updated_at)),
            failure_reason: task.failure_reason,
            recent_eligible_checkins: None,
            recent_eligible_devices: None,
            spec: task.spec,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TaskList {
    pub tasks: Vec<TaskResponse>,
    /// Pass as `page_token` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    /// Page size, 1-100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// `next_page_token` of the previous page.
    pub page_token: Option<String>,
}

/// One attempt of one round.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RoundResponse {
    pub round: i64,
    pub attempt: i64,
    pub state: RoundState,
    pub reports_received: i64,
    pub report_goal: i64,
    pub min_reports: i64,
    pub deadline: String,
    pub opened_at: String,
    pub closed_at: Option<String>,
    /// Why this attempt failed, in words (too few reports by the deadline, an aggregation
    /// error, the task cancelled); null unless `state` is FAILED.
    pub failure_reason: Option<String>,
}

impl From<RoundRecord> for RoundResponse {
    fn from(round: RoundRecord) -> Self {
        Self {
            round: round.round_number,
            attempt: round.attempt,
            state: round.state,
            reports_received: round.reports_received,
            report_goal: round.report_goal,
            min_reports: round.min_reports,
            deadline: rfc3339(Millis(round.deadline_at)),
            opened_at: rfc3339(Millis(round.opened_at)),
            closed_at: round.closed_at.map(|at| rfc3339(Millis(at))),
            failure_reason: round.failure_reason,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RoundList {
    pub rounds: Vec<RoundResponse>,
}

/// Create a task (state CREATED); upload model version 0 to open it.
#[utoipa::path(post, path = "/v1/tasks", tag = "tasks", request_body = CreateTaskRequest,
    security(("tenant_token" = [])),
    responses(
        (status = 201, description = "Task created", body = TaskResponse),
        (status = 400, description = "A field is invalid; `invalid_params` names each", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong token", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "A tenant quota would be exceeded", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_task(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiJson(request): ApiJson<CreateTaskRequest>,
) -> Result<(StatusCode, axum::Json<TaskResponse>), ApiError> {
    let task = state.tasks().create(&tenant.id, request).await?;
    tracing::info!(tenant = %tenant.name, task = %task.id, "task created");
    Ok((StatusCode::CREATED, axum::Json(task.into())))
}

/// This tenant's tasks, newest first.
#[utoipa::path(get, path = "/v1/tasks", tag = "tasks", params(ListParams),
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = TaskList),
        (status = 400, description = "Bad `limit` or `page_token`", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_tasks(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiQuery(params): ApiQuery<ListParams>,
) -> Result<axum::Json<TaskList>, ApiError> {
    let limit = params.limit.unwrap_or(DEFAULT_PAGE_SIZE);
    if !(1..=MAX_PAGE_SIZE).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "`limit` must be between 1 and {MAX_PAGE_SIZE} (got {limit})"
        )));
    }
    let page = state
        .tasks()
        .page(&tenant.id, limit, params.page_token.as_deref())
        .await?;
    Ok(axum::Json(TaskList {
        tasks: page.tasks.into_iter().map(Into::into).collect(),
        next_page_token: page.next_page_token,
    }))
}

/// One task of this tenant.
#[utoipa::path(get, path = "/v1/tasks/{id}", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = TaskResponse),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task for this tenant", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_task(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<TaskResponse>, ApiError> {
    let (task, eligible) = state
        .tasks()
        .with_eligible(&tenant.id, &id, state.now())
        .await?;
    let mut response = TaskResponse::from(task);
    response.recent_eligible_checkins = Some(eligible);
    response.recent_eligible_devices = Some(eligible);
    Ok(axum::Json(response))
}

/// Cancel a task; assignment stops at once and its live round fails.
#[utoipa::path(post, path = "/v1/tasks/{id}/cancel", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, description = "Task cancelled", body = TaskResponse),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task already finished", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn cancel_task(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<TaskResponse>, ApiError> {
    let task = state.tasks().cancel(&tenant.id, &id).await?;
    tracing::info!(tenant = %tenant.name, task = %task.id, "task cancelled");
    Ok(axum::Json(task.into()))
}

/// Every round and attempt of a task.
#[utoipa::path(get, path = "/v1/tasks/{id}/rounds", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = RoundList),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_rounds(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<RoundList>, ApiError> {
    let rounds = state.tasks().rounds(&tenant.id, &id).await?;
    Ok(axum::Json(RoundList {
        rounds: rounds.into_iter().map(Into::into).collect(),
    }))
}
