//! A task's releases: per round, what the enclave published (the noised average and its
//! manifest: counts, exclusions by reason, noise, privacy spent). Read-only, per tenant.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use super::error::{ApiError, Problem};
use super::extract::{ApiPath, Tenant};
use crate::app::AppState;
use crate::blob::BlobKey;
use crate::clock::{Millis, rfc3339};

/// One round's release.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReleaseResponse {
    pub round: i64,
    /// Contributions in the average.
    pub included: i64,
    /// Contributions left out (the manifest says why).
    pub excluded: i64,
    /// The task's privacy spending through this round (epsilon at the task's delta).
    pub epsilon_spent: f64,
    /// SHA-256 (hex) of the average's bytes.
    pub average_sha256: String,
    /// Tasks with `privacy.health` only: the manifest's noised count of the round's devices
    /// that sent zeros in place of a trained update (docs/privacy.md, "Health").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthCount>,
    pub created_at: String,
    /// The enclave's manifest, verbatim (format `confed-release/v2`, docs/protocol.md). Its exact
    /// bytes, which the enclave signed, are at `.../releases/{round}/manifest`.
    /// Served as the stored bytes (a parse and re-serialisation once changed a float by one ULP).
    #[schema(value_type = Object)]
    pub manifest: Box<serde_json::value::RawValue>,
    /// Who vouches for this release: the enclave's signature and the key services' receipts
    /// (docs/attestation.md); check it with `confed verify release`. Absent for releases made
    /// before proofs existed.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub proof: Option<Box<serde_json::value::RawValue>>,
}

/// A round's noised health count (the manifest's `health`).
#[derive(Debug, Serialize, serde::Deserialize, ToSchema)]
pub struct HealthCount {
    /// Included devices that sent zeros, plus discrete Gaussian noise: unbiased, so it may lie
    /// below 0 or above `included`.
    pub zeroed: i64,
    /// Standard deviation of the noise, in devices.
    pub stddev: f64,
}

/// The health count a stored manifest states, if any.
fn health_of(manifest_json: &str) -> Option<HealthCount> {
    #[derive(serde::Deserialize)]
    struct WithHealth {
        health: Option<HealthCount>,
    }
    serde_json::from_str::<WithHealth>(manifest_json)
        .ok()
        .and_then(|m| m.health)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReleaseList {
    pub releases: Vec<ReleaseResponse>,
}

/// The task's releases, by round.
#[utoipa::path(get, path = "/v1/tasks/{id}/releases", tag = "tasks",
    params(("id" = String, Path, description = "Task id")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, body = ReleaseList),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn list_releases(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath(id): ApiPath<String>,
) -> Result<axum::Json<ReleaseList>, ApiError> {
    let releases = state.db.releases(&tenant.id, &id).await?;
    let mut out = Vec::with_capacity(releases.len());
    for release in releases {
        out.push(ReleaseResponse {
            round: release.round_number,
            included: release.included,
            excluded: release.excluded,
            epsilon_spent: release.epsilon_spent,
            average_sha256: release.average_sha256,
            health: health_of(&release.manifest_json),
            created_at: rfc3339(Millis(release.created_at)),
            manifest: serde_json::value::RawValue::from_string(release.manifest_json)
                .map_err(|e| ApiError::Internal(format!("stored manifest: {e}")))?,
            proof: release
                .proof_json
                .map(serde_json::value::RawValue::from_string)
                .transpose()
                .map_err(|e| ApiError::Internal(format!("stored proof: {e}")))?,
        });
    }
    Ok(axum::Json(ReleaseList { releases: out }))
}

/// One round's manifest, byte for byte as the enclave signed it (JSON).
#[utoipa::path(get, path = "/v1/tasks/{id}/releases/{round}/manifest", tag = "tasks",
    params(("id" = String, Path, description = "Task id"), ("round" = i64, Path, description = "Round number")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, description = "the manifest file's bytes", body = Object, content_type = "application/json"),
        (status = 400, description = "Round is not a number", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task, or the round has no release", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_manifest(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath((id, round)): ApiPath<(String, i64)>,
) -> Result<Response, ApiError> {
    let release = release_of(&state, &tenant.id, &id, round).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        release.manifest_json,
    )
        .into_response())
}

async fn release_of(
    state: &AppState,
    tenant_id: &str,
    task_id: &str,
    round: i64,
) -> Result<crate::db::jobs::ReleaseRecord, ApiError> {
    state
        .db
        .releases(tenant_id, task_id)
        .await?
        .into_iter()
        .find(|r| r.round_number == round)
        .ok_or_else(|| {
            ApiError::NotFound(format!("round {round} of task {task_id} has no release"))
        })
}

/// One round's noised average update (safetensors, the model's tensor names and shapes).
#[utoipa::path(get, path = "/v1/tasks/{id}/releases/{round}/average", tag = "tasks",
    params(("id" = String, Path, description = "Task id"), ("round" = i64, Path, description = "Round number")),
    security(("tenant_token" = [])),
    responses(
        (status = 200, description = "The release's bytes: the noised average update (safetensors), or an analytics task's result (JSON, docs/api.md \"Analytics tasks\")", content(
            (Vec<u8> = "application/octet-stream"),
            (Object = "application/json")
        )),
        (status = 400, description = "Round is not a number", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such task, or the round has no release", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_average(
    State(state): State<AppState>,
    Tenant(tenant): Tenant,
    ApiPath((id, round)): ApiPath<(String, i64)>,
) -> Result<Response, ApiError> {
    let release = release_of(&state, &tenant.id, &id, round).await?;
    // An analytics task's result is JSON (docs/api.md, "Analytics tasks"); an average is
    // safetensors.
    let content_type = match state.db.task(&tenant.id, &id).await?.spec.analytics {
        Some(_) => "application/json",
        None => "application/octet-stream",
    };
    let bytes = state.blobs.get(&BlobKey::new(release.average_key)?).await?;
    let etag = HeaderValue::from_str(&format!("\"{}\"", release.average_sha256))
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok((
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::ETAG, etag),
            (
                header::CACHE_CONTROL,
                HeaderValue::from_static("private, max-age=31536000, immutable"),
            ),
        ],
        bytes,
    )
        .into_response())
}
