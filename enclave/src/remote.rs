//! The job store over HTTP: how a `confed-enclave` process (in Confidential Space) reaches the
//! untrusted server's worker API (`/internal/v1/...`, docs/protocol.md). The wire types are
//! confed-worker-api's (`wire`), one definition for both sides.
//!
//! Everything the server answers is untrusted input to the enclave, exactly as in-process: the
//! worker authenticates contributions by HPKE and the key by the key services' shares.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use reqwest::StatusCode;
use std::time::Duration;
use zeroize::Zeroizing;

use confed_worker_api::batch::{BatchRequest, FrameDecoder, MAX_BATCH_KEYS};
use confed_worker_api::reads::BufferPool;
use confed_worker_api::routes::Route;
use confed_worker_api::store::{
    JobSpec, JobStore, ModelCommitSteps, StagedRelease, StoreError, commit_model_in_order,
};
use confed_worker_api::wire::{
    BlobSource, FailRequest, JobWire, LEASE_LOST, LeaseRequest, MAX_LEASE_WAIT_SECONDS, NOT_FOUND,
    ReleaseUpload, RenewRequest, resolve,
};

/// The worker API client.
pub struct HttpJobStore {
    base: String,
    token: Zeroizing<String>,
    http: reqwest::Client,
    /// For batches of contributions, whose bodies are read only as fast as the job opens them:
    /// no bound on the whole exchange, `timeout` on each wait for the server instead.
    batches: reqwest::Client,
    timeout: Duration,
    lease_wait: u64,
}

impl HttpJobStore {
    /// `base`: the server's URL; `token`: the worker token (from a file or the environment).
    pub fn new(base: &str, token: Zeroizing<String>, timeout: Duration) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            token,
            http: crate::http::client(timeout),
            batches: crate::http::streaming_client(timeout),
            timeout,
            lease_wait: 0,
        }
    }

    /// Leases wait up to `wait` on the server for a job to appear (long polling), so a round
    /// that closes is picked up at once rather than at the next poll. Keep the client timeout
    /// above it.
    pub fn with_lease_wait(mut self, wait: Duration) -> Self {
        self.lease_wait = wait.as_secs().min(MAX_LEASE_WAIT_SECONDS);
        self
    }

    /// The URL of `route` for `id` (a job id or a blob key), with `query` (`""` or `?...`).
    fn url(&self, route: Route, id: &str, query: &str) -> String {
        format!("{}{}{query}", self.base, route.path(id))
    }

    /// Sends a call whose only success is a 2xx answer; any other is its error (a 404 too:
    /// the worker API off, or a server without the route, never a call that took effect).
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, StoreError> {
        let response = self.dispatch(request).await?;
        checked(response).await
    }

    /// Sends a read of one object: `None` when the server answers that it has no such object
    /// (a 404 of the `NOT_FOUND` problem type); any other 404 (the worker API off, a route the
    /// server lacks, a proxy's page) is an error, so it is never read as a missing object.
    async fn send_read(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<Option<reqwest::Response>, StoreError> {
        let response = self.dispatch(request).await?;
        if response.status() != StatusCode::NOT_FOUND {
            return checked(response).await.map(Some);
        }
        let problem = problem_of(response).await;
        match problem.kind.as_deref() {
            Some(NOT_FOUND) => Ok(None),
            _ => Err(StoreError::Backend(format!(
                "worker API answered 404 Not Found: {}",
                problem.detail
            ))),
        }
    }

    /// The request, with the worker token, sent.
    async fn dispatch(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, StoreError> {
        request
            .bearer_auth(self.token.as_str())
            .send()
            .await
            .map_err(|e| StoreError::Backend(format!("worker API unreachable: {e}")))
    }

    async fn bytes(&self, route: Route, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(response) = self
            .send_read(self.http.get(self.url(route, key, "")))
            .await?
        else {
            return Ok(None);
        };
        response
            .bytes()
            .await
            .map(|b| Some(b.to_vec()))
            .map_err(|e| StoreError::Backend(e.to_string()))
    }
}

/// A problem+json answer's `type` and `detail` (`"no detail"` when the body has none).
struct Problem {
    kind: Option<String>,
    detail: String,
}

async fn problem_of(response: reqwest::Response) -> Problem {
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    Problem {
        kind: body["type"].as_str().map(str::to_string),
        detail: body["detail"].as_str().unwrap_or("no detail").to_string(),
    }
}

/// `response` if it is a 2xx answer, else its error by status and problem type.
async fn checked(response: reqwest::Response) -> Result<reqwest::Response, StoreError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let problem = problem_of(response).await;
    let detail = problem.detail;
    Err(match (status, problem.kind.as_deref()) {
        (StatusCode::CONFLICT, Some(LEASE_LOST)) => StoreError::LeaseLost,
        (StatusCode::CONFLICT, _) => StoreError::Conflict(detail),
        (StatusCode::UNPROCESSABLE_ENTITY, _) => StoreError::Refused(detail),
        (StatusCode::SERVICE_UNAVAILABLE, _) => StoreError::Unavailable(detail),
        _ => StoreError::Backend(format!("worker API answered {status}: {detail}")),
    })
}

