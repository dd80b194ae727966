//! The job store over HTTP: how a `confed-enclave` process (in Confidential Space) reaches the
//! untrusted server's worker API (`/internal/v1/...`, docs/protocol.md). The wire types are
//! defined here, once, for both sides.
//!
//! Everything the server answers is untrusted input to the enclave, exactly as in-process: the
//! worker authenticates contributions by HPKE and the key by the key services' shares.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::time::Duration;
use zeroize::Zeroizing;

use crate::aggregate::Manifest;
use crate::hpke::PublicKey;
use crate::optimizer::ServerOptimizer;
use crate::worker::{JobContribution, JobSpec, JobStore, StagedRelease, StoreError};
use confed_attestation::release::ReleaseProof;

/// `POST /internal/v1/jobs/lease`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    pub worker: String,
    pub lease_seconds: u64,
    /// With nothing to lease, how long the server may hold the request open for a job to appear
    /// (0, the default: answer at once; at most `MAX_LEASE_WAIT_SECONDS`).
    #[serde(default)]
    pub wait_seconds: u64,
}

/// Longest `wait_seconds` the server accepts: below the usual 30 s idle timeout of proxies and
/// load balancers.
pub const MAX_LEASE_WAIT_SECONDS: u64 = 25;

/// A leased job, as the server describes it; bytes are fetched separately by key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobWire {
    pub job_id: String,
    pub task_id: String,
    pub round: u64,
    pub attempt: u64,
    pub key_id: String,
    /// X25519 public key, base64url.
    pub public_key: String,
    /// The task policy text (`policy.rs`): the job's only source of privacy parameters.
    pub policy: String,
    /// Blob key of model version `round - 1` (`GET /internal/v1/blobs/{key}`).
    pub model_key: String,
    /// `[assignment ref, contribution key, BLAKE3 hex]` (`GET /internal/v1/contributions/{key}`),
    /// the digest omitted where the server never saw the bytes.
    pub contributions: Vec<ContributionWire>,
    /// Blob key of the committed release's average, when the round is already APPLYING.
    pub committed_average_key: Option<String>,
    /// The task's server optimizer (absent: FedAvg).
    #[serde(default, skip_serializing_if = "is_fedavg")]
    pub optimizer: ServerOptimizer,
    /// Blob key of the optimizer's state after round `round - 1` (absent before its first round).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_state_key: Option<String>,
    /// Adaptive clipping only: this round's clip norm.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_norm: Option<f64>,
    /// The partner asked to evaluate this round on demand (absent: no).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub on_demand_evaluation: bool,
}

fn is_fedavg(optimizer: &ServerOptimizer) -> bool {
    *optimizer == ServerOptimizer::FedAvg
}

impl JobWire {
    /// The job with its bytes, as the worker runs it.
    pub fn into_spec(
        self,
        model: Vec<u8>,
        committed_average: Option<Vec<u8>>,
        optimizer_state: Option<Vec<u8>>,
    ) -> Result<JobSpec, String> {
        let public_key = URL_SAFE_NO_PAD
            .decode(&self.public_key)
            .ok()
            .and_then(|b| PublicKey::from_bytes(&b).ok())
            .ok_or_else(|| format!("key {} has a malformed public key", self.key_id))?;
        self.optimizer
            .validate()
            .map_err(|why| format!("the job's server optimizer is invalid: {why}"))?;
        Ok(JobSpec {
            job_id: self.job_id,
            task_id: self.task_id,
            round: self.round,
            attempt: self.attempt,
            key_id: self.key_id,
            public_key,
            policy: self.policy,
            model,
            optimizer: self.optimizer,
            optimizer_state,
            clip_norm: self.clip_norm,
            on_demand_evaluation: self.on_demand_evaluation,
            contributions: self
                .contributions
                .into_iter()
                .map(ContributionWire::into_listed)
                .collect::<Result<_, _>>()?,
            committed_average,
        })
    }
}

/// A contribution of a job on the wire: a JSON array of its ref, its key and (for an upload
/// through the server) the lowercase hex BLAKE3 of its bytes. A worker takes both forms, so it
/// can be upgraded before the server that starts listing digests.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ContributionWire {
    Digested(String, String, String),
    Undigested(String, String),
}

impl ContributionWire {
    /// The contribution as the worker takes it; `Err` for a digest that is not 64 lowercase hex
    /// digits.
    pub fn into_listed(self) -> Result<JobContribution, String> {
        Ok(match self {
            Self::Undigested(assignment_ref, blob_key) => JobContribution {
                assignment_ref,
                blob_key,
                blake3: None,
            },
            Self::Digested(assignment_ref, blob_key, hex) => {
                let blake3 = crate::aggregate::inputs::parse_digest(&hex).ok_or_else(|| {
                    format!("contribution {assignment_ref} has a malformed digest {hex:?}; expected 64 lowercase hex digits")
                })?;
                JobContribution {
                    assignment_ref,
                    blob_key,
                    blake3: Some(blake3),
                }
            }
        })
    }
}

