//! The enclave worker: leases aggregation jobs, obtains the round's key by attestation, aggregates
//! with DP, releases exactly once, and applies the update.
//!
//! It reaches the task database and blob store only through `JobStore`, which the untrusted side
//! implements: everything the store returns is treated as untrusted input (contributions are
//! authenticated by HPKE, the key by the key services' shares matching the public key; privacy
//! parameters are checked against the enclave's own limits before any release).
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
use thiserror::Error;

use crate::aggregate::{AggregateError, Aggregator, Binding, Manifest, PrivacyParams, Release};
use crate::hpke::PublicKey;
use crate::key_collection::{CollectError, KeyRequest, KeyServiceEndpoint, obtain_private_key};
use crate::model::{ModelError, ModelSchema, validate_model};
use crate::updater::{self, UpdateError};

/// Largest total epsilon and delta the enclave releases under, whatever the database says: part
/// of the attested image, so a compromised front end cannot loosen a task's privacy.
pub const MAX_TASK_EPSILON: f64 = 100.0;
pub const MAX_TASK_DELTA: f64 = 1e-2;

/// One leased aggregation job, as the untrusted store describes it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The round's id.
    pub job_id: String,
    pub task_id: String,
    pub round: u64,
    pub attempt: u64,
    pub key_id: String,
    pub public_key: PublicKey,
    pub privacy: PrivacyParams,
    pub server_learning_rate: f64,
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
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("the job's lease was lost to another worker")]
    LeaseLost,
    #[error("conflict: {0}")]
    Conflict(String),
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
    #[error("aggregation thread failed: {0}")]
    Thread(String),
}

impl JobError {
    /// Errors a retry cannot fix: the round fails instead of looping.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::Privacy(_)
                | Self::Model(_)
                | Self::Update(_)
                | Self::Aggregate(AggregateError::NothingIncluded(_))
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

pub struct Worker<S> {
    store: Arc<S>,
    config: WorkerConfig,
    http: reqwest::Client,
}

impl<S: JobStore + 'static> Worker<S> {
    pub fn new(store: Arc<S>, config: WorkerConfig) -> Self {
        let http = crate::http::client(config.key_timeout);
        Self {
            store,
            config,
            http,
        }
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
                tracing::warn!(task = %job.task_id, round = job.round, %error, "aggregation job failed");
                self.store
                    .fail(
                        &job.job_id,
                        &self.config.id,
                        &error.to_string(),
                        error.is_permanent(),
                    )
                    .await?;
                Err(error)
            }
        }
    }

    async fn run_job(&self, job: &JobSpec) -> Result<JobOutcome, JobError> {
        check_privacy(&job.privacy)?;
        if job.round == 0 || job.round > u64::from(job.privacy.rounds) {
            return Err(JobError::Privacy(format!(
                "round {} is outside the task's {} planned rounds, whose budget covers one release each",
                job.round, job.privacy.rounds
            )));
        }
        let schema = validate_model(&job.model)?;
        let (average, manifest) = match &job.committed_average {
            Some(average) => (average.clone(), None),
            None => {
                let release = self.aggregate(job, &schema).await?;
                self.store
                    .commit_release(
                        &job.job_id,
                        &self.config.id,
                        StagedRelease {
                            average: &release.average,
                            manifest: &release.manifest,
                        },
                    )
                    .await?;
                (release.average, Some(release.manifest))
            }
        };
        let values = updater::average_values(&schema, &average)?;
        let model = updater::apply(&job.model, &schema, &values, job.server_learning_rate)?;
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

    /// Key, then contributions in batches (fetched, then opened across all cores), then noise.
    /// `schema`: the job's model's, validated once by the caller.
    pub async fn aggregate(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
    ) -> Result<Release, JobError> {
        let key = obtain_private_key(
            &self.http,
            &self.config.key_services,
            &KeyRequest {
                key_id: job.key_id.clone(),
                public_key: job.public_key,
                threshold: self.config.threshold,
                task_id: job.task_id.clone(),
                round: job.round,
            },
            self.config.attester.as_ref(),
            self.config.key_timeout,
        )
        .await?;
        let private_key = Arc::new(key.private_key);
        let schema = schema.clone();
        let binding = Binding {
            task_id: job.task_id.clone(),
            round: job.round,
            key_id: job.key_id.clone(),
        };
        let aggregator = Arc::new(Aggregator::new(
            binding,
            job.privacy.clip_norm,
            schema,
            &private_key,
        )?);
        // One batch is opened (on all cores) while the next is fetched: at most two batches of
        // ciphertext in memory, whatever the round's size.
        let mut refs = job.contributions.iter();
        let mut opening: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let mut batch = Vec::new();
            let mut bytes = 0usize;
            for (assignment_ref, blob_key) in refs.by_ref() {
                let stored = self.store.fetch(blob_key).await?;
                bytes += stored.as_ref().map_or(0, Vec::len);
                batch.push((assignment_ref.clone(), stored));
                if batch.len() >= self.config.batch.max(1) || bytes >= self.config.batch_bytes {
                    break;
                }
            }
            if let Some(previous) = opening.take() {
                previous
                    .await
                    .map_err(|e| JobError::Thread(e.to_string()))?;
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
        let aggregator = Arc::try_unwrap(aggregator)
            .map_err(|_| JobError::Thread("aggregator still shared".into()))?;
        let privacy = job.privacy;
        let attempt = job.attempt;
        let release =
            tokio::task::spawn_blocking(move || aggregator.finish(&private_key, attempt, privacy))
                .await
                .map_err(|e| JobError::Thread(e.to_string()))??;
        Ok(release)
    }
}

fn check_privacy(p: &PrivacyParams) -> Result<(), JobError> {
    let ok = p.epsilon > 0.0
        && p.epsilon <= MAX_TASK_EPSILON
        && p.delta > 0.0
        && p.delta <= MAX_TASK_DELTA
        && p.clip_norm.is_finite()
        && p.clip_norm > 0.0
        && p.rounds >= 1;
    if ok {
        Ok(())
    } else {
        Err(JobError::Privacy(format!(
            "epsilon {} (max {MAX_TASK_EPSILON}), delta {} (max {MAX_TASK_DELTA}), clip_norm {}, rounds {}",
            p.epsilon, p.delta, p.clip_norm, p.rounds
        )))
    }
}
