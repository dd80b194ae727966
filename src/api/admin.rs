//! Operator routes: create and list tenants. Guarded by the admin token; off when none is set.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, Problem};
use super::extract::{Admin, ApiJson};
use crate::app::AppState;
use crate::clock::{Millis, rfc3339};
use crate::db::{NewTenant, TenantRecord};
use crate::task_spec::{InvalidParam, MAX_REPORT_GOAL};

pub const DEFAULT_MAX_ACTIVE_TASKS: i64 = 10;
pub const DEFAULT_MAX_REPORT_GOAL: i64 = 10_000;
/// Device-hours a tenant's active tasks may plan at once, unless the operator says otherwise.
pub const DEFAULT_MAX_DEVICE_HOURS: i64 = 100_000;
pub const MAX_DEVICE_HOURS_LIMIT: i64 = 1_000_000_000;
pub const MAX_ACTIVE_TASKS_LIMIT: i64 = 10_000;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTenantRequest {
    /// 1-64 characters of a-z, 0-9, '-', '_'; unique.
    #[schema(pattern = r"^[a-z0-9_-]{1,64}$")]
    pub name: String,
    /// Tasks in CREATED or OPEN at once, 1-10000 (default 10).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 10000)]
    pub max_active_tasks: Option<i64>,
    /// Largest `report_goal` of any task, 1-1000000 (default 10000).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub max_report_goal: Option<i64>,
    /// Device-hours the tenant's active tasks may plan at once (each task's rounds x its
    /// round's devices x its `device_seconds_per_round`), 1-1000000000 (default 100000).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 1000000000)]
    pub max_device_hours: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TenantResponse {
    pub id: String,
    pub name: String,
    pub max_active_tasks: i64,
    pub max_report_goal: i64,
    pub max_device_hours: i64,
    pub created_at: String,
}

impl From<TenantRecord> for TenantResponse {
    fn from(t: TenantRecord) -> Self {
        Self {
            id: t.id,
            name: t.name,
            max_active_tasks: t.max_active_tasks,
            max_report_goal: t.max_report_goal,
            max_device_hours: t.max_device_hours,
            created_at: rfc3339(Millis(t.created_at)),
        }
    }
}

/// A new tenant with its API token, which is shown this once and never again.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CreatedTenant {
    #[serde(flatten)]
    pub tenant: TenantResponse,
    pub token: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct TenantList {
    pub tenants: Vec<TenantResponse>,
}

impl CreateTenantRequest {
    /// Validates the request into what the database stores.
    pub fn validate(self) -> Result<NewTenant, Vec<InvalidParam>> {
        let mut problems = Vec::new();
        if !valid_tenant_name(&self.name) {
            problems.push(InvalidParam {
                name: "name".into(),
                reason: "must be 1-64 characters of a-z, 0-9, '-', '_'".into(),
            });
        }
        let mut bounded = |name: &str, value: Option<i64>, default: i64, max: i64| {
            let value = value.unwrap_or(default);
            if !(1..=max).contains(&value) {
                problems.push(InvalidParam {
                    name: name.into(),
                    reason: format!("must be between 1 and {max} (got {value})"),
                });
            }
            value
        };
        let max_active_tasks = bounded(
            "max_active_tasks",
            self.max_active_tasks,
            DEFAULT_MAX_ACTIVE_TASKS,
            MAX_ACTIVE_TASKS_LIMIT,
        );
        let max_report_goal = bounded(
            "max_report_goal",
            self.max_report_goal,
            DEFAULT_MAX_REPORT_GOAL,
            MAX_REPORT_GOAL,
        );
        let max_device_hours = bounded(
            "max_device_hours",
            self.max_device_hours,
            DEFAULT_MAX_DEVICE_HOURS,
            MAX_DEVICE_HOURS_LIMIT,
        );
        if problems.is_empty() {
            Ok(NewTenant {
                name: self.name,
                max_active_tasks,
                max_report_goal,
                max_device_hours,
            })
        } else {
            Err(problems)
        }
    }
}

pub fn valid_tenant_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// Create a tenant; the response carries its API token once.
#[utoipa::path(post, path = "/v1/admin/tenants", tag = "admin", request_body = CreateTenantRequest,
    security(("admin_token" = [])),
    responses(
        (status = 201, body = CreatedTenant),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "The admin API is off (no CONFED_ADMIN_TOKEN)", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The name is taken", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn create_tenant(
    State(state): State<AppState>,
    _admin: Admin,
    ApiJson(request): ApiJson<CreateTenantRequest>,
) -> Result<(StatusCode, axum::Json<CreatedTenant>), ApiError> {
    let new = request.validate().map_err(ApiError::InvalidFields)?;
    let (tenant, token) = state.db.create_tenant(&new).await?;
    tracing::info!(tenant = %tenant.name, "tenant created through the admin API");
    Ok((
        StatusCode::CREATED,
        axum::Json(CreatedTenant {
            tenant: tenant.into(),
            token: token.to_string(),
        }),
    ))
}

/// Every tenant (never their tokens).
#[utoipa::path(get, path = "/v1/admin/tenants", tag = "admin",
    security(("admin_token" = [])),
    responses(
        (status = 200, body = TenantList),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "The admin API is off", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_tenants(
    State(state): State<AppState>,
    _admin: Admin,
) -> Result<axum::Json<TenantList>, ApiError> {
    let tenants = state.db.list_tenants().await?;
    Ok(axum::Json(TenantList {
        tenants: tenants.into_iter().map(Into::into).collect(),
    }))
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ResumedRound {
    pub task_id: String,
    pub round: i64,
    /// `AGGREGATING` or `APPLYING`: where the round failed.
    pub round_state: String,
}

/// Resume a round whose aggregation failed: the job runs again, the task is OPEN again
/// (docs/operations.md, "Failed rounds").
#[utoipa::path(post, path = "/v1/admin/tasks/{task_id}/rounds/{round}/resume", tag = "admin",
    params(("task_id" = String, Path, description = "Task id"), ("round" = i64, Path, description = "Round number")),
    security(("admin_token" = [])),
    responses(
        (status = 200, body = ResumedRound),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task, or the admin API is off", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The round's aggregation did not fail, or it is not the task's latest round", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn resume_round(
    State(state): State<AppState>,
    _admin: Admin,
    super::extract::ApiPath((task_id, round)): super::extract::ApiPath<(String, i64)>,
) -> Result<axum::Json<ResumedRound>, ApiError> {
    let resumed = crate::aggregation::partitions::resume_failed_round(
        &state.db,
        state.blobs.as_ref(),
        &task_id,
        round,
    )
    .await?;
    tracing::warn!(task = %task_id, round, state = resumed.round_state.as_str(),
        "a failed round was resumed by the operator");
    Ok(axum::Json(ResumedRound {
        task_id: resumed.task_id,
        round: resumed.round_number,
        round_state: resumed.round_state.as_str().into(),
    }))
}
