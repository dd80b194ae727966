//! Model routes: upload version 0 (opens the task) and download any version.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::error::{ApiError, Problem};
use super::extract::{ApiPath, DeclaredModelLength, Tenant};
use super::tasks::TaskResponse;
use crate::app::AppState;

/// Upload model version 0 (safetensors, F32 tensors); the task opens and round 1 starts.
#[utoipa::path(put, path = "/v1/tasks/{id}/model", tag = "models",
    params(("id" = String, Path, description = "Task id")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "safetensors file"),
    security(("tenant_token" = [])),
    responses(
        (status = 201, description = "Model stored; task OPEN, round 1 collecting", body = TaskResponse),
        (status = 400, description = "Not a valid confed model", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The task already has a model", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Larger than the server's model limit", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn put_model(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
    _declared: DeclaredModelLength,
    body: axum::body::Body,
) -> Result<(StatusCode, axum::Json<TaskResponse>), ApiError> {
    let tasks = state.tasks();
    tasks.check_open_for_model(&tenant.id, &id).await?;
    // To a temporary file as it arrives, hashed on the way: never the whole model in memory.
    let spooled = crate::spool::spool(body, state.limits.model_bytes as u64, "model").await?;
    let bytes = spooled.len;
    let task = tasks.store_version_zero(&tenant.id, &id, spooled).await?;
    tracing::info!(tenant = %tenant.name, task = %id, bytes, "model version 0 stored; task open");
    Ok((StatusCode::CREATED, axum::Json(task.into())))
}

/// Download one model version (safetensors). Versions are immutable: strong ETag, long caching.
#[utoipa::path(get, path = "/v1/tasks/{id}/models/{version}", tag = "models",
    params(("id" = String, Path, description = "Task id"), ("version" = i64, Path, description = "Model version")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, description = "safetensors bytes", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 304, description = "Matches `If-None-Match`"),
        (status = 400, description = "Version is not a number", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task or version", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_model(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath((id, version)): ApiPath<(String, i64)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let model = state.db.model(&tenant.id, &id, version).await?;
    super::model_body::model_response(
        &state,
        &model,
        &headers,
        "private, max-age=31536000, immutable",
    )
    .await
}
