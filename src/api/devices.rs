//! Task assignment for devices: check-in, model download, contribution upload, report. Devices
//! carry no tenant token; an assignment id is a one-time capability (256 random bits) and the
//! database stores only its hash.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, Problem};
use super::extract::{ApiJson, ApiPath};
use crate::app::AppState;
use crate::checkin::{CheckinOutcome, RetryReason};
use crate::db::device::{Capability, Refusal, Stored};
use crate::states::AssignmentState;
use crate::uploads::UploadError;
pub use confed_protocol::device::{
    AssignmentResponse, CheckinRequest, ReportOutcome, ReportRequest, ReportResponse,
    RetryResponse, RetryWindow,
};

/// Ask for an assignment in a population.
#[utoipa::path(post, path = "/v1/populations/{population}/checkin", tag = "devices",
    params(("population" = String, Path, description = "Device population, 1-128 of A-Z a-z 0-9 . _ -", pattern = r"^[A-Za-z0-9._-]{1,128}$")),
    request_body = CheckinRequest,
    responses(
        (status = 201, description = "Assigned", body = AssignmentResponse),
        (status = 200, description = "Nothing to do now; retry within the window", body = RetryResponse),
        (status = 400, description = "Bad population or client version", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn checkin(
    State(state): State<AppState>,
    ApiPath(population): ApiPath<String>,
    ApiJson(request): ApiJson<CheckinRequest>,
) -> Result<Response, ApiError> {
    let outcome = state
        .checkin()
        .check_in(&population, request, state.now())
        .await?;
    Ok(match outcome {
        CheckinOutcome::Assigned(assignment) => {
            (StatusCode::CREATED, axum::Json(*assignment)).into_response()
        }
        CheckinOutcome::Retry(reason) => {
            if reason == RetryReason::NoEncryptionKey {
                tracing::warn!(%population, "a round has no signed encryption key; check the key services");
            }
            (
                StatusCode::OK,
                axum::Json(RetryResponse {
                    retry_window: reason.window(),
                    reason: reason.as_str().to_string(),
                }),
            )
                .into_response()
        }
    })
}

/// Download the model the assignment trains from. Only a live assignment's holder may: a model
/// version is the sum of every earlier release, so versions are not public. Immutable at this
/// URL, strong ETag, private caching; 304 on `If-None-Match`.
#[utoipa::path(get, path = "/v1/assignments/{assignment_id}/model", tag = "devices",
    params(("assignment_id" = String, Path, description = "Assignment capability")),
    responses(
        (status = 200, description = "safetensors bytes", body = Vec<u8>, content_type = "application/octet-stream"),
        (status = 304, description = "Matches `If-None-Match`"),
        (status = 404, description = "Unknown assignment", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The assignment is already finished", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Assignment expired or round closed", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn get_model(
    State(state): State<AppState>,
    ApiPath(capability): ApiPath<Capability>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let assignment = state
        .db
        .assignment(&capability)
        .await?
        .ok_or_else(|| refusal(Refusal::UnknownAssignment))?;
    if let Some(closed) = crate::uploads::closed_for_upload(&assignment, state.now().0) {
        return Err(refusal(closed));
    }
    let version = assignment
        .model_version
        .ok_or_else(|| ApiError::NotFound("the task has no model yet".into()))?;
    let model = state.db.model_of_task(&assignment.task_id, version).await?;
    super::model_body::model_response(
        &state,
        &model,
        &headers,
        "private, max-age=86400, immutable",
    )
    .await
}

fn refusal(refusal: Refusal) -> ApiError {
    match refusal {
        Refusal::UnknownAssignment => {
            ApiError::NotFound("no such assignment; check in again".into())
        }
        Refusal::Expired => ApiError::Gone("the assignment expired; check in again".into()),
        Refusal::RoundClosed => ApiError::Gone("the round is closed; check in again".into()),
        Refusal::DifferentBytes => ApiError::Conflict(
            "this assignment already holds a different contribution; an assignment takes one"
                .into(),
        ),
        Refusal::NotUploaded => {
            ApiError::Conflict("upload the contribution before reporting completion".into())
        }
        Refusal::Finished(state) => {
            ApiError::Conflict(format!("the assignment is already {}", state.as_str()))
        }
    }
}

/// Upload the sealed contribution (CBOR envelope). 201 once durable; 200 for the same bytes again.
#[utoipa::path(put, path = "/v1/assignments/{assignment_id}/contribution", tag = "devices",
    params(("assignment_id" = String, Path, description = "Assignment capability")),
    request_body(content = Vec<u8>, content_type = "application/cbor", description = "contribution envelope"),
    responses(
        (status = 201, description = "Stored durably"),
        (status = 200, description = "The same bytes were already stored"),
        (status = 400, description = "Malformed envelope", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Unknown assignment", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Different bytes for a used assignment", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Assignment expired or round closed", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Too large for the task's model", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not application/cbor", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Key id unknown or not the round's key", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn put_contribution(
    State(state): State<AppState>,
    ApiPath(capability): ApiPath<Capability>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let now = state.now();
    let uploads = state.uploads();
    // Everything that can refuse the upload is decided before a byte of the body is read: a
    // made-up capability or a declared size over the task's limit costs the server no memory.
    let admitted = match admit_upload(&state, &uploads, &capability, &headers, now).await {
        Ok(admitted) => admitted,
        Err(error) => return before_body(error),
    };
    store_upload(&state, &uploads, &capability, admitted, body, now)
        .await
        .into_response()
}

/// An answer sent before the request's body was read. The server then closes the connection
/// (it cannot skip an unread body), and says so (`Connection: close`), so that a client's pool
/// does not hand the connection to its next request: a device whose upload came just after its
/// round closed used to have its next check-in fail with "connection closed before message
/// completed".
fn before_body(error: ApiError) -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut response = error.into_response();
    response.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// Whether the upload may be read at all: the assignment, the media type and the declared size.
async fn admit_upload(
    state: &AppState,
    uploads: &crate::uploads::Uploads<'_>,
    capability: &Capability,
    headers: &HeaderMap,
    now: crate::clock::Millis,
) -> Result<crate::uploads::Admitted, ApiError> {
    let assignment = uploads.find(capability).await?;
    // A masked task's updates are up to twice the model's bytes (u64 on the grid in 2^64).
    let masked = state
        .device_auth
        .requirement(&state.db, &assignment)
        .await?
        .is_some_and(|r| r.masking.is_some());
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    // The media type exactly (RFC 9110: case-insensitive, parameters after `;` ignored), so
    // `application/cbor-seq` and friends are refused rather than matched by prefix.
    let media_type = content_type.split(';').next().unwrap_or("").trim();
    if !media_type.eq_ignore_ascii_case("application/cbor") {
        return Err(ApiError::UnsupportedMediaType(
            "send the envelope as `Content-Type: application/cbor`".into(),
        ));
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    Ok(uploads.admit(assignment, declared, masked, now).await?)
}

/// Reads the admitted upload's body (at most its limit), checks the envelope and stores it.
async fn store_upload(
    state: &AppState,
    uploads: &crate::uploads::Uploads<'_>,
    capability: &Capability,
    admitted: crate::uploads::Admitted,
    body: axum::body::Body,
    now: crate::clock::Millis,
) -> Result<StatusCode, ApiError> {
    let limit = admitted.limit;
    // A body without a length (chunked) is read only up to the limit.
    let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(
        body,
        usize::try_from(limit).unwrap_or(usize::MAX),
    ))
    .await
    .map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            UploadError::TooLarge {
                size: format!("more than {limit}"),
                limit,
            }
            .into()
        } else {
            ApiError::BadRequest(format!("the upload was cut off: {e}"))
        }
    })?
    .to_bytes();
    let stored = uploads
        .accept(capability, &admitted, &body, &state.device_auth, now)
        .await?;
    Ok(match stored {
        Stored::New => StatusCode::CREATED,
        Stored::Again => StatusCode::OK,
    })
}

impl From<UploadError> for ApiError {
    fn from(error: UploadError) -> Self {
        match error {
            UploadError::Refused(why) => refusal(why),
            UploadError::TooLarge { .. } => ApiError::PayloadTooLarge(error.to_string()),
            UploadError::Malformed(detail) => ApiError::BadRequest(detail),
            UploadError::WrongKey(detail) => ApiError::Unprocessable(detail),
            UploadError::DirectUploadSize { .. } => ApiError::Unprocessable(error.to_string()),
            UploadError::Unauthenticated(_) => ApiError::TokenRefused(error.to_string()),
            UploadError::TokenRequired {
                detail,
                www_authenticate,
            } => ApiError::TokenRequired {
                detail,
                www_authenticate,
            },
            UploadError::TokenRefused(detail) => ApiError::TokenRefused(detail),
            UploadError::Db(error) => error.into(),
            UploadError::Blob(error) => error.into(),
        }
    }
}

/// Report the assignment's outcome. `completed` needs the contribution uploaded first.
#[utoipa::path(post, path = "/v1/assignments/{assignment_id}/report", tag = "devices",
    params(("assignment_id" = String, Path, description = "Assignment capability")),
    request_body = ReportRequest,
    responses(
        (status = 200, description = "Recorded (also when the same report repeats)", body = ReportResponse),
        (status = 400, body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Unknown assignment", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Not uploaded yet, or already finished otherwise", body = Problem, content_type = "application/problem+json"),
        (status = 410, description = "Expired or round closed", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The object uploaded straight to the blob store carries no device token that authenticates it (a task requiring tokens); it does not count", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The object uploaded straight to the blob store is empty or too large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The blob store could not be asked; retry", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn report(
    State(state): State<AppState>,
    ApiPath(capability): ApiPath<Capability>,
    ApiJson(request): ApiJson<ReportRequest>,
) -> Result<axum::Json<ReportResponse>, ApiError> {
    let recorded = state
        .uploads()
        .report(
            &capability,
            request.outcome,
            request.error.as_deref(),
            &state.device_auth,
            state.now(),
        )
        .await?;
    metrics::counter!("confed_reports_total", "state" => recorded.as_str()).increment(1);
    let retry_window =
        (recorded == AssignmentState::Rejected).then(|| RetryReason::RoundFull.window());
    Ok(axum::Json(ReportResponse {
        state: recorded,
        retry_window,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_waits_spread_over_the_window() {
        let window = RetryWindow {
            min_seconds: 60,
            max_seconds: 120,
        };
        assert_eq!(window.jittered(0.0).as_secs(), 60);
        assert_eq!(window.jittered(0.5).as_secs(), 90);
        assert!(window.jittered(0.999).as_secs_f64() < 120.0);
        assert_eq!(
            window.jittered(7.0).as_secs(),
            120,
            "out-of-range draws are clamped"
        );
    }
}
