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

use std::sync::Arc;

use std::time::{Duration, Instant};

use confed_attestation::Attester;
use confed_attestation::release::{ReleaseCommitment, ReleaseProof};
use thiserror::Error;

use crate::aggregate::inputs::{self, Input};
use crate::aggregate::partition::{self, Partial, Partition, PartitionError};
use crate::aggregate::{AggregateError, Aggregator, Binding, PrivacyParams, Release, blt_round};
use crate::envelope::RoundContext;
use crate::key_collection::{CollectError, KeyRequest, KeyServiceEndpoint, obtain_private_key};
use crate::policy::Mechanism;
use crate::policy::{PolicyError, TaskPolicy, sha256_hex};
use crate::updater::{self, UpdateError};
use confed_worker_api::model::{ModelError, ModelSchema, validate_model};
use confed_worker_api::reads::{BufferPool, READ_AHEAD};
use confed_worker_api::store::{
    JobSpec, JobStore, MIN_PARTITION_INPUTS, Partitioning, StagedRelease, StoreError,
};

mod ahead;
mod analytics;
mod batches;
mod gather;
mod keyed;
mod masked;
mod open;
mod outcome;

pub use analytics::AnalyticsStep;
pub use outcome::{JobOutcome, Phases};

use ahead::Reads;
use keyed::{Keyed, KeyedRound, Opening, Prepared, signed_proof};
use open::Opens;

pub use crate::policy::{MAX_TASK_DELTA, MAX_TASK_EPSILON};

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
    #[error("the aggregator is still shared after its last contribution (a bug)")]
    StillShared,
    #[error(
        "the reads started with the key request are not of the contributions the open step opens (a bug)"
    )]
    ReadsNotTheOpens,
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
    Masked(#[from] crate::masked::MaskedError),
    #[error("the masks cannot be removed: {0}")]
    Unmask(String),
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
                | Self::Aggregate(AggregateError::EvaluationMismatch { .. })
                | Self::Aggregate(AggregateError::Unsupported(_))
                | Self::Aggregate(AggregateError::BltState(_))
                | Self::Aggregate(AggregateError::Blt(_))
                // A bad sealed partition cannot fix itself: the store never recomputes a
                // stored one. The round fails; the operator's resume plans it afresh.
                | Self::Partition(_)
                // A key service whose mask sums disagree with another's, or that put the sum
                // out of bounds, would answer the same again.
                | Self::Masked(crate::masked::MaskedError::Masking(
                    confed_protocol::masking::MaskingError::Disagree { .. }
                        | confed_protocol::masking::MaskingError::OutOfBound { .. }
                ))
                // A round too large for its ring stays so.
                | Self::Masked(crate::masked::MaskedError::RingTooSmall { .. })
                | Self::Masked(crate::masked::MaskedError::TooManyInputs { .. })
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
    /// Contributions the first read (of those listed without a digest) digests per batch
    /// (across all cores), at most ...
    pub batch: usize,
    /// ... and bytes of ciphertext per batch, at most (a batch ends at whichever comes first).
    pub batch_bytes: usize,
}

/// Bytes of contributions a job keeps in memory from their first read instead of reading them
/// again after the key, by default: none. Only contributions the job lists without a digest
/// (direct uploads to the blob store) have a first read, which digests them before the key is
/// asked for; those uploaded through the server are read once, after it. Reading a local
/// store again is cheap (the page cache, into pooled buffers: 9 GB/s here), while keeping a round
/// costs fresh memory (page faults and zeroing: about 3 GB/s) and holds it for the job. A worker
/// whose second read crosses the network keeps more (`Worker::retain_bytes`;
/// `confed-enclave --retain-mib`, 1 GiB by default). Either way memory stays flat, whatever the
/// round's size.
pub const RETAIN_BYTES: usize = 0;

/// `confed-enclave`'s default for `Worker::retain_bytes`: a round of up to 1 GiB read once over
/// the worker API.
pub const REMOTE_RETAIN_BYTES: usize = 1 << 30;

