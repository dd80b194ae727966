//! Model routes: upload version 0 (opens the task) and download any version.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::error::{ApiError, Problem};
use super::extract::{ApiPath, DeclaredModelLength, Tenant};
use super::tasks::TaskResponse;
use crate::blob::BlobKey;
use crate::db::NewModel;
use crate::states::TaskState;

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
    let task = state.db.task(&tenant.id, &id).await?;
    check_created(&task, &id)?;
    // To a temporary file as it arrives, hashed on the way: never the whole model in memory.
    let spooled = super::spool::spool(body, state.limits.model_bytes as u64, "model").await?;
    let bytes = spooled.len;
    let task = store_version_zero(&state, &tenant.id, &id, spooled).await?;
    tracing::info!(tenant = %tenant.name, task = %id, bytes, "model version 0 stored; task open");
    Ok((StatusCode::CREATED, axum::Json(task.into())))
}

fn check_created(task: &crate::db::TaskRecord, id: &str) -> Result<(), ApiError> {
    if task.state != TaskState::Created {
        return Err(ApiError::Conflict(format!(
            "task {id} is {}: model version 0 can only be uploaded while the task is CREATED",
            task.state.as_str()
        )));
    }
    Ok(())
}

/// Validates and stores model version 0 of a CREATED task, which opens it (round 1 starts).
pub async fn store_version_zero(
    state: &AppState,
    tenant_id: &str,
    id: &str,
    spooled: super::spool::Spooled,
) -> Result<crate::db::TaskRecord, ApiError> {
    check_created(&state.db.task(tenant_id, id).await?, id)?;
    let spooled = std::sync::Arc::new(spooled);
    let checked = spooled.clone();
    tokio::task::spawn_blocking(move || {
        let mapped = checked
            .map()
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        confed_worker_api::model::validate_model(&mapped)
            .map(|_| ())
            .map_err(|e| ApiError::BadRequest(format!("the body is not a usable model: {e}")))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    let digest = spooled.sha256_hex.clone();
    let key = BlobKey::model(tenant_id, id, 0, &digest)?;
    state.blobs.put_file(&key, spooled.file()).await?;
    let model = NewModel {
        blob_key: key.as_str().to_string(),
        sha256_hex: digest,
        size_bytes: spooled.len as i64,
        optimizer_state_key: None,
    };
    let task = state
        .db
        .open_task_with_model(tenant_id, id, &model, state.now())
        .await?;
    Ok(task)
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
    model_response(
        &state,
        &model,
        &headers,
        "private, max-age=31536000, immutable",
    )
    .await
}

/// Whether an `If-None-Match` value names the entity tag `"<tag>"`: `*`, or any listed tag,
/// weak (`W/"..."`) or strong, that equals it (RFC 9110 13.1.2 compares weakly).
fn if_none_match_names(value: &str, tag: &str) -> bool {
    value.split(',').map(str::trim).any(|listed| {
        listed == "*"
            || listed
                .strip_prefix("W/")
                .unwrap_or(listed)
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                == Some(tag)
    })
}

/// A model version's bytes with a strong ETag (its SHA-256), or 304 when `If-None-Match` matches.
pub async fn model_response(
    state: &AppState,
    model: &crate::db::ModelRecord,
    headers: &HeaderMap,
    cache_control: &'static str,
) -> Result<Response, ApiError> {
    let etag = HeaderValue::from_str(&format!("\"{}\"", model.sha256_hex))
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let cache = HeaderValue::from_static(cache_control);
    let matches = headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| if_none_match_names(v, &model.sha256_hex));
    if matches {
        return Ok((
            StatusCode::NOT_MODIFIED,
            [(header::ETAG, etag), (header::CACHE_CONTROL, cache)],
        )
            .into_response());
    }
    let bytes = state
        .blobs
        .get(&BlobKey::new(model.blob_key.clone())?)
        .await?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (header::ETAG, etag),
            (header::CACHE_CONTROL, cache),
        ],
        bytes,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::if_none_match_names;

    #[test]
    fn if_none_match_compares_weakly_and_takes_lists_and_any() {
        let tag = "ab12";
        for matching in [
            "\"ab12\"",
            "W/\"ab12\"",
            "\"x\", W/\"ab12\"",
            " \"x\" ,\"ab12\" ",
            "*",
        ] {
            assert!(if_none_match_names(matching, tag), "{matching}");
        }
        for other in ["\"ab1\"", "ab12", "W/ab12", "\"ab12", "w/\"ab12\"", ""] {
            assert!(!if_none_match_names(other, tag), "{other}");
        }
    }
}