impl BlobSource for HttpJobStore {
    async fn required_blob(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.bytes(Route::Blob, key)
            .await?
            .ok_or_else(|| StoreError::Backend(format!("blob {key} is missing on the server")))
    }
}

/// Most bytes a contribution read reserves up front on the server's `Content-Length`.
const MAX_RESERVE: usize = 64 << 20;

/// Contributions one request of a round's reads names: a round of 1 MB contributions reads
/// 32 MB per request, so the per-request work of both sides is a small share of it, while two
/// requests in flight still keep the reads ahead of the opens.
const BATCH_KEYS: usize = 32;
const _: () = assert!(BATCH_KEYS <= MAX_BATCH_KEYS);

/// One batch's read in progress (`HttpJobStore::fetch_batch`).
struct BatchRead {
    /// The keys, until the request is sent.
    keys: Option<Vec<String>>,
    response: Option<reqwest::Response>,
    decoder: FrameDecoder,
    /// Frames decoded and not yet handed on.
    ready: std::collections::VecDeque<Option<Vec<u8>>>,
    ended: bool,
}

impl HttpJobStore {
    /// `step`, if the server answers it within the client's timeout.
    async fn waited<T>(&self, step: impl Future<Output = T>) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, step).await.map_err(|_| {
            StoreError::Backend(format!(
                "the worker API did not answer a batch of contributions within {:?}",
                self.timeout
            ))
        })
    }

    /// The next frame of `batch`: sends its request first, then reads the body until a frame is
    /// complete; `None` once the body has ended with every frame in it.
    async fn next_frame(
        &self,
        batch: &mut BatchRead,
        buffers: &BufferPool,
    ) -> Result<Option<Option<Vec<u8>>>, StoreError> {
        loop {
            if let Some(frame) = batch.ready.pop_front() {
                return Ok(Some(frame));
            }
            if batch.ended {
                return Ok(None);
            }
            let response = match &mut batch.response {
                Some(response) => response,
                None => {
                    let keys = batch.keys.take().unwrap_or_default();
                    let url = self.url(Route::Contributions, "", "");
                    let request = self.batches.post(url).json(&BatchRequest { keys });
                    let response = self.waited(self.dispatch(request)).await??;
                    if response.status() == StatusCode::NOT_FOUND {
                        // The worker API off (its problem names it), or a server without the route.
                        let problem = self.waited(problem_of(response)).await?;
                        return Err(StoreError::Backend(format!(
                            "the worker API answered 404 to a batch of contributions ({}); if the server predates the route, upgrade the server together with its confed-enclave workers",
                            problem.detail
                        )));
                    }
                    let response = self.waited(checked(response)).await??;
                    batch.response.insert(response)
                }
            };
            let chunk = self.waited(response.chunk()).await?.map_err(|e| {
                StoreError::Backend(format!("a batch of contributions broke off: {e}"))
            })?;
            let framing =
                |e: confed_worker_api::batch::FrameError| StoreError::Backend(e.to_string());
            match chunk {
                Some(chunk) => batch
                    .decoder
                    .feed(&chunk, &mut || buffers.take(), &mut |frame| {
                        batch.ready.push_back(frame)
                    })
                    .map_err(framing)?,
                None => {
                    batch.decoder.finish().map_err(framing)?;
                    batch.ended = true;
                }
            }
        }
    }
}

