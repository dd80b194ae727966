//! The worker API's wire types (`/internal/v1/...`, docs/protocol.md, "Worker API"): what a
//! `confed-enclave` process and the untrusted server say to each other, defined once for both
//! sides. The enclave's HTTP client is `confed_enclave::remote`; the server's handlers are
//! `confed::api::workers`.

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use confed_attestation::release::ReleaseProof;
use confed_protocol::hpke::PublicKey;
use serde::{Deserialize, Serialize};
use std::future::Future;

use crate::manifest::Manifest;
use crate::optimizer::ServerOptimizer;
use crate::store::{JobContribution, JobSpec, JobStore, Partitioning, StoreError};

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
    /// `worker~token`: this lease's holder, which every later call under the lease names as
    /// its `worker` (a fencing token: a takeover writes a new one).
    pub lease_holder: String,
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
    /// BLT noise only: blob key of the sealed state round `round - 1` left (absent in round 1
    /// and for other mechanisms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blt_state_key: Option<String>,
    /// A partitioned round's step (absent: the whole round in one job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partitioning: Option<PartitioningWire>,
}

/// `JobWire::partitioning`: one partition to sum and seal, or the root with the blob keys of
/// every partition's sealed result (`GET /internal/v1/blobs/{key}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum PartitioningWire {
    Partition {
        index: u32,
        count: u32,
    },
    Root {
        count: u32,
        sealed_keys: Vec<String>,
    },
}

/// A job's bytes, fetched by the keys its description names.
#[derive(Debug, Default)]
pub struct Fetched {
    pub model: Vec<u8>,
    pub committed_average: Option<Vec<u8>>,
    pub optimizer_state: Option<Vec<u8>>,
    pub blt_state: Option<Vec<u8>>,
}

fn is_fedavg(optimizer: &ServerOptimizer) -> bool {
    *optimizer == ServerOptimizer::FedAvg
}

impl JobWire {
    /// The job with its bytes, as the worker runs it.
    pub fn into_spec(self, fetched: Fetched) -> Result<JobSpec, String> {
        let Fetched {
            model,
            committed_average,
            optimizer_state,
            blt_state,
        } = fetched;
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
            lease_holder: self.lease_holder,
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
            blt_state,
            partitioning: self.partitioning.map(|p| match p {
                PartitioningWire::Partition { index, count } => {
                    Partitioning::Partition { index, count }
                }
                PartitioningWire::Root { count, sealed_keys } => {
                    Partitioning::Root { count, sealed_keys }
                }
            }),
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
                let blake3 = confed_protocol::hex::parse_digest(&hex).ok_or_else(|| {
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
pub async fn resolve<S: BlobSource>(store: &S, wire: JobWire) -> Result<JobSpec, StoreError> {
    let model = store.required_blob(&wire.model_key).await?;
    let average = match &wire.committed_average_key {
        Some(key) => Some(store.required_blob(key).await?),
        None => None,
    };
    let optimizer_state = match &wire.optimizer_state_key {
        Some(key) => Some(store.required_blob(key).await?),
        None => None,
    };
    // A retried job whose release is committed only applies it: it needs no state.
    let blt_state = match (&wire.blt_state_key, &wire.committed_average_key) {
        (Some(key), None) => Some(store.required_blob(key).await?),
        _ => None,
    };
    let (job_id, holder) = (wire.job_id.clone(), wire.lease_holder.clone());
    let fetched = Fetched {
        model,
        committed_average: average,
        optimizer_state,
        blt_state,
    };
    match wire.into_spec(fetched) {
        Ok(spec) => Ok(spec),
        Err(reason) => {
            store.fail(&job_id, &holder, &reason, true).await?;
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

/// Problem type of a 404 for an object the store does not have: the only 404 a worker may read
/// as "missing" (a server whose worker API is off answers `API_OFF`).
pub const NOT_FOUND: &str = "urn:confed:problem:not-found";

/// Problem type every worker route answers (404) when the server runs without the worker API.
pub const API_OFF: &str = "urn:confed:problem:api-off";

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
            "job_id": "j", "task_id": "t", "round": 1, "attempt": 1, "lease_holder": "w~1", "key_id": "k",
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
        let error = wire.into_spec(Fetched::default()).unwrap_err();
        assert!(error.contains("`momentum` must be in [0, 1)"), "{error}");
    }
}
