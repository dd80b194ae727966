//! Task assignment for devices: check-in, model download, contribution upload, report. Devices
//! carry no tenant token; an assignment id is a one-time capability (256 random bits) and the
//! database stores only its hash.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use confed_protocol::envelope::Envelope;

use super::AppState;
use super::error::{ApiError, Problem};
use super::extract::{ApiJson, ApiPath};
use crate::blob::{BlobError, BlobKey};
use crate::checkin::{Checkin, CheckinOutcome, RetryReason, contribution_key, contribution_limit};
use crate::db::device::{Capability, Refusal, Stored, UploadDigests};
use crate::keys::KeyState;
use crate::registry::check_attributes;
use crate::states::AssignmentState;
use crate::task_spec::{parse_version, valid_population};
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
    if !valid_population(&population) {
        return Err(ApiError::BadRequest(
            "the population must be 1-128 of A-Z a-z 0-9 . _ -".into(),
        ));
    }
    let version = parse_version(&request.client_version).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "`client_version` must be a dotted numeric version like \"1.4.0\" (got {:?})",
            request.client_version
        ))
    })?;
    check_attributes(&request.attributes).map_err(ApiError::BadRequest)?;
    if request.served.len() > confed_protocol::device::MAX_SERVED {
        return Err(ApiError::BadRequest(format!(
            "`served` lists {} rounds; send at most {} (the latest round of each task)",
            request.served.len(),
            confed_protocol::device::MAX_SERVED
        )));
    }
    // Characters, as the schema's maxLength counts them (at most 512 bytes of UTF-8).
    if let Some(bad) = request
        .served
        .iter()
        .find(|s| !(1..=128).contains(&s.task_id.chars().count()))
    {
        return Err(ApiError::BadRequest(format!(
            "`served` names a task id of {} characters; task ids are 1-128",
            bad.task_id.chars().count()
        )));
    }
    let rounds = 1..=confed_protocol::device::MAX_SERVED_ROUND;
    if let Some(bad) = request.served.iter().find(|s| !rounds.contains(&s.round)) {
        return Err(ApiError::BadRequest(format!(
            "`served` names round {}; rounds are 1-{}",
            bad.round,
            confed_protocol::device::MAX_SERVED_ROUND
        )));
    }
    if let Some(tenant) = &request.tenant_id
        && !(1..=128).contains(&tenant.chars().count())
    {
        return Err(ApiError::BadRequest(
            "`tenant_id` must be 1-128 characters (the id of the tenant the device works for)"
                .into(),
        ));
    }
    let now = state.now();
    let checkin = Checkin {
        db: &state.db,
        scheduling: state.scheduling,
        keys: &state.keys,
        contributions: state.contributions.as_ref(),
    };
    let outcome = checkin.assign(&population, &version, &request, now).await?;
    state.registry.record(
        &population,
        version,
        request.attributes,
        outcome.label(),
        now,
    );
    metrics::counter!("confed_checkins_total", "outcome" => outcome.label()).increment(1);
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
    if let Some(closed) = closed_for_upload(&assignment, state.now()) {
        return Err(refusal(closed));
    }
    let version = assignment
        .model_version
        .ok_or_else(|| ApiError::NotFound("the task has no model yet".into()))?;
    let model = state.db.model_of_task(&assignment.task_id, version).await?;
    super::models::model_response(
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
) -> Result<StatusCode, ApiError> {
    let now = state.now();
    // Everything that can refuse the upload is decided before a byte of the body is read: a
    // made-up capability or a declared size over the task's limit costs the server no memory.
    let assignment = state
        .db
        .assignment(&capability)
        .await?
        .ok_or_else(|| refusal(Refusal::UnknownAssignment))?;
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
    let limit = contribution_limit(assignment.model_bytes);
    let too_large = |size: String| {
        ApiError::PayloadTooLarge(format!(
            "the envelope is {size} bytes; this task accepts at most {limit}"
        ))
    };
    if let Some(declared) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && declared > limit
    {
        return Err(too_large(declared.to_string()));
    }
    if assignment.contribution_sha256.is_none()
        && let Some(closed) = closed_for_upload(&assignment, now)
    {
        if closed == Refusal::RoundClosed {
            count_late(&state, &assignment.id).await;
        }
        return Err(refusal(closed));
    }
    // A body without a length (chunked) is read only up to the limit.
    let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(
        body,
        usize::try_from(limit).unwrap_or(usize::MAX),
    ))
    .await
    .map_err(|e| {
        if e.is::<http_body_util::LengthLimitError>() {
            too_large(format!("more than {limit}"))
        } else {
            ApiError::BadRequest(format!("the upload was cut off: {e}"))
        }
    })?
    .to_bytes();
    let parsed = Envelope::from_cbor(&body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let round_key = assignment.key_id.as_deref().unwrap_or("");
    if parsed.key_id != round_key {
        return Err(ApiError::Unprocessable(format!(
            "key id {:?} is not this round's key {round_key:?}; seal to the key in the assignment",
            parsed.key_id
        )));
    }
    match state.keys.key(round_key) {
        Some(key)
            if KeyState::at(key.not_before, key.not_after, crate::clock::seconds_of(now))
                != KeyState::Pending => {}
        _ => {
            return Err(ApiError::Unprocessable(format!(
                "key {round_key:?} is unknown or not active"
            )));
        }
    }
    // A task that requires device tokens stores nothing unauthenticated.
    state
        .device_auth
        .check_upload(&state.db, &assignment, &parsed)
        .await?;
    // The one digest of an upload, computed here: the round's job lists it (so the enclave
    // commits to its inputs without a first read, and checks the bytes against it as it opens
    // them), and it makes a repeated upload idempotent.
    let blake3_hex = blake3::hash(&body).to_hex();
    let digest = format!("{BLAKE3_PREFIX}{blake3_hex}");
    // An assignment that already holds a contribution stores nothing more: the same bytes again
    // are a retry (200), others are refused (409). Appending first would let one capability
    // write the task's limit to disk again and again, even after its round closed.
    if let Some(held) = &assignment.contribution_sha256 {
        return if same_bytes(held, &digest, &body) {
            Ok(StatusCode::OK)
        } else {
            Err(refusal(Refusal::DifferentBytes))
        };
    }
    let key = view_contribution_key(&assignment)?;
    // The bytes are durable before the row that refers to them is written.
    let stored = match state.contributions.put_new(key, &body).await {
        Ok(stored) => stored,
        Err(crate::blob::BlobError::Conflict(_)) => return Err(refusal(Refusal::DifferentBytes)),
        Err(other) => return Err(other.into()),
    };
    match state
        .db
        .record_upload(
            &capability,
            UploadDigests {
                idempotency: &digest,
                blake3_hex: Some(blake3_hex.as_str()),
            },
            body.len() as i64,
            stored.as_str(),
            now,
        )
        .await?
    {
        Ok(Stored::New) => {
            metrics::counter!("confed_contributions_total", "outcome" => "stored").increment(1);
            Ok(StatusCode::CREATED)
        }
        Ok(Stored::Again) => Ok(StatusCode::OK),
        Err(why) => Err(refusal(why)),
    }
}

