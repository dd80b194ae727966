//! The enclave worker: leases aggregation jobs, obtains the round's key by attestation, aggregates
//! with DP, releases exactly once, and applies the update.
//!
//! It reaches the task database and blob store only through `JobStore`, which the untrusted side
//! implements: everything the store returns is treated as untrusted input (contributions are
//! authenticated by HPKE, the key by the key services' shares matching the public key; the privacy
//! parameters come from the task policy text, which is checked against the enclave's own limits
//! and whose hash every contribution is bound to, so a policy changed in the database opens
//! nothing).
//!
//! Exactly once: a round's release is committed with the round's move to APPLYING. Until then
//! nothing depends on it, and a retried job (after a crash or a lost lease) derives the same noise
//! from the same key and inputs (see `aggregate::noise`), so it stages byte-identical output; the
//! store refuses to commit a second, different release. Once APPLYING, a retried job reuses the
//! committed release and only redoes the deterministic model update.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use confed_attestation::Attester;
use confed_attestation::exchange::encode_verifying_key;
use confed_attestation::release::{
    ReleaseCommitment, ReleaseProof, ReleaseSignature, release_text, sign_text,
};
use thiserror::Error;

use crate::aggregate::inputs::{self, Input};
use crate::aggregate::{AggregateError, Aggregator, Binding, Manifest, PrivacyParams, Release};
use crate::envelope::RoundContext;
use crate::hpke::PublicKey;
use crate::key_collection::{CollectError, KeyRequest, KeyServiceEndpoint, obtain_private_key};
use crate::model::{ModelError, ModelSchema, validate_model};
use crate::policy::{PolicyError, TaskPolicy, sha256_hex};
use crate::updater::{self, UpdateError};

pub use crate::policy::{MAX_TASK_DELTA, MAX_TASK_EPSILON};

/// One leased aggregation job, as the untrusted store describes it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The round's id.
    pub job_id: String,
    pub task_id: String,
    pub round: u64,
    /// The store's attempt counter: for logs only, nothing the enclave computes depends on it.
    pub attempt: u64,
    pub key_id: String,
    pub public_key: PublicKey,
    /// The task policy text (`policy.rs`): the only source of the privacy parameters.
    pub policy: String,
    /// Model version `round - 1`.
    pub model: Vec<u8>,
    /// (assignment ref, blob key) of every completed contribution.
    pub contributions: Vec<(String, String)>,
    /// The committed release, when the round is already APPLYING.
    pub committed_average: Option<Vec<u8>>,
}

/// What a worker hands the store to commit.
pub struct StagedRelease<'a> {
    pub average: &'a [u8],
    pub manifest: &'a Manifest,
    /// The enclave's signature and the key services' receipts.
    pub proof: &'a ReleaseProof,
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("the job's lease was lost to another worker")]
    LeaseLost,
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("release refused: {0}")]
    Refused(String),
    #[error("store: {0}")]
    Backend(String),
}