/// A job store that can also hand out models and committed averages by blob key.
pub trait BlobSource: JobStore {
    fn required_blob(&self, key: &str) -> impl Future<Output = Result<Vec<u8>, StoreError>> + Send;
}

/// A leased job's description made runnable: its model (and committed average, if any) fetched.
/// A job that cannot run at all (a malformed public key) is failed permanently.
pub async fn resolve<S: BlobSource>(
    store: &S,
    worker: &str,
    wire: JobWire,
) -> Result<JobSpec, StoreError> {
    let model = store.required_blob(&wire.model_key).await?;
    let average = match &wire.committed_average_key {
        Some(key) => Some(store.required_blob(key).await?),
        None => None,
    };
    let optimizer_state = match &wire.optimizer_state_key {
        Some(key) => Some(store.required_blob(key).await?),
        None => None,
    };
    let job_id = wire.job_id.clone();
    match wire.into_spec(model, average, optimizer_state) {
        Ok(spec) => Ok(spec),
        Err(reason) => {
            store.fail(&job_id, worker, &reason, true).await?;
            Err(StoreError::Backend(reason))
        }
    }
}

/// `POST /internal/v1/jobs/{id}/renew` and the `worker` of `PUT .../model?worker=`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerId {
    pub worker: String,
}

/// The query of `PUT /internal/v1/jobs/{id}/model`: the worker, and the digest of the optimizer
/// state it stored first with `PUT .../optimizer-state` (absent for FedAvg).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCommitQuery {
    pub worker: String,
    #[serde(default)]
    pub optimizer_state_sha256: Option<String>,
}

/// `POST /internal/v1/jobs/{id}/renew`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub worker: String,
    pub lease_seconds: u64,
}

/// `POST /internal/v1/jobs/{id}/fail`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FailRequest {
    pub worker: String,
    pub reason: String,
    pub permanent: bool,
}

/// `PUT /internal/v1/jobs/{id}/release`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseUpload {
    pub worker: String,
    pub manifest: Manifest,
    /// The noised average (safetensors), standard base64.
    pub average: String,
    /// The enclave's signature over the release and the key services' receipts.
    pub proof: ReleaseProof,
}

impl ReleaseUpload {
    pub fn average_bytes(&self) -> Result<Vec<u8>, String> {
        STANDARD
            .decode(&self.average)
            .map_err(|e| format!("`average` is not base64: {e}"))
    }
}

/// Problem type the server answers when the caller's lease is gone.
pub const LEASE_LOST: &str = "urn:confed:problem:lease-lost";

/// The worker API client.
pub struct HttpJobStore {
    base: String,
    token: Zeroizing<String>,
    http: reqwest::Client,
    lease_wait: u64,
}

impl HttpJobStore {
    /// `base`: the server's URL; `token`: the worker token (from a file or the environment).
    pub fn new(base: &str, token: Zeroizing<String>, timeout: Duration) -> Self {
        Self {
            base: base.trim_end_matches('/').to_string(),
            token,
            http: crate::http::client(timeout),
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

    fn url(&self, path: &str) -> String {
        format!("{}/internal/v1/{path}", self.base)
    }

    async fn send(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, StoreError> {
        let response = request
            .bearer_auth(self.token.as_str())
            .send()
            .await
            .map_err(|e| StoreError::Backend(format!("worker API unreachable: {e}")))?;
        if response.status().is_success() || response.status() == StatusCode::NOT_FOUND {
            return Ok(response);
        }
        let status = response.status();
        let body: serde_json::Value = response.json().await.unwrap_or_default();
        let detail = body["detail"].as_str().unwrap_or("no detail").to_string();
        Err(match (status, body["type"].as_str()) {
            (StatusCode::CONFLICT, Some(LEASE_LOST)) => StoreError::LeaseLost,
            (StatusCode::CONFLICT, _) => StoreError::Conflict(detail),
            (StatusCode::UNPROCESSABLE_ENTITY, _) => StoreError::Refused(detail),
            _ => StoreError::Backend(format!("worker API answered {status}: {detail}")),
        })
    }

    async fn bytes(&self, path: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let response = self.send(self.http.get(self.url(path))).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        response
            .bytes()
            .await
            .map(|b| Some(b.to_vec()))
            .map_err(|e| StoreError::Backend(e.to_string()))
    }
}

impl BlobSource for HttpJobStore {
    async fn required_blob(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        let path = format!("blobs/{key}");
        self.bytes(&path)
            .await?
            .ok_or_else(|| StoreError::Backend(format!("{path} is missing on the server")))
    }
}

/// Most bytes a contribution read reserves up front on the server's `Content-Length`.
const MAX_RESERVE: usize = 64 << 20;

impl JobStore for HttpJobStore {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        let request = LeaseRequest {
            worker: worker.to_string(),
            lease_seconds: lease.as_secs(),
            wait_seconds: self.lease_wait,
        };
        let response = self
            .send(self.http.post(self.url("jobs/lease")).json(&request))
            .await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        let wire: JobWire = response
            .json()
            .await
            .map_err(|e| StoreError::Backend(format!("malformed job: {e}")))?;
        resolve(self, worker, wire).await.map(Some)
    }

    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        let request = RenewRequest {
            worker: worker.to_string(),
            lease_seconds: lease.as_secs(),
        };
        self.send(
            self.http
                .post(self.url(&format!("jobs/{job_id}/renew")))
                .json(&request),
        )
        .await
        .map(drop)
    }

    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.bytes(&format!("contributions/{blob_key}")).await
    }

