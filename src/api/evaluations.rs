//! A task's evaluations: per evaluated model version, the noised metrics the enclave released
//! (read from the signed manifests, `.../releases/{round}/manifest`). Read-only, per tenant.

use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use super::error::{ApiError, Problem};
use super::extract::{ApiPath, Tenant};
use crate::app::AppState;
use crate::db::EvaluationPoint;
use crate::task_spec::EvaluationSpec;

#[derive(Debug, Serialize, ToSchema)]
pub struct EvaluationList {
    /// The task's evaluation settings (null: the task does not evaluate).
    pub evaluation: Option<EvaluationSpec>,
    /// One per evaluation round released so far, by model version.
    pub evaluations: Vec<EvaluationPoint>,
    /// The evaluated version with the best noised value of the early-stopping metric (accuracy
    /// without a rule); null before any evaluation with a metric.
    pub best_model_version: Option<u64>,
    /// The best version's evaluation is too noisy to choose by (`too_noisy`): at this scale the
    /// ranking is mostly noise; evaluate with more devices, more examples or less noise.
    pub best_too_noisy: bool,
    /// Why the task completed before its planned rounds, when the early-stopping rule stopped
    /// it (null otherwise).
    pub stopped_early: Option<String>,
}

/// The task's evaluations, by model version.
#[utoipa::path(get, path = "/v1/tasks/{id}/evaluations", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = EvaluationList),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_evaluations(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<EvaluationList>, ApiError> {
    let task = state.db.task(&tenant.id, &id).await?;
    let summary = state.evaluations().summary(&task).await?;
    Ok(axum::Json(EvaluationList {
        best_model_version: summary.best,
        best_too_noisy: summary.best_too_noisy,
        stopped_early: summary.stopped_early,
        evaluation: task.spec.evaluation,
        evaluations: summary.points,
    }))
}

/// An accepted request for an on-demand evaluation.
#[derive(Debug, Serialize, ToSchema)]
pub struct EvaluationRequested {
    /// The round the request applies to: the next round of the task that opens (a round the
    /// schedule evaluates anyway takes it at no extra cost).
    pub applies_to: &'static str,
    /// On-demand evaluations of rounds opened so far, and how many the policy allows.
    pub used: u32,
    pub allowed: u32,
}

/// Ask for an evaluation of the task's next round (within the policy's `evaluation.on_demand`).
#[utoipa::path(post, path = "/v1/tasks/{id}/evaluations", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 202, description = "The next round to open will evaluate", body = EvaluationRequested),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task allows no on-demand evaluation, has used them all, is in its last round, or is finished", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn request_evaluation(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<(axum::http::StatusCode, axum::Json<EvaluationRequested>), ApiError> {
    let request = state.evaluations().request(&tenant.id, &id).await?;
    Ok((
        axum::http::StatusCode::ACCEPTED,
        axum::Json(EvaluationRequested {
            applies_to: "the next round that opens",
            used: request.used,
            allowed: request.allowed,
        }),
    ))
}