/// `confed-enclave`'s default for `Worker::read_ahead_bytes`: what a VM reads at 1-2 GB/s in a
/// key step of 130-270 ms (a longer one's wait is only partly used). A `Worker` reads nothing
/// ahead unless told to.
pub const REMOTE_READ_AHEAD_BYTES: usize = 256 << 20;

pub struct Worker<S> {
    store: Arc<S>,
    config: WorkerConfig,
    http: reqwest::Client,
    retain_bytes: usize,
    read_ahead_bytes: usize,
    buffers: BufferPool,
}

impl<S: JobStore + 'static> Worker<S> {
    pub fn new(store: Arc<S>, config: WorkerConfig) -> Self {
        let http = crate::http::client(config.key_timeout);
        // Enough free buffers for the first read's batch being read while another is digested,
        // and for the contributions in flight while they are opened.
        let buffers = BufferPool::new(2 * config.batch_bytes + (READ_AHEAD << 20));
        Self {
            store,
            config,
            http,
            retain_bytes: RETAIN_BYTES,
            read_ahead_bytes: 0,
            buffers,
        }
    }

    /// Keeps at most `bytes` of contributions from the first read (tests use 0: every
    /// contribution listed without a digest is read twice).
    pub fn retain_bytes(mut self, bytes: usize) -> Self {
        self.retain_bytes = bytes;
        self
    }

    /// Over a store that reads over the network, starts the open step's reads with the key
    /// request and holds up to `bytes` of what arrives before the key (plus one contribution,
    /// and the batches in flight): `ahead`. 0 (the default): the reads start after the key.
    pub fn read_ahead_bytes(mut self, bytes: usize) -> Self {
        self.read_ahead_bytes = bytes;
        self
    }

    /// Leases and runs one job; `None` when no job is ready.
    pub async fn run_once(&self) -> Result<Option<JobOutcome>, JobError> {
        let leasing = Instant::now();
        let Some(job) = self.store.lease(&self.config.id, self.config.lease).await? else {
            return Ok(None);
        };
        let lease = leasing.elapsed();
        match self.run_job(&job).await {
            Ok(mut outcome) => {
                outcome.phases.lease = lease;
                Ok(Some(outcome))
            }
            Err(JobError::Store(StoreError::LeaseLost)) => Err(StoreError::LeaseLost.into()),
            Err(error) => {
                let error_text = confed_protocol::errors::with_causes(&error);
                tracing::warn!(task = %job.task_id, round = job.round, error = %error_text, "aggregation job failed");
                self.store
                    .fail(
                        &job.job_id,
                        &job.lease_holder,
                        &error_text,
                        error.is_permanent(),
                    )
                    .await?;
                Err(error)
            }
        }
    }

    /// Runs a job this worker already leased (`run_once` leases, then runs it here; a
    /// benchmark that inspects the job first calls it itself). Commits through the store.
    pub async fn run_job(&self, job: &JobSpec) -> Result<JobOutcome, JobError> {
        let (policy, context) = round_context(job)?;
        let schema = validate_model(&job.model)?;
        if policy.analytics.is_some() {
            return self.run_analytics_job(job).await;
        }
        let mut phases = Phases::default();
        if let Some(Partitioning::Partition { index, count }) = job.partitioning {
            let sealed = self
                .aggregate_partition(job, &schema, &policy, context, index, count, &mut phases)
                .await?;
            return self
                .store_partition(job, &sealed, (index, count), phases)
                .await;
        }
        let (average, manifest) = match &job.committed_average {
            Some(average) => (average.clone(), None),
            None => {
                let (release, proof) = self
                    .aggregate(job, &schema, &policy, context, &mut phases)
                    .await?;
                let committing = Instant::now();
                self.store
                    .commit_release(
                        &job.job_id,
                        &job.lease_holder,
                        StagedRelease {
                            average: &release.average,
                            manifest: &release.manifest,
                            proof: &proof,
                            blt_state: release.blt_state.as_deref(),
                        },
                    )
                    .await?;
                phases.release = committing.elapsed();
                (release.average, Some(release.manifest))
            }
        };
        let updating = Instant::now();
        let values = updater::average_values(&schema, &average)?;
        let updated = updater::apply_with(
            &job.model,
            &schema,
            &values,
            policy.server_learning_rate,
            &job.optimizer,
            job.optimizer_state.as_deref(),
        )?;
        self.store
            .commit_model(
                &job.job_id,
                &job.lease_holder,
                &updated.model,
                updated.optimizer_state.as_deref(),
            )
            .await?;
        phases.update = updating.elapsed();
        Ok(JobOutcome {
            task_id: job.task_id.clone(),
            round: job.round,
            included: manifest.as_ref().map_or(0, |m| m.included),
            excluded: manifest.as_ref().map_or(0, |m| m.excluded.values().sum()),
            epsilon_spent: manifest.map(|m| m.privacy.epsilon_spent),
            partition: None,
            phases,
        })
    }

    /// Inputs first (their digests: listed by the store, or read and digested here;
    /// `aggregate::inputs`), then the key (against the release commitment, which every key
    /// service records in its ledger and answers with a receipt), then the contributions (each
    /// checked against its committed digest and opened as it arrives, across all cores: `open_all`),
    /// or, for a partitioned round's root, every partition's sealed sums (`Aggregator::merge`);
    /// then noise; the release is signed with a key made for this job and bound into its
    /// attestation.
    /// `schema`: the job's model's, validated once by the caller; `policy` and `context` from
    /// `round_context`. Records the time of each step in `phases`.
    pub async fn aggregate(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
        phases: &mut Phases,
    ) -> Result<(Release, ReleaseProof), JobError> {
        if policy.masking.is_some() {
            return self
                .aggregate_masked(job, schema, policy, context, phases)
                .await;
        }
        if let Some(Partitioning::Root { count, .. }) = &job.partitioning {
            check_plan(job.contributions.len(), *count)?;
        }
        let prepared = self.prepare(job, schema, policy, context, phases).await?;
        let step = Instant::now();
        let Prepared {
            privacy,
            inputs,
            reads,
            commitment,
            signing_key,
            receipts,
            private_key,
            aggregator,
        } = prepared;
        let aggregator = self
            .add_all(job, inputs, reads, &private_key, aggregator)
            .await?;
        phases.open = step.elapsed();
        let step = Instant::now();
        let release = self
            .finish_renewing(job, aggregator, private_key, privacy)
            .await?;
        phases.noise = step.elapsed();
        let proof = signed_proof(&release.manifest, commitment, &signing_key, receipts);
        Ok((release, proof))
    }

    /// Noises and averages on a blocking thread. Noising can take long (a tree round at the end
    /// of a long tree samples up to 2047 noise vectors): the lease is renewed every quarter
    /// lease until it is done.
    pub(super) async fn finish_renewing(
        &self,
        job: &JobSpec,
        aggregator: Aggregator,
        private_key: Arc<crate::hpke::PrivateKey>,
        privacy: PrivacyParams,
    ) -> Result<Release, JobError> {
        let mut finishing =
            tokio::task::spawn_blocking(move || aggregator.finish(&private_key, privacy));
        loop {
            match tokio::time::timeout(self.config.lease / 4, &mut finishing).await {
                Ok(joined) => return Ok(joined.map_err(JobError::Thread)??),
                Err(_) => {
                    self.store
                        .renew(&job.job_id, &job.lease_holder, self.config.lease)
                        .await?
                }
            }
        }
    }

    /// Adds a whole round's or a root's inputs to `aggregator`, then hands it back: a root
    /// merges every sealed partition (`merge_all`), any other job opens every contribution
    /// (`open_all`). A partition's job goes through `seal_range` instead.
    pub(super) async fn add_all<A: Partial + Opens>(
        &self,
        job: &JobSpec,
        inputs: Vec<Input>,
        reads: Option<Reads<'_>>,
        private_key: &Arc<crate::hpke::PrivateKey>,
        aggregator: Arc<A>,
    ) -> Result<A, JobError> {
        match &job.partitioning {
            // A root opens no contribution: `start_reads` starts none for it.
            Some(Partitioning::Root { .. }) if reads.is_some() => {
                return Err(JobError::ReadsNotTheOpens);
            }
            Some(Partitioning::Root { count, sealed_keys }) => {
                self.merge_all(job, inputs, *count, sealed_keys, private_key, &aggregator)
                    .await?
            }
            _ => self.open_all(job, inputs, reads, &aggregator).await?,
        }
        Arc::try_unwrap(aggregator).map_err(|_| JobError::StillShared)
    }

    /// The root's merge: each partition's sealed result fetched, checked and added one at a
    /// time (on a blocking thread), so the root holds one sealed partition in memory, whatever
    /// their number; the lease renewed every quarter lease.
    async fn merge_all<A: Partial>(
        &self,
        job: &JobSpec,
        inputs: Vec<Input>,
        count: u32,
        sealed_keys: &[String],
        private_key: &Arc<crate::hpke::PrivateKey>,
        aggregator: &Arc<A>,
    ) -> Result<(), JobError> {
        let inputs = Arc::new(inputs);
        let mut merge = aggregator.start_merge(inputs.len(), count)?;
        let mut renewed = Instant::now();
        for key in sealed_keys {
            // Lost from the store: it is never sealed again by itself, so the round fails (a
            // resume seals the partitions again) instead of retrying forever.
            let sealed = self
                .store
                .fetch_sealed(key)
                .await?
                .ok_or_else(|| PartitionError::NotStored(key.clone()))?;
            let (merging, private_key, inputs) = (
                Arc::clone(aggregator),
                Arc::clone(private_key),
                Arc::clone(&inputs),
            );
            merge = tokio::task::spawn_blocking(move || {
                merging
                    .merge_one(&mut merge, &private_key, &inputs, &sealed)
                    .map(|()| merge)
            })
            .await
            .map_err(JobError::Thread)??;
            if renewed.elapsed() >= self.config.lease / 4 {
                self.store
                    .renew(&job.job_id, &job.lease_holder, self.config.lease)
                    .await?;
                renewed = Instant::now();
            }
        }
        Ok(merge.end()?)
    }

    /// One partition of a partitioned round: the round's inputs and key exactly as the whole
    /// round's (the same commitment), then only the partition's inputs opened and summed, and
    /// the exact state sealed for the root (`Aggregator::seal_partition`).
    #[allow(clippy::too_many_arguments)]
    async fn aggregate_partition(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
        index: u32,
        count: u32,
        phases: &mut Phases,
    ) -> Result<Vec<u8>, JobError> {
        check_plan(job.contributions.len(), count)?;
        if policy.masking.is_some() {
            return self
                .masked_partition(job, schema, policy, context, (index, count), phases)
                .await;
        }
        let prepared = self.prepare(job, schema, policy, context, phases).await?;
        let Prepared {
            inputs,
            reads,
            private_key,
            aggregator,
            ..
        } = prepared;
        let opening = Opening { inputs, reads };
        self.seal_range(
            job,
            opening,
            (index, count),
            private_key,
            aggregator,
            phases,
        )
        .await
    }

    /// A partition's step after its key: only partition `index` of `count` of the round's
    /// `inputs` opened into `aggregator`, and its exact state sealed for the root
    /// (`Partial::seal_partition`).
    pub(in crate::worker) async fn seal_range<A: Partial + Opens>(
        &self,
        job: &JobSpec,
        Opening { mut inputs, reads }: Opening<'_>,
        (index, count): (u32, u32),
        private_key: Arc<crate::hpke::PrivateKey>,
        aggregator: Arc<A>,
        phases: &mut Phases,
    ) -> Result<Vec<u8>, JobError> {
        let step = Instant::now();
        let listing = inputs::listing(&inputs);
        let range = partition::range(inputs.len(), index, count)?;
        let mine: Vec<Input> = inputs.drain(range).collect();
        drop(inputs);
        self.open_all(job, mine, reads, &aggregator).await?;
        let aggregator = Arc::try_unwrap(aggregator).map_err(|_| JobError::StillShared)?;
        phases.open = step.elapsed();
        let step = Instant::now();
        let sealed = tokio::task::spawn_blocking(move || {
            let partition = Partition {
                inputs: &listing,
                index,
                count,
            };
            aggregator.seal_partition(&private_key, &partition)
        })
        .await
        .map_err(JobError::Thread)??;
        phases.noise = step.elapsed();
        Ok(sealed)
    }

    /// Stores a partition's sealed state for the root. Its outcome releases nothing, and says
    /// nothing of its partition's outcomes (`included` and `excluded` are 0): only the release
    /// publishes them.
    pub(super) async fn store_partition(
        &self,
        job: &JobSpec,
        sealed: &[u8],
        (index, count): (u32, u32),
        mut phases: Phases,
    ) -> Result<JobOutcome, JobError> {
        let storing = Instant::now();
        self.store
            .put_partition(&job.job_id, &job.lease_holder, sealed)
            .await?;
        phases.release = storing.elapsed();
        Ok(JobOutcome {
            task_id: job.task_id.clone(),
            round: job.round,
            included: 0,
            excluded: 0,
            epsilon_spent: None,
            partition: Some((index, count)),
            phases,
        })
    }

    /// What every kind of job does first: the round's privacy parameters, its inputs and their
    /// digest (the BLT state bound in), the release commitment, the key against it, and an
    /// aggregator bound to it all.
    async fn prepare(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        policy: &TaskPolicy,
        context: RoundContext,
        phases: &mut Phases,
    ) -> Result<Prepared<'_>, JobError> {
        let KeyedRound {
            privacy,
            inputs,
            reads,
            keyed,
            continues,
        } = self.key_round(job, schema, context, policy, phases).await?;
        let Keyed {
            commitment,
            signing_key,
            receipts,
            private_key,
            binding,
        } = keyed;
        let round = binding.context.round;
        let aggregator = Arc::new(
            Aggregator::new(binding, privacy.clip_norm, schema.clone(), &private_key)?
                .evaluating(privacy.evaluation_in(round))
                .watching_health(privacy.health)
                .weighing(privacy.weighting)
                .authenticating(policy.device_auth.clone())
                .continuing(continues),
        );
        Ok(Prepared {
            privacy,
            inputs,
            reads,
            commitment,
            signing_key,
            receipts,
            private_key,
            aggregator,
        })
    }

    /// A training round's privacy parameters, its inputs and their digest (the BLT state bound
    /// in), the release commitment and the key against it: what a clear and a masked round's
    /// job do first. `continues`: the BLT state the step that noises continues.
    pub(in crate::worker) async fn key_round(
        &self,
        job: &JobSpec,
        schema: &ModelSchema,
        context: RoundContext,
        policy: &TaskPolicy,
        phases: &mut Phases,
    ) -> Result<KeyedRound<'_>, JobError> {
        let step = Instant::now();
        let privacy = PrivacyParams::for_round(policy, job.clip_norm, job.on_demand_evaluation)?;
        // The noise's calibration (26 ms the first time a process meets a policy) on a spare
        // thread while the inputs are listed and the key is fetched, not after the contributions
        // open; `finish` then finds it cached. Its errors are `finish`'s to report.
        if !matches!(job.partitioning, Some(Partitioning::Partition { .. })) {
            drop(tokio::task::spawn_blocking(move || privacy.calibration()));
        }
        // BLT: the model's size and the state's header, before anything is read or asked for.
        let blt_state = match privacy.mechanism {
            Mechanism::Blt(blt) => Some(blt_round::check_before_key(
                &blt,
                &context,
                schema.parameter_count(),
                job.blt_state.as_deref(),
            )?),
            _ if job.blt_state.is_some() => {
                return Err(JobError::MalformedJob(
                    "the job names a BLT state, but the policy's noise is not BLT".into(),
                ));
            }
            _ => None,
        };
        let (inputs, inputs_digest) = self.gather(job).await?;
        // A masked round whose contributions could wrap its ring fails before the key is
        // asked for (its commitment unspent): a retry would fail the same.
        if let Some(masking) = &policy.masking {
            crate::masked::check_ring(&masking.layout(), inputs.len(), masking.noise_variance)?;
            crate::masked::check_unmask_inputs(inputs.len())?;
        }
        let inputs_digest = privacy.bind_round_choices(inputs_digest);
        // Last, the sampler the release's noise is drawn with, by the policy's mechanism (with
        // BLT's state): an enclave that draws other values from the same key gets another
        // commitment for the round.
        let inputs_digest = match (&privacy.mechanism, blt_state) {
            (Mechanism::Blt(_), Some(state)) => {
                inputs::bind_blt_state(&inputs_digest, state.as_ref())
            }
            (Mechanism::Gaussian, _) => inputs::bind_gaussian_sampler(&inputs_digest),
            // Tree nodes keep `sampler`: every round of a tree draws them alike.
            (Mechanism::Tree { .. }, _) => inputs_digest,
            (Mechanism::Blt(_), None) => {
                return Err(JobError::MalformedJob(
                    "a BLT round without the state it continues".into(),
                ));
            }
        };
        phases.read = step.elapsed();
        let (keyed, reads) = self
            .key_reading(job, context, inputs_digest, &inputs, phases)
            .await?;
        // Only the step that noises continues the BLT state: a partition only binds its digest
        // (above), and a copy of the state per partition would cost up to 240 bytes a value.
        let continues = match job.partitioning {
            Some(Partitioning::Partition { .. }) => None,
            _ => job.blt_state.clone(),
        };
        Ok(KeyedRound {
            privacy,
            inputs,
            reads,
            keyed,
            continues,
        })
    }

    /// The release commitment of `inputs_digest` and the round's key against it: every key
    /// service records the commitment in its ledger (one per round) and answers with a receipt.
    /// The job's signing key is made here and bound into the attestation. The aggregator's
    /// binding (the round, its key id and inputs digest) comes with it.
    pub(in crate::worker) async fn key_for(
        &self,
        job: &JobSpec,
        context: RoundContext,
        inputs_digest: String,
        phases: &mut Phases,
    ) -> Result<Keyed, JobError> {
        let step = Instant::now();
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
        phases.key = step.elapsed();
        Ok(Keyed {
            commitment,
            signing_key,
            receipts: key.receipts,
            private_key: Arc::new(key.private_key),
            binding: Binding {
                context,
                key_id: job.key_id.clone(),
                inputs_digest,
            },
        })
    }
}

/// Refuses a partition plan with a partition of fewer than `MIN_PARTITION_INPUTS` inputs (one
/// partition, the whole round, is always fine), before anything is read or asked for.
fn check_plan(inputs: usize, count: u32) -> Result<(), PartitionError> {
    if count > 1 && inputs / (count as usize) < MIN_PARTITION_INPUTS {
        return Err(PartitionError::Plan(format!(
            "{count} partitions of {inputs} contributions: a partition holds at least {MIN_PARTITION_INPUTS}"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_with_a_partition_below_the_floor_is_refused() {
        assert!(check_plan(10, 1).is_ok());
        assert!(check_plan(2 * MIN_PARTITION_INPUTS, 2).is_ok());
        assert!(matches!(
            check_plan(2 * MIN_PARTITION_INPUTS - 1, 2),
            Err(PartitionError::Plan(_))
        ));
        assert!(matches!(
            check_plan(100_000, 4096),
            Err(PartitionError::Plan(_))
        ));
    }
}