/// How an upload through the server is named for idempotency: `blake3:<hex>`, the BLAKE3 the
/// round's job lists anyway (one hash per upload).
const BLAKE3_PREFIX: &str = "blake3:";

/// Whether `body` (whose named digest is `digest`) is the contribution `held` names. Rows stored
/// before the BLAKE3 digest hold a bare lowercase hex SHA-256, computed only for them.
fn same_bytes(held: &str, digest: &str, body: &[u8]) -> bool {
    if held.starts_with(BLAKE3_PREFIX) {
        held == digest
    } else {
        held.eq_ignore_ascii_case(&confed_protocol::hex::sha256_hex(body))
    }
}

fn view_contribution_key(a: &crate::db::device::AssignmentView) -> Result<BlobKey, BlobError> {
    contribution_key(&a.tenant_id, &a.task_id, a.round_number, a.attempt, &a.id)
}

/// A contribution that arrived after its round closed: counted (metric, and the round's funnel
/// through the assignment's row). A failure to record it is logged, never the device's problem.
async fn count_late(state: &AppState, assignment: &crate::db::device::AssignmentRef) {
    match state.db.mark_late(assignment, state.now()).await {
        Ok(true) => metrics::counter!("confed_contributions_late_total").increment(1),
        Ok(false) => {} // counted the first time
        Err(error) => tracing::warn!(%error, "could not record a late contribution"),
    }
}