/// The task database and blob store, as the enclave sees them.
pub trait JobStore: Send + Sync {
    fn lease(
        &self,
        worker: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<JobSpec>, StoreError>> + Send;
    fn renew(
        &self,
        job_id: &str,
        worker: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// A contribution's stored bytes (`None` if missing).
    fn fetch(
        &self,
        blob_key: &str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;
    /// Commits the round's release (AGGREGATING -> APPLYING), once.
    fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Stores model version `round` and completes the round (APPLYING -> COMPLETED), opening the
    /// next round or completing the task.
    fn commit_model(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Gives the job back: retried later, or (`permanent`) the round and task fail.
    fn fail(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

#[derive(Debug, Error)]
pub enum JobError {
    #[error("privacy parameters outside the enclave's limits: {0}")]
    Privacy(String),
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("the job is malformed: {0}")]
    MalformedJob(String),
    #[error("cannot obtain the round key: {0}")]
    Key(#[from] CollectError),
    #[error("the base model is invalid: {0}")]
    Model(#[from] ModelError),
    #[error(transparent)]
    Aggregate(#[from] AggregateError),
    #[error(transparent)]
    Update(#[from] UpdateError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("an aggregation thread failed")]
    Thread(#[source] tokio::task::JoinError),
    #[error("the aggregator is still shared after its last batch (a bug)")]
    StillShared,
}

impl JobError {
    /// Errors a retry cannot fix: the round fails instead of looping.
    pub fn is_permanent(&self) -> bool {
        if let Self::Key(collect) = self
            && collect.refused_by_ledgers()
        {
            return true;
        }
        matches!(
            self,
            Self::Privacy(_)
                | Self::Policy(_)
                | Self::MalformedJob(_)
                | Self::Model(_)
                | Self::Update(_)
                | Self::Aggregate(AggregateError::NothingIncluded(_))
                | Self::Aggregate(AggregateError::TooFewIncluded { .. })
        )
    }
}

pub struct WorkerConfig {
    pub id: String,
    pub lease: Duration,
    pub key_services: Vec<KeyServiceEndpoint>,
    pub threshold: u16,
    pub attester: Arc<dyn Attester>,
    pub key_timeout: Duration,
    /// Contributions fetched and opened per batch (across all cores), at most ...
    pub batch: usize,
    /// ... and bytes of ciphertext per batch, at most (a batch ends at whichever comes first).
    pub batch_bytes: usize,
}

/// What one job came to.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    pub task_id: String,
    pub round: u64,
    pub included: u64,
    pub excluded: u64,
    pub epsilon_spent: Option<f64>,
}

/// Bytes of contributions a job keeps in memory from their first read (to digest them before
/// the key is asked for) instead of reading them again after.
pub const RETAIN_BYTES: usize = 256 << 20;

pub struct Worker<S> {
    store: Arc<S>,
    config: WorkerConfig,
    http: reqwest::Client,
    retain_bytes: usize,
}

impl<S: JobStore + 'static> Worker<S> {
    pub fn new(store: Arc<S>, config: WorkerConfig) -> Self {
        let http = crate::http::client(config.key_timeout);
        Self {
            store,
            config,
            http,
            retain_bytes: RETAIN_BYTES,
        }
    }

    /// Keeps at most `bytes` of contributions from the first read (tests use 0: every
    /// contribution is read twice).
    pub fn retain_bytes(mut self, bytes: usize) -> Self {
        self.retain_bytes = bytes;
        self
    }

    /// Leases and runs one job; `None` when no job is ready.
    pub async fn run_once(&self) -> Result<Option<JobOutcome>, JobError> {
        let Some(job) = self.store.lease(&self.config.id, self.config.lease).await? else {
            return Ok(None);
        };
        match self.run_job(&job).await {
            Ok(outcome) => Ok(Some(outcome)),
            Err(JobError::Store(StoreError::LeaseLost)) => Err(StoreError::LeaseLost.into()),
            Err(error) => {
                let error_text = confed_protocol::errors::with_causes(&error);
                tracing::warn!(task = %job.task_id, round = job.round, error = %error_text, "aggregation job failed");
                self.store
                    .fail(
                        &job.job_id,
                        &self.config.id,
                        &error_text,
                        error.is_permanent(),
                    )
                    .await?;
                Err(error)
            }
        }
    }

    async fn run_job(&self, job: &JobSpec) -> Result<JobOutcome, JobError> {
        let (policy, context) = round_context(job)?;
        let schema = validate_model(&job.model)?;
        let (average, manifest) = match &job.committed_average {
            Some(average) => (average.clone(), None),
            None => {
                let (release, proof) = self.aggregate(job, &schema, &policy, context).await?;
                self.store
                    .commit_release(
                        &job.job_id,
                        &self.config.id,
                        StagedRelease {
                            average: &release.average,
                            manifest: &release.manifest,
                            proof: &proof,
                        },
                    )
                    .await?;
                (release.average, Some(release.manifest))
            }
        };
        let values = updater::average_values(&schema, &average)?;
        let model = updater::apply(&job.model, &schema, &values, policy.server_learning_rate)?;
        self.store
            .commit_model(&job.job_id, &self.config.id, &model)
            .await?;
        Ok(JobOutcome {
            task_id: job.task_id.clone(),
            round: job.round,
            included: manifest.as_ref().map_or(0, |m| m.included),
            excluded: manifest.as_ref().map_or(0, |m| m.excluded.values().sum()),
            epsilon_spent: manifest.map(|m| m.privacy.epsilon_spent),
        })
    }

    /// Inputs first (read and digested: `aggregate::inputs`), then the key (against the release
    /// commitment, which every key service records in its ledger and answers with a receipt),
    /// then the contributions in batches (opened across all cores), then noise; the release is
    /// signed with a key made for this job and bound into its attestation.
    /// `schema`: the job's model's, validated once by the caller; `policy` and `context` from
    /// `round_context`.
    pub async fn aggregate(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
    ) -> Result<(Release, ReleaseProof), JobError> {
        let (mut inputs, inputs_digest) = self.gather(job).await?;
        let commitment = ReleaseCommitment {
            task_id: context.task_id.clone(),
            round: context.round,
            key_id: job.key_id.clone(),
            policy_sha256: context.policy_sha256.clone(),
            model_sha256: context.model_sha256.clone(),
            inputs_digest: inputs_digest.clone(),
        };
        let signing_key = confed_attestation::exchange::generate_signing_key();
        let key = obtain_private_key(
            &self.http,
            &self.config.key_services,
            &KeyRequest {
                key_id: job.key_id.clone(),
                public_key: job.public_key,
                threshold: self.config.threshold,
                task_id: job.task_id.clone(),
                round: job.round,
                commitment: commitment.clone(),
                policy: job.policy.clone(),
            },
            self.config.attester.as_ref(),
            &signing_key,
            self.config.key_timeout,
        )
        .await?;
        let receipts = key.receipts;
        let private_key = Arc::new(key.private_key);
        let schema = schema.clone();
        let binding = Binding {
            context,
            key_id: job.key_id.clone(),
            inputs_digest,
        };
        let privacy = PrivacyParams::from(policy);
        let aggregator = Arc::new(Aggregator::new(
            binding,
            privacy.clip_norm,
            schema,
            &private_key,
        )?);
        // One batch is opened (on all cores) while the next is read: at most two batches of
        // ciphertext beyond what the first read retained, whatever the round's size.
        let mut pending = inputs.iter_mut();
        let mut opening: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            for input in pending.by_ref() {
                let stored = self.read_again(input).await?;
                bytes += stored.as_ref().map_or(0, Vec::len);
                batch.push((input.assignment_ref.clone(), stored));
                if batch.len() >= self.config.batch.max(1) || bytes >= self.config.batch_bytes {
                    break;
                }
            }
            if let Some(previous) = opening.take() {
                previous.await.map_err(JobError::Thread)?;
                self.store
                    .renew(&job.job_id, &self.config.id, self.config.lease)
                    .await?;
            }
            if batch.is_empty() {
                break;
            }
            let shared = Arc::clone(&aggregator);
            opening = Some(tokio::task::spawn_blocking(move || {
                shared.add_batch(&batch)
            }));
        }
        let aggregator = Arc::try_unwrap(aggregator).map_err(|_| JobError::StillShared)?;
        let release = tokio::task::spawn_blocking(move || aggregator.finish(&private_key, privacy))
            .await
            .map_err(JobError::Thread)??;
        let text = release_text(
            &commitment,
            &sha256_hex(&release.manifest.to_json()),
            &release.manifest.average_sha256,
        );
        let proof = ReleaseProof {
            enclave: ReleaseSignature {
                enclave_signing_key: encode_verifying_key(signing_key.verifying_key()),
                signature: sign_text(&signing_key, &text),
            },
            commitment,
            receipts,
        };
        Ok((release, proof))
    }

    /// The first read of every contribution: digested in batches on all cores, kept in memory
    /// up to `retain_bytes` in all (the rest is read again after the key arrives).
    async fn gather(&self, job: &JobSpec) -> Result<(Vec<Input>, String), JobError> {
        let mut inputs = Vec::with_capacity(job.contributions.len());
        let mut retained = 0usize;
        let mut refs = job.contributions.iter().peekable();
        while refs.peek().is_some() {
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            for (assignment_ref, blob_key) in refs.by_ref() {
                let stored = self.store.fetch(blob_key).await?;
                bytes += stored.as_ref().map_or(0, Vec::len);
                batch.push((assignment_ref, blob_key, stored));
                if batch.len() >= self.config.batch.max(1) || bytes >= self.config.batch_bytes {
                    break;
                }
            }
            let stored: Vec<Option<Vec<u8>>> = batch.iter_mut().map(|(_, _, s)| s.take()).collect();
            let (stored, digests) = tokio::task::spawn_blocking(move || {
                let digests = inputs::digest_all(&stored);
                (stored, digests)
            })
            .await
            .map_err(JobError::Thread)?;
            for (((assignment_ref, blob_key, _), bytes), digest) in
                batch.into_iter().zip(stored).zip(digests)
            {
                let keep = bytes
                    .filter(|b| retained + b.len() <= self.retain_bytes)
                    .inspect(|b| retained += b.len());
                inputs.push(Input {
                    assignment_ref: assignment_ref.clone(),
                    blob_key: blob_key.clone(),
                    digest,
                    retained: keep,
                });
            }
            self.store
                .renew(&job.job_id, &self.config.id, self.config.lease)
                .await?;
        }
        let digest = inputs::sort_and_digest(&mut inputs).map_err(JobError::MalformedJob)?;
        Ok((inputs, digest))
    }

    /// A contribution's bytes for the second pass: those kept from the first read, or read
    /// again and required to be the bytes digested then (the store is not trusted to serve
    /// the same bytes twice).
    async fn read_again(&self, input: &mut Input) -> Result<Option<Vec<u8>>, JobError> {
        if let Some(bytes) = input.retained.take() {
            return Ok(Some(bytes));
        }
        let Some(expected) = input.digest else {
            return Ok(None);
        };
        let stored = self.store.fetch(&input.blob_key).await?;
        match stored {
            Some(bytes) if *blake3::hash(&bytes).as_bytes() == expected => Ok(Some(bytes)),
            _ => Err(JobError::Store(StoreError::Conflict(format!(
                "contribution {} changed between two reads",
                input.assignment_ref
            )))),
        }
    }
}

/// The job's policy, checked, and the round context every contribution must be bound to: the
/// policy's hash and the hash of the model bytes this enclave was actually given.
pub fn round_context(job: &JobSpec) -> Result<(TaskPolicy, RoundContext), JobError> {
    let policy = TaskPolicy::parse(&job.policy)?;
    policy.check_enclave_limits()?;
    if policy.task_id != job.task_id {
        return Err(JobError::Privacy(format!(
            "the policy is task {}'s, the job task {}'s",
            policy.task_id, job.task_id
        )));
    }
    if job.round == 0 || job.round > u64::from(policy.rounds) {
        return Err(JobError::Privacy(format!(
            "round {} is outside the task's {} planned rounds, whose budget covers one release each",
            job.round, policy.rounds
        )));
    }
    let context = RoundContext {
        task_id: job.task_id.clone(),
        round: job.round,
        policy_sha256: policy.sha256_hex(),
        model_sha256: sha256_hex(&job.model),
    };
    Ok((policy, context))
}