impl JobStore for HttpJobStore {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        let request = LeaseRequest {
            worker: worker.to_string(),
            lease_seconds: lease.as_secs(),
            wait_seconds: self.lease_wait,
        };
        let response = self
            .send(
                self.http
                    .post(self.url(Route::Lease, "", ""))
                    .json(&request),
            )
            .await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let wire: JobWire = response
            .json()
            .await
            .map_err(|e| StoreError::Backend(format!("malformed job: {e}")))?;
        resolve(self, wire).await.map(Some)
    }

    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        let request = RenewRequest {
            worker: worker.to_string(),
            lease_seconds: lease.as_secs(),
        };
        self.send(
            self.http
                .post(self.url(Route::Renew, job_id, ""))
                .json(&request),
        )
        .await
        .map(drop)
    }

    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.bytes(Route::Contribution, blob_key).await
    }

    fn batch_reads(&self) -> usize {
        BATCH_KEYS
    }

    /// One request for the batch, its frames decoded from the body as it arrives, each into a
    /// pooled buffer (`confed_worker_api::batch`).
    fn fetch_batch<'a>(
        &'a self,
        keys: Vec<String>,
        buffers: &'a BufferPool,
    ) -> BoxStream<'a, Result<Option<Vec<u8>>, StoreError>> {
        let batch = BatchRead {
            decoder: FrameDecoder::new(keys.len(), MAX_RESERVE),
            keys: Some(keys),
            response: None,
            ready: std::collections::VecDeque::new(),
            ended: false,
        };
        futures_util::stream::try_unfold(batch, move |mut batch| async move {
            let frame = self.next_frame(&mut batch, buffers).await?;
            Ok(frame.map(|frame| (frame, batch)))
        })
        .boxed()
    }

    /// Streams the body into `buffer`, so a job reuses its buffers instead of a fresh copy of
    /// every contribution.
    async fn fetch_into(
        &self,
        blob_key: &str,
        mut buffer: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let url = self.url(Route::Contribution, blob_key, "");
        let Some(mut response) = self.send_read(self.http.get(url)).await? else {
            return Ok(None);
        };
        buffer.clear();
        // The length is the server's word: reserve for it only up to a size no contribution
        // reaches, and let a longer body grow the buffer as it arrives.
        if let Some(length) = response.content_length() {
            buffer.reserve(usize::try_from(length).unwrap_or(0).min(MAX_RESERVE));
        }
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| StoreError::Backend(e.to_string()))?
        {
            buffer.extend_from_slice(&chunk);
        }
        Ok(Some(buffer))
    }

    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        // BLT: the sealed state first (stored write-once under its BLAKE3), then the release,
        // whose manifest names that digest (`noise.blt.state_out_blake3`): the server links both
        // in the release's commit.
        if let Some(state) = release.blt_state {
            self.send(
                self.http
                    .put(self.url(Route::BltState, job_id, &format!("?worker={worker}")))
                    .header("content-type", "application/octet-stream")
                    .body(state.to_vec()),
            )
            .await?;
        }
        let upload = ReleaseUpload {
            worker: worker.to_string(),
            manifest: release.manifest.clone(),
            average: STANDARD.encode(release.average),
            proof: release.proof.clone(),
        };
        self.send(
            self.http
                .put(self.url(Route::Release, job_id, ""))
                .json(&upload),
        )
        .await
        .map(drop)
    }

    async fn commit_model(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        commit_model_in_order(self, job_id, worker, model, optimizer_state).await
    }

    async fn fetch_sealed(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.bytes(Route::Blob, key).await
    }

    async fn put_partition(
        &self,
        job_id: &str,
        worker: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        self.send(
            self.http
                .put(self.url(Route::Partition, job_id, &format!("?worker={worker}")))
                .header("content-type", "application/octet-stream")
                .body(sealed.to_vec()),
        )
        .await
        .map(drop)
    }

    async fn fail(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        let request = FailRequest {
            worker: worker.to_string(),
            reason: reason.to_string(),
            permanent,
        };
        self.send(
            self.http
                .post(self.url(Route::Fail, job_id, ""))
                .json(&request),
        )
        .await
        .map(drop)
    }
}

impl ModelCommitSteps for HttpJobStore {
    async fn stage_optimizer_state(
        &self,
        job_id: &str,
        worker: &str,
        state: &[u8],
        _model: &[u8],
    ) -> Result<String, StoreError> {
        let query = format!("?worker={worker}");
        self.send(
            self.http
                .put(self.url(Route::OptimizerState, job_id, &query))
                .header("content-type", "application/octet-stream")
                .body(state.to_vec()),
        )
        .await?;
        Ok(crate::policy::sha256_hex(state))
    }

    async fn put_model_linked(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state_sha256: Option<&str>,
    ) -> Result<(), StoreError> {
        // Worker ids are `A-Z a-z 0-9 . _ -` and the digest is hex (checked by the server): no
        // escaping needed.
        let link = optimizer_state_sha256
            .map(|sha| format!("&optimizer_state_sha256={sha}"))
            .unwrap_or_default();
        self.send(
            self.http
                .put(self.url(Route::Model, job_id, &format!("?worker={worker}{link}")))
                .header("content-type", "application/octet-stream")
                .body(model.to_vec()),
        )
        .await
        .map(drop)
    }
}

#[cfg(test)]
#[path = "remote_tests.rs"]
mod tests;