fn closed_for_upload(a: &crate::db::device::AssignmentView, now: i64) -> Option<Refusal> {
    if a.round_state != crate::states::RoundState::Collecting {
        Some(Refusal::RoundClosed)
    } else if now >= a.expires_at || a.state == AssignmentState::TimedOut {
        Some(Refusal::Expired)
    } else if a.state != AssignmentState::Assigned {
        Some(Refusal::Finished(a.state))
    } else {
        None
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
        (status = 422, description = "The object uploaded straight to the blob store is empty or too large", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The blob store could not be asked; retry", body = Problem, content_type = "application/problem+json"),
    ))]
pub async fn report(
    State(state): State<AppState>,
    ApiPath(capability): ApiPath<Capability>,
    ApiJson(request): ApiJson<ReportRequest>,
) -> Result<axum::Json<ReportResponse>, ApiError> {
    let outcome = request.outcome;
    if outcome == ReportOutcome::Completed && state.contributions.accepts_direct_uploads() {
        note_direct_upload(&state, &capability).await?;
    }
    let recorded = match state
        .db
        .record_report(&capability, outcome, request.error.as_deref(), state.now())
        .await?
    {
        Ok(recorded) => recorded,
        Err(why) => {
            if why == Refusal::RoundClosed && outcome == ReportOutcome::Completed {
                count_late(&state, &capability.reference()).await;
            }
            return Err(refusal(why));
        }
    };
    metrics::counter!("confed_reports_total", "state" => recorded.as_str()).increment(1);
    let retry_window =
        (recorded == AssignmentState::Rejected).then(|| RetryReason::RoundFull.window());
    Ok(axum::Json(ReportResponse {
        state: recorded,
        retry_window,
    }))
}

/// A device that uploaded straight to the blob store reports completion: the server checks that
/// the object is there and within the task's size limit, and records it like an upload through
/// the server (the state machine's ASSIGNED -> UPLOADED). Nothing is listed; one metadata read.
async fn note_direct_upload(state: &AppState, capability: &Capability) -> Result<(), ApiError> {
    let assignment = state
        .db
        .assignment(capability)
        .await?
        .ok_or_else(|| refusal(Refusal::UnknownAssignment))?;
    if assignment.contribution_sha256.is_some() || assignment.state != AssignmentState::Assigned {
        return Ok(()); // already noted, or finished: the report itself says what applies
    }
    if let Some(closed) = closed_for_upload(&assignment, state.now()) {
        if closed == Refusal::RoundClosed {
            count_late(state, &assignment.id).await;
        }
        return Err(refusal(closed));
    }
    let key = view_contribution_key(&assignment)?;
    let Some(object) = state.contributions.stat(&key).await? else {
        return Err(refusal(Refusal::NotUploaded));
    };
    let limit = contribution_limit(assignment.model_bytes);
    if object.size > limit || object.size == 0 {
        return Err(ApiError::Unprocessable(format!(
            "the uploaded contribution is {} bytes; this task accepts 1 to {limit}",
            object.size
        )));
    }
    match state
        .db
        .record_upload(
            capability,
            UploadDigests {
                idempotency: &object.digest,
                blake3_hex: None,
            },
            object.size as i64,
            key.as_str(),
            state.now(),
        )
        .await?
    {
        Ok(Stored::New) => {
            metrics::counter!("confed_contributions_total", "outcome" => "stored_direct")
                .increment(1);
            Ok(())
        }
        Ok(Stored::Again) => Ok(()),
        Err(why) => Err(refusal(why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retried upload is compared by the digest its row holds: `blake3:<hex>` now, a bare
    /// SHA-256 in rows stored before (still answered 200 for the same bytes).
    #[test]
    fn a_repeated_upload_matches_by_blake3_or_by_a_legacy_sha256() {
        let body = b"envelope bytes";
        let digest = format!("{BLAKE3_PREFIX}{}", blake3::hash(body).to_hex());
        assert!(same_bytes(&digest, &digest, body));
        let legacy = confed_protocol::hex::sha256_hex(body);
        assert!(same_bytes(&legacy, &digest, body));
        assert!(same_bytes(&legacy.to_uppercase(), &digest, body));
        let other = b"other bytes";
        let other_digest = format!("{BLAKE3_PREFIX}{}", blake3::hash(other).to_hex());
        assert!(!same_bytes(&digest, &other_digest, other));
        assert!(!same_bytes(&legacy, &other_digest, other));
        assert!(!same_bytes("md5:00", &digest, body));
    }

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
