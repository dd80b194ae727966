//! The worker API (`/internal/v1/...`): the task database and blob store offered to enclave
//! worker processes (`confed-enclave` in Confidential Space) over HTTP, with the same operations
//! the in-process worker calls (`aggregation::TaskDbJobStore`). Off unless the server has a worker
//! token; callers present it as a bearer token (compared in constant time). Not part of the
//! partner OpenAPI document; the wire format is in docs/protocol.md.

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use confed_worker_api::routes::Route;
use confed_worker_api::store::{JobStore, StagedRelease, StoreError};
use confed_worker_api::wire::{
    FailRequest, LeaseRequest, MAX_LEASE_WAIT_SECONDS, ModelCommitQuery, ReleaseUpload,
    RenewRequest, WorkerId,
};
use std::time::Duration;

use super::error::ApiError;
use super::extract::{ApiBytes, ApiJson, ApiPath, ApiQuery, bearer};
use crate::aggregation::TaskDbJobStore;
use crate::app::{AppState, Limits};

/// Proof that the caller holds the worker token.
pub struct WorkerAuth;

impl FromRequestParts<AppState> for WorkerAuth {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let Some(token) = &state.worker_token else {
            return Err(ApiError::ApiOff(
                "the worker API is off; start the server with CONFED_WORKER_TOKEN set to enable it"
                    .into(),
            ));
        };
        match bearer(parts) {
            Some(presented) if token.matches(presented) => Ok(WorkerAuth),
            _ => Err(ApiError::Unauthorized(
                "send the worker token as `Authorization: Bearer <token>`",
            )),
        }
    }
}

pub(super) fn store(state: &AppState) -> TaskDbJobStore {
    TaskDbJobStore {
        db: state.db.clone(),
        blobs: state.blobs.clone(),
        contributions: state.contributions.clone(),
        keys: state.keys.clone(),
        partitioning: state.partitioning,
    }
}

pub(super) fn store_error(error: StoreError) -> ApiError {
    match error {
        StoreError::LeaseLost => ApiError::LeaseLost(
            "this lease is no longer yours (it expired and another worker took it, a newer lease of yours replaced it, or the job is finished); stop working on it".into(),
        ),
        StoreError::Conflict(detail) => ApiError::Conflict(detail),
        StoreError::Refused(detail) => ApiError::Unprocessable(detail),
        StoreError::Unavailable(detail) => ApiError::Unavailable(detail),
        StoreError::Backend(detail) => ApiError::Internal(detail),
    }
}

/// `name` or `name/incarnation`, each 1-64 of A-Z a-z 0-9 . _ - (a worker that restarts under
/// the same name with a new incarnation takes its own jobs back at once).
fn check_worker(worker: &str) -> Result<(), ApiError> {
    let ok = match worker.split_once('/') {
        Some((name, incarnation)) => id_part_ok(name) && id_part_ok(incarnation),
        None => id_part_ok(worker),
    };
    ok.then_some(()).ok_or_else(|| {
        ApiError::BadRequest(
            "`worker` must be `name` or `name/incarnation`, each 1-64 characters of A-Z, a-z, 0-9, '.', '_', '-'".into(),
        )
    })
}

/// The `worker` of every call under a lease: the `lease_holder` its lease answered
/// (`<worker>~<token>`), which the store compares with the lease's.
fn check_holder(holder: &str) -> Result<(), ApiError> {
    let ok = holder
        .split_once(crate::db::leases::HOLDER_SEPARATOR)
        .is_some_and(|(worker, token)| check_worker(worker).is_ok() && id_part_ok(token));
    ok.then_some(()).ok_or_else(|| {
        ApiError::BadRequest(
            "`worker` must be the `lease_holder` your lease answered (`<worker>~<token>`); lease again if you no longer have it".into(),
        )
    })
}

