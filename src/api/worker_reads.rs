//! The worker API's contribution reads: one stored envelope (`GET /internal/v1/contributions/
//! {key}`), or several in one exchange (`POST /internal/v1/contributions`, framed as
//! `confed_worker_api::batch` says), which `confed-enclave` uses to read a round.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use confed_worker_api::batch::{BatchRequest, MAX_BATCH_KEYS, frame_header};
use confed_worker_api::store::{JobStore, StoreError};
use futures_util::StreamExt;

use super::error::ApiError;
use super::extract::{ApiJson, ApiPath};
use super::workers::{WorkerAuth, store, store_error};
use crate::app::AppState;
use crate::blob::BlobKey;

/// Contributions a batch reads ahead of the one it sends: the next is in memory by the time the
/// socket takes the last bytes of this one.
const BATCH_READ_AHEAD: usize = 2;

pub(super) async fn contribution(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiPath(key): ApiPath<String>,
) -> Result<Response, ApiError> {
    let bytes = store(&state)
        .fetch_into(&key, SENT_BUFFERS.take())
        .await
        .map_err(store_error)?
        .ok_or_else(|| ApiError::NotFound(format!("contribution {key} not found")))?;
    Ok(octet_stream(axum::body::Body::from(Bytes::from_owner(
        Sent(bytes),
    ))))
}

/// One frame per key, in the order named, each read while the ones before it are sent. A read
/// that fails after the answer began cuts the body short (the worker refuses a body with frames
/// missing, and its job is retried); the failure is logged here, where the reason is known.
pub(super) async fn contributions(
    State(state): State<AppState>,
    _: WorkerAuth,
    ApiJson(request): ApiJson<BatchRequest>,
) -> Result<Response, ApiError> {
    let count = request.keys.len();
    if !(1..=MAX_BATCH_KEYS).contains(&count) {
        return Err(ApiError::BadRequest(format!(
            "`keys` must name 1 to {MAX_BATCH_KEYS} contributions (got {count}); split a round's reads into batches"
        )));
    }
    if let Some(index) = request
        .keys
        .iter()
        .position(|key| BlobKey::new(key.as_str()).is_err())
    {
        return Err(ApiError::BadRequest(format!(
            "`keys[{index}]` is not a contribution key (segments of A-Z a-z 0-9 . _ - separated by `/`, none starting with `.`, at most 1024 bytes): send the keys the job lists"
        )));
    }
    // One store for the whole batch, shared by its reads (not a copy of its handles per key).
    let store = std::sync::Arc::new(store(&state));
    let frames = futures_util::stream::iter(request.keys)
        .map(move |key| {
            let store = std::sync::Arc::clone(&store);
            async move {
                let read = store.fetch_into(&key, SENT_BUFFERS.take()).await;
                (key, read)
            }
        })
        .buffered(BATCH_READ_AHEAD)
        .flat_map(|(key, read)| futures_util::stream::iter(frame(&key, read)));
    Ok(octet_stream(axum::body::Body::from_stream(frames)))
}

/// The chunks of one contribution's frame: its length and its bytes, or the length that says it
/// is missing, or the error that ends the body.
fn frame(
    key: &str,
    read: Result<Option<Vec<u8>>, StoreError>,
) -> Vec<Result<Bytes, std::io::Error>> {
    let header = |length| Ok(Bytes::copy_from_slice(&frame_header(length)));
    match read {
        Ok(Some(bytes)) => vec![
            header(Some(bytes.len())),
            Ok(Bytes::from_owner(Sent(bytes))),
        ],
        Ok(None) => vec![header(None)],
        Err(error) => {
            tracing::warn!(%key, %error, "a batch of contributions was cut short: reading one failed");
            vec![Err(std::io::Error::other(error.to_string()))]
        }
    }
}

fn octet_stream(body: axum::body::Body) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        body,
    )
        .into_response()
}

/// Buffers the contribution routes read into, back in the pool once their bytes are sent: a
/// worker reading a round (two batches in flight, each holding up to three buffers here, or
/// eight single reads) reuses a few dozen instead of faulting in a fresh megabyte per
/// contribution.
static SENT_BUFFERS: std::sync::LazyLock<confed_worker_api::reads::BufferPool> =
    std::sync::LazyLock::new(|| confed_worker_api::reads::BufferPool::new(64 << 20));

/// A response body that gives its buffer back when dropped.
struct Sent(Vec<u8>);

impl AsRef<[u8]> for Sent {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Sent {
    fn drop(&mut self) {
        SENT_BUFFERS.give(std::mem::take(&mut self.0));
    }
}