    /// Streams the body into `buffer`, so a job reuses its buffers instead of a fresh copy of
    /// every contribution.
    async fn fetch_into(
        &self,
        blob_key: &str,
        mut buffer: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let path = format!("contributions/{blob_key}");
        let mut response = self.send(self.http.get(self.url(&path))).await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok(None);
        }
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
        let upload = ReleaseUpload {
            worker: worker.to_string(),
            manifest: release.manifest.clone(),
            average: STANDARD.encode(release.average),
            proof: release.proof.clone(),
        };
        self.send(
            self.http
                .put(self.url(&format!("jobs/{job_id}/release")))
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
        // The optimizer's state first (stored write-once under its digest), then the model,
        // which names that digest: the server links both in the model's commit.
        let mut link = String::new();
        if let Some(state) = optimizer_state {
            self.send(
                self.http
                    .put(self.url(&format!("jobs/{job_id}/optimizer-state?worker={worker}")))
                    .header("content-type", "application/octet-stream")
                    .body(state.to_vec()),
            )
            .await?;
            link = format!(
                "&optimizer_state_sha256={}",
                crate::policy::sha256_hex(state)
            );
        }
        self.send(
            self.http
                // Worker ids are `A-Z a-z 0-9 . _ -` (checked by the server): no escaping needed.
                .put(self.url(&format!("jobs/{job_id}/model?worker={worker}{link}")))
                .header("content-type", "application/octet-stream")
                .body(model.to_vec()),
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
                .post(self.url(&format!("jobs/{job_id}/fail")))
                .json(&request),
        )
        .await
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contributions_arrive_with_or_without_a_digest_and_a_malformed_one_is_refused() {
        let digest = "ab".repeat(32);
        let listed: Vec<ContributionWire> =
            serde_json::from_str(&format!(r#"[["r1", "k1", "{digest}"], ["r2", "k2"]]"#)).unwrap();
        let listed: Vec<JobContribution> = listed
            .into_iter()
            .map(|c| c.into_listed().unwrap())
            .collect();
        assert_eq!(listed[0].blake3, Some([0xab; 32]));
        assert_eq!(
            (
                listed[1].assignment_ref.as_str(),
                listed[1].blob_key.as_str()
            ),
            ("r2", "k2")
        );
        assert_eq!(listed[1].blake3, None);
        for bad in ["AB".repeat(32), "ab".repeat(31), "zz".repeat(32)] {
            let error = ContributionWire::Digested("r".into(), "k".into(), bad.clone())
                .into_listed()
                .unwrap_err();
            assert!(error.contains("malformed digest"), "{bad}: {error}");
        }
        assert!(serde_json::from_str::<ContributionWire>(r#"["r1"]"#).is_err());
        assert!(serde_json::from_str::<ContributionWire>(r#"["r", "k", "d", "x"]"#).is_err());
    }

    #[test]
    fn a_job_without_an_optimizer_is_fedavg_and_an_invalid_one_is_refused() {
        let public_key = URL_SAFE_NO_PAD.encode([9u8; 32]);
        let job = serde_json::json!({
            "job_id": "j", "task_id": "t", "round": 1, "attempt": 1, "key_id": "k",
            "public_key": public_key, "policy": "p", "model_key": "m", "contributions": [],
            "committed_average_key": null,
        });
        let wire: JobWire = serde_json::from_value(job.clone()).unwrap();
        assert_eq!(
            wire.optimizer,
            ServerOptimizer::FedAvg,
            "older servers list none"
        );
        let mut bad = job;
        bad["optimizer"] = serde_json::json!({"name": "fedavgm", "momentum": 5.0});
        let wire: JobWire = serde_json::from_value(bad).unwrap();
        let error = wire.into_spec(Vec::new(), None, None).unwrap_err();
        assert!(error.contains("`momentum` must be in [0, 1)"), "{error}");
    }
}