fn id_part_ok(part: &str) -> bool {
    (1..=64).contains(&part.len())
        && part
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn lease_duration(seconds: u64) -> Result<Duration, ApiError> {
    if (10..=3600).contains(&seconds) {
        Ok(Duration::from_secs(seconds))
    } else {
        Err(ApiError::BadRequest(format!(
            "`lease_seconds` must be between 10 and 3600 (got {seconds})"
        )))
    }
}

/// How often a waiting lease looks again at a pending job that is not due yet (its retry time is
/// by the server's clock, which a replica or a test may move differently from this timer).
const DUE_CHECK: Duration = Duration::from_millis(500);

async fn lease(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiJson(request): ApiJson<LeaseRequest>,
) -> Result<Response, ApiError> {
    check_worker(&request.worker)?;
    let lease = lease_duration(request.lease_seconds)?;
    if request.wait_seconds > MAX_LEASE_WAIT_SECONDS {
        return Err(ApiError::BadRequest(format!(
            "`wait_seconds` must be at most {MAX_LEASE_WAIT_SECONDS} (got {})",
            request.wait_seconds
        )));
    }
    let store = store(&state);
    // Every try of this request keeps the time it arrived: if the worker gives up on it and
    // asks again, this request cannot take back the lease the newer one got (`lease_holder`).
    let arrived = state.now().0;
    let mut job = store
        .lease_wire(&request.worker, arrived, lease)
        .await
        .map_err(store_error)?;
    // Long polling: a round closed by this process, or on PostgreSQL by any replica (its
    // NOTIFY), wakes the wait at once (`Db::job_ready`); so does a pending job becoming due (a
    // failed attempt's retry, 2, 4, 8 ... s after it failed, or an expired lease), by the
    // server's clock, looked at least every `DUE_CHECK`; otherwise the wait ends at
    // `wait_seconds`.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(request.wait_seconds);
    while job.is_none() {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        if remaining.is_zero() {
            break;
        }
        let nap = match state.db.next_job_due().await? {
            Some(due) => Duration::from_millis(due.saturating_sub(state.now().0).max(0) as u64)
                .min(DUE_CHECK)
                .min(remaining),
            None => remaining,
        };
        tokio::select! {
            _ = state.db.job_ready() => {}
            _ = tokio::time::sleep(nap) => {}
        }
        job = store
            .lease_wire(&request.worker, arrived, lease)
            .await
            .map_err(store_error)?;
    }
    match job {
        Some(job) => Ok(axum::Json(job).into_response()),
        None => Ok(StatusCode::NO_CONTENT.into_response()),
    }
}

async fn renew(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiJson(request): ApiJson<RenewRequest>,
) -> Result<StatusCode, ApiError> {
    check_holder(&request.worker)?;
    let lease = lease_duration(request.lease_seconds)?;
    store(&state)
        .renew(&job_id, &request.worker, lease)
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn fail(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiJson(request): ApiJson<FailRequest>,
) -> Result<StatusCode, ApiError> {
    check_holder(&request.worker)?;
    store(&state)
        .fail(&job_id, &request.worker, &request.reason, request.permanent)
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn release(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiJson(upload): ApiJson<ReleaseUpload>,
) -> Result<StatusCode, ApiError> {
    check_holder(&upload.worker)?;
    let average = upload.average_bytes().map_err(ApiError::BadRequest)?;
    store(&state)
        .commit_release(
            &job_id,
            &upload.worker,
            StagedRelease {
                average: &average,
                manifest: &upload.manifest,
                proof: &upload.proof,
                // Stored first with `PUT .../blt-state`; the manifest names it.
                blt_state: None,
            },
        )
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn model(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiQuery(query): ApiQuery<ModelCommitQuery>,
    ApiBytes(body): ApiBytes,
) -> Result<StatusCode, ApiError> {
    check_holder(&query.worker)?;
    if let Some(sha) = &query.optimizer_state_sha256
        && !confed_protocol::hex::is_digest_hex(sha)
    {
        return Err(ApiError::BadRequest(
            "`optimizer_state_sha256` must be 64 lowercase hex digits".into(),
        ));
    }
    confed_worker_api::model::validate_model(&body)
        .map_err(|e| ApiError::Unprocessable(format!("the model is not valid: {e}")))?;
    store(&state)
        .commit_model_linked(
            &job_id,
            &query.worker,
            &body,
            query.optimizer_state_sha256.as_deref(),
        )
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A server optimizer's state for the model version this job makes, stored before the model
/// (`PUT .../model?optimizer_state_sha256=` links it).
async fn optimizer_state(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiQuery(worker): ApiQuery<WorkerId>,
    ApiBytes(body): ApiBytes,
) -> Result<StatusCode, ApiError> {
    check_holder(&worker.worker)?;
    store(&state)
        .put_optimizer_state(&job_id, &worker.worker, &body, None)
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A BLT round's sealed state, stored before its release (whose manifest names its BLAKE3:
/// the release's commit links them).
async fn blt_state(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiQuery(worker): ApiQuery<WorkerId>,
    ApiBytes(body): ApiBytes,
) -> Result<StatusCode, ApiError> {
    check_holder(&worker.worker)?;
    store(&state)
        .put_blt_state(&job_id, &worker.worker, &body)
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A partition's sealed result (`<job id>.p<index>`): stored under the partition's name and
/// recorded; the round's root is leasable once every partition's is.
async fn partition(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(job_id): ApiPath<String>,
    ApiQuery(worker): ApiQuery<WorkerId>,
    ApiBytes(body): ApiBytes,
) -> Result<StatusCode, ApiError> {
    check_holder(&worker.worker)?;
    store(&state)
        .put_partition_sealed(&job_id, &worker.worker, &body)
        .await
        .map_err(store_error)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn blob(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(key): ApiPath<String>,
) -> Result<Vec<u8>, ApiError> {
    store(&state)
        .blob(&key)
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::NotFound(format!("blob {key} not found")))
}

/// The worker API's routes; uploads are bounded by the model size (the release travels as
/// base64 inside JSON: 4/3 of the model plus the manifest).
pub fn router(limits: &Limits) -> Router<AppState> {
    // An analytics result (JSON, in the average's place) of the largest closed domain: at most
    // about 21 bytes a key.
    let analytics_result = confed_protocol::analytics::MAX_DOMAIN_SIZE as usize * 21;
    let upload_limit = limits.model_bytes.max(analytics_result) / 3 * 4 + (4 << 20);
    // FedAdam's and FedYogi's state holds two values per model parameter.
    let state_limit = limits.model_bytes.saturating_mul(2) + (4 << 20);
    let optimizer_state_route = Router::new()
        .route(Route::OptimizerState.template(), put(optimizer_state))
        .layer(DefaultBodyLimit::max(state_limit));
    // A sealed BLT state holds up to 10 strategy (16 bytes) and 10 inverse (8 bytes) buffers
    // per 4-byte model value.
    let blt_state_limit = limits.model_bytes.saturating_mul(60) + (4 << 20);
    let blt_state_route = Router::new()
        .route(Route::BltState.template(), put(blt_state))
        .layer(DefaultBodyLimit::max(blt_state_limit));
    // A sealed partition holds a sum of the model (twice its bytes) or an analytics table, and
    // a masked round's its inputs' slots (within half the slack: `partitions_of`).
    let partition_limit = limits
        .model_bytes
        .saturating_mul(2)
        .max(crate::aggregation::partitions::MAX_SEALED_TABLE_BYTES)
        .saturating_add(crate::aggregation::partitions::PARTITION_SLACK_BYTES);
    let partition_route = Router::new()
        .route(Route::Partition.template(), put(partition))
        .layer(DefaultBodyLimit::max(partition_limit));
    // A batch of contribution keys: each at most 1024 bytes, twice that written with JSON's `\/`
    // (a client that escapes more gets a 413).
    let batch_limit = confed_worker_api::batch::MAX_BATCH_KEYS * (2 * 1024 + 8) + 4096;
    let batch_route = Router::new()
        .route(
            Route::Contributions.template(),
            post(super::worker_reads::contributions),
        )
        .layer(DefaultBodyLimit::max(batch_limit));
    Router::new()
        .route(Route::Lease.template(), post(lease))
        .route(Route::Renew.template(), post(renew))
        .route(Route::Fail.template(), post(fail))
        .route(Route::Release.template(), put(release))
        .route(Route::Model.template(), put(model))
        .route(Route::Blob.template(), get(blob))
        .route(
            Route::Contribution.template(),
            get(super::worker_reads::contribution),
        )
        .layer(DefaultBodyLimit::max(upload_limit))
        .merge(optimizer_state_route)
        .merge(blt_state_route)
        .merge(partition_route)
        .merge(batch_route)
}
