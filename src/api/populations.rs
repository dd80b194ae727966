//! Populations: a partner registers the populations its devices check in to, and only its tasks
//! run on them. The operator may assign a population to a tenant (e.g. to settle a dispute).

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, Problem};
use super::extract::{Admin, ApiJson, ApiPath, Tenant};
use crate::app::AppState;
use crate::clock::{Millis, rfc3339};
use crate::db::populations::{Claimed, PopulationRecord};
use crate::task_spec::valid_population;

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PopulationResponse {
    pub name: String,
    pub tenant_id: String,
    pub created_at: String,
}

impl From<PopulationRecord> for PopulationResponse {
    fn from(p: PopulationRecord) -> Self {
        Self {
            name: p.name,
            tenant_id: p.tenant_id,
            created_at: rfc3339(Millis(p.created_at)),
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct PopulationList {
    pub populations: Vec<PopulationResponse>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AssignPopulationRequest {
    /// The tenant that will own the population.
    pub tenant_id: String,
    /// Cancel other tenants' active tasks on the population first (e.g. a squatter's); without
    /// it, such tasks make the request fail with 409.
    #[serde(default)]
    pub cancel_active_tasks: bool,
}

fn checked(population: &str) -> Result<(), ApiError> {
    if valid_population(population) {
        Ok(())
    } else {
        Err(ApiError::BadRequest(
            "the population must be 1-128 of A-Z a-z 0-9 . _ -".into(),
        ))
    }
}

/// Register a population for the calling tenant (its first task on it does the same).
#[utoipa::path(put, path = "/v1/populations/{population}", tag = "tasks",
    params(("population" = String, Path, description = "Device population, 1-128 of A-Z a-z 0-9 . _ -", pattern = r"^[A-Za-z0-9._-]{1,128}$")),
    security(("tenant_token" = [])),
    responses(
        (status = 201, description = "Registered to this tenant", body = PopulationResponse),
        (status = 200, description = "Already this tenant's", body = PopulationResponse),
        (status = 400, description = "Bad population name", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another tenant's population", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn register_population(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(population): ApiPath<String>,
) -> Result<(StatusCode, axum::Json<PopulationResponse>), ApiError> {
    checked(&population)?;
    let claimed = state.db.claim_population(&tenant.id, &population).await?;
    let record = state
        .db
        .populations(&tenant.id)
        .await?
        .into_iter()
        .find(|p| p.name == population)
        .ok_or_else(|| ApiError::Internal("a claimed population is missing".into()))?;
    let status = match claimed {
        Claimed::New => StatusCode::CREATED,
        Claimed::Already => StatusCode::OK,
    };
    Ok((status, axum::Json(record.into())))
}

/// The calling tenant's populations.
#[utoipa::path(get, path = "/v1/populations", tag = "tasks",
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = PopulationList),
        (status = 401, body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_populations(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
) -> Result<axum::Json<PopulationList>, ApiError> {
    let populations = state.db.populations(&tenant.id).await?;
    Ok(axum::Json(PopulationList {
        populations: populations.into_iter().map(Into::into).collect(),
    }))
}

/// Give a population to a tenant: a free one, or one whose current tenant has no active task on it.
#[utoipa::path(put, path = "/v1/admin/populations/{population}", tag = "admin",
    params(("population" = String, Path, description = "Device population", pattern = r"^[A-Za-z0-9._-]{1,128}$")),
    request_body = AssignPopulationRequest,
    security(("admin_token" = [])),
    responses(
        (status = 200, body = PopulationResponse),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such tenant, or the admin API is off", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another tenant has active tasks on it (see `cancel_active_tasks`)", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn assign_population(
    State(state): State<AppState>,
    _admin: Admin,
    ApiPath(population): ApiPath<String>,
    ApiJson(request): ApiJson<AssignPopulationRequest>,
) -> Result<axum::Json<PopulationResponse>, ApiError> {
    checked(&population)?;
    if request.cancel_active_tasks {
        for (tenant, task) in state
            .db
            .other_tenants_active_tasks(&population, &request.tenant_id)
            .await?
        {
            state
                .db
                .cancel_task_because(
                    &tenant,
                    &task,
                    "cancelled by the operator: its population was given to another tenant",
                )
                .await?;
            tracing::warn!(%population, %tenant, %task,
                "task cancelled by the operator to reassign its population");
        }
    }
    let record = state
        .db
        .assign_population(&population, &request.tenant_id)
        .await?;
    tracing::info!(%population, tenant = %request.tenant_id, "population assigned by the operator");
    Ok(axum::Json(record.into()))
}
