//! The untrusted side of aggregation: the task database and blob store offered to enclave workers
//! as `confed_worker_api::JobStore`: over HTTP to `confed-enclave` processes (`api::workers`), or
//! in process to the embedded default's worker (`embedded::serve::run_worker`).
//!
//! Nothing here sees a key, a plaintext or an un-noised sum: it hands out ciphertexts and stores
//! what the enclave releases (the noised average, its manifest, the next model).

pub mod partitions;

use std::sync::Arc;
use std::time::Duration;

use confed_worker_api::store::{
    BlockingFetch, JobSpec, JobStore, ModelCommitSteps, StagedRelease, StoreError,
    commit_model_in_order,
};
use confed_worker_api::wire::{BlobSource, ContributionWire, JobWire, resolve};
use sha2::{Digest, Sha256};

use crate::blob::{BlobError, BlobKey, BlobStore, SealedReader};
use crate::db::jobs::{JobContext, LeasePlan, LeasedJob, NewRelease, StoredContribution};
use crate::db::partitions::LeasedPartition;
use crate::db::{Db, DbError, NewModel};
use crate::keys::directory::KeyDirectory;
use confed_protocol::hex::encode as hex;
use partitions::PartitionPolicy;

/// The task database and blob stores, as enclave workers use them.
#[derive(Debug, Clone)]
pub struct TaskDbJobStore {
    pub db: Db,
    /// Models and releases.
    pub blobs: Arc<dyn BlobStore>,
    pub contributions: Arc<dyn BlobStore>,
    pub keys: KeyDirectory,
    /// How large rounds are cut into partitions for several workers.
    pub partitioning: PartitionPolicy,
}

pub(crate) fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

pub(crate) fn db_error(e: DbError) -> StoreError {
    match e {
        DbError::LeaseLost(_) => StoreError::LeaseLost,
        DbError::AlreadyExists(what) => StoreError::Conflict(what),
        // A job or partition that does not exist: the caller named it wrong (422, not 500).
        not_found @ DbError::NotFound { .. } => StoreError::Refused(not_found.to_string()),
        // The database down or its disk full (counted and logged as the API does): the worker
        // retries; it is no fault of ours.
        other if other.note_outage() => StoreError::Unavailable(other.to_string()),
        other => backend(other),
    }
}

/// A blob store's failure: a cloud store's hiccup or a full disk (counted and logged as the
/// API does) is worth a retry (`Unavailable`), anything else is the store's fault.
pub(crate) fn blob_error(e: BlobError) -> StoreError {
    if e.note_outage() {
        StoreError::Unavailable(e.to_string())
    } else {
        backend(e)
    }
}

/// Under adaptive clipping, the round's clip norm: the policy's for round 1, then the previous
/// release's `next_clip_norm` (post-processing of that release; the enclave binds it into the
/// release commitment, and privacy does not depend on it). `None` without adaptive clipping.
fn round_clip_norm(context: &JobContext) -> Result<Option<f64>, String> {
    let spec = &context.task.spec;
    if spec.privacy.adaptive_clipping.is_none() {
        return Ok(None);
    }
    if context.round.round_number <= 1 {
        return Ok(Some(spec.privacy.clip_norm));
    }
    let previous = context.previous_release.as_ref().ok_or_else(|| {
        format!(
            "round {} clips adaptively but round {} has no release",
            context.round.round_number,
            context.round.round_number - 1
        )
    })?;
    confed_worker_api::Manifest::next_clip_norm_of(&previous.manifest_json)
        .map(Some)
        .ok_or_else(|| {
            format!(
                "round {}'s release names no next clip norm",
                previous.round_number
            )
        })
}

/// The BLAKE3 (hex) of the sealed BLT state a release's manifest says its round left.
fn state_out_blake3(manifest_json: &str) -> Option<String> {
    confed_worker_api::Manifest::blt_state_out_of(manifest_json)
        .filter(|hex| confed_protocol::hex::is_digest_hex(hex))
}

/// Under BLT noise, the blob key of the sealed state round `round - 1` left (its release's
/// manifest names it); `None` for round 1 and other mechanisms. What the enclave checks of it is
/// in `confed_enclave::aggregate::blt_state`: nothing here is trusted.
fn previous_blt_state(context: &JobContext) -> Result<Option<String>, String> {
    if !context.task.spec.privacy.is_blt() || context.round.round_number <= 1 {
        return Ok(None);
    }
    let previous = context.previous_release.as_ref().ok_or_else(|| {
        format!(
            "round {} continues BLT noise, but round {} has no release",
            context.round.round_number,
            context.round.round_number - 1
        )
    })?;
    let blake3 = state_out_blake3(&previous.manifest_json).ok_or_else(|| {
        format!(
            "round {}'s release names no BLT state",
            previous.round_number
        )
    })?;
    let key = BlobKey::blt_state(
        &context.task.tenant_id,
        &context.task.id,
        previous.round_number,
        &blake3,
    )
    .map_err(|e| e.to_string())?;
    Ok(Some(key.as_str().to_string()))
}

impl TaskDbJobStore {
    /// The store's time (the task database's clock).
    pub(crate) fn now(&self) -> i64 {
        self.db.now().0
    }

    /// The job as the enclave sees it; `Err(reason)` when the stored job cannot be run at all.
    pub(crate) fn wire(
        &self,
        context: &JobContext,
        contributions: &[StoredContribution],
    ) -> Result<JobWire, String> {
        let key_id = context
            .key_id
            .clone()
            .ok_or("the round has no encryption key")?;
        let key = self
            .keys
            .key(&key_id)
            .ok_or_else(|| format!("key {key_id} is not published by the key services"))?;
        let spec = &context.task.spec;
        Ok(JobWire {
            job_id: context.round.id.clone(),
            task_id: context.task.id.clone(),
            round: confed_protocol::ids::wire_round(context.round.round_number).ok_or_else(
                || format!("round number {} is not a round", context.round.round_number),
            )?,
            attempt: u64::try_from(context.round.attempt)
                .map_err(|_| format!("attempt {} is negative", context.round.attempt))?,
            // Set by the lease that hands the job out (`lease_wire`).
            lease_holder: String::new(),
            key_id,
            public_key: key.public_key,
            policy: spec
                .policy(&context.task.id, &context.task.tenant_id)
                .encode(),
            model_key: context.model.blob_key.clone(),
            contributions: contributions
                .iter()
                .map(|c| match &c.blake3_hex {
                    Some(hex) => ContributionWire::Digested(
                        c.assignment_ref.clone(),
                        c.blob_key.clone(),
                        hex.clone(),
                    ),
                    None => {
                        ContributionWire::Undigested(c.assignment_ref.clone(), c.blob_key.clone())
                    }
                })
                .collect(),
            committed_average_key: context.release.as_ref().map(|r| r.average_key.clone()),
            optimizer: spec.server_optimizer,
            optimizer_state_key: context.model.optimizer_state_key.clone(),
            clip_norm: round_clip_norm(context)?,
            on_demand_evaluation: context.round.on_demand_evaluation,
            blt_state_key: previous_blt_state(context)?,
            partitioning: None,
        })
    }

    /// Leases the next runnable job and describes it (keys, not bytes): what both the in-process
    /// worker and the worker API start from: a partition of a partitioned round first, else a
    /// round's job, which its first lease plans (`plan`: cut into partitions, or not); a
    /// partitioned round's job is leasable only once every partition is stored, and then merges
    /// them. A job that cannot run at all fails at once.
    pub async fn lease_wire(
        &self,
        worker: &str,
        arrived: i64,
        lease: Duration,
    ) -> Result<Option<JobWire>, StoreError> {
        loop {
            let taken = match self
                .db
                .lease_partition_for(worker, arrived, lease)
                .await
                .map_err(db_error)?
            {
                Some(partition) => Taken::Partition(partition),
                None => match self
                    .db
                    .lease_job_planning(worker, arrived, lease, self.lease_plan())
                    .await
                    .map_err(db_error)?
                {
                    Some(job) => Taken::Job(job),
                    None => return Ok(None),
                },
            };
            // Two reads on connections of their own, at once.
            let (context, contributions) = tokio::try_join!(
                self.db.job_context(taken.round_id()),
                self.db.job_contributions(taken.round_id()),
            )
            .map_err(db_error)?;
            let wire = match self.wire(&context, &contributions) {
                Ok(wire) => wire,
                Err(reason) => {
                    self.fail_unrunnable(&taken, &reason).await?;
                    continue;
                }
            };
            match taken {
                Taken::Partition(partition) => {
                    return Ok(Some(partitions::partition_wire(wire, partition)));
                }
                Taken::Job(job) => {
                    if job.plan.is_none()
                        && self.plan(&context, &contributions, &job.holder).await?
                    {
                        // Cut into partitions: lease one of them instead.
                        continue;
                    }
                    let mut wire = wire;
                    // A job planned whole has no partitions to merge.
                    if job.plan != Some(1) {
                        wire.partitioning = self.root_partitioning(&context).await?;
                    }
                    wire.lease_holder = job.holder;
                    return Ok(Some(wire));
                }
            }
        }
    }

    /// How a lease plans a job it finds not planned: in its own transaction when this
    /// deployment never cuts rounds into partitions (one commit fewer on each round's path),
    /// else by `plan` once its contributions are listed.
    fn lease_plan(&self) -> LeasePlan {
        match self.partitioning.never_cuts() {
            true => LeasePlan::Whole,
            false => LeasePlan::Later,
        }
    }

    /// Fails a leased job or partition that cannot run at all (its round's stored definition
    /// makes no job): permanently, which fails the round.
    async fn fail_unrunnable(&self, taken: &Taken, reason: &str) -> Result<(), StoreError> {
        tracing::error!(round = %taken.round_id(), %reason, "aggregation job cannot run");
        match taken {
            Taken::Partition(partition) => self
                .db
                .fail_partition(
                    &partition.round_id,
                    partition.index,
                    &partition.holder,
                    reason,
                    true,
                )
                .await
                .map_err(db_error),
            Taken::Job(job) => {
                self.db
                    .fail_job(&job.round_id, &job.holder, reason, true)
                    .await
                    .map_err(db_error)?;
                metrics::counter!("confed_aggregation_jobs_failed_total", "kind" => "permanent")
                    .increment(1);
                Ok(())
            }
        }
    }

    /// A model or release object (`None` when missing).
    pub async fn blob(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = BlobKey::new(key.to_string()).map_err(backend)?;
        match self.blobs.get(&key).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(BlobError::NotFound(_)) => Ok(None),
            Err(e) => Err(blob_error(e)),
        }
    }
}

impl TaskDbJobStore {
    /// Writes a release's average and manifest to the blob store (write-once names), the first
    /// half of `commit_release`. Public so tests can stop a worker between staging and commit.
    pub async fn stage_release(
        &self,
        job_id: &str,
        release: StagedRelease<'_>,
    ) -> Result<NewRelease, StoreError> {
        let context = self.db.job_context(job_id).await.map_err(db_error)?;
        let verified = crate::release_check::verify_staged(&self.keys, &context, &release)
            .map_err(|why| {
                tracing::warn!(job = %job_id, %why, "refused a release");
                StoreError::Refused(why)
            })?;
        self.check_blt_state(&context, release.manifest).await?;
        let (average_key, manifest_key) = BlobKey::release(
            &context.task.tenant_id,
            &context.task.id,
            context.round.round_number,
            context.round.attempt,
        )
        .map_err(backend)?;
        let manifest_json = release.manifest.to_json();
        // The average first: a different release already stored under its name stops this one
        // before its manifest is written beside it.
        for (key, bytes) in [
            (&average_key, release.average),
            (&manifest_key, &manifest_json[..]),
        ] {
            match self.blobs.put(key, bytes).await {
                Ok(_) => {}
                Err(BlobError::Conflict(what)) => {
                    return Err(StoreError::Conflict(format!(
                        "a different release is already stored at {what}"
                    )));
                }
                Err(e) => return Err(blob_error(e)),
            }
        }
        let manifest = release.manifest;
        Ok(NewRelease {
            average_key: average_key.as_str().to_string(),
            average_sha256: verified.average_sha256,
            manifest_key: manifest_key.as_str().to_string(),
            manifest_json: String::from_utf8(manifest_json).map_err(backend)?,
            included: manifest.included as i64,
            excluded: manifest.excluded.values().sum::<u64>() as i64,
            epsilon_spent: manifest.privacy.epsilon_spent,
            proof_json: verified.proof_json,
        })
    }

    /// Under BLT noise a release names the sealed state its round left, which must be stored
    /// (`put_blt_state`) before the release commits; other releases name none.
    async fn check_blt_state(
        &self,
        context: &JobContext,
        manifest: &confed_worker_api::Manifest,
    ) -> Result<(), StoreError> {
        let named = manifest
            .noise
            .blt
            .as_ref()
            .map(|blt| blt.state_out_blake3.clone());
        match (context.task.spec.privacy.is_blt(), named) {
            (false, None) => Ok(()),
            (false, Some(_)) => Err(StoreError::Refused(
                "the release names a BLT state, but the task's noise is not BLT".into(),
            )),
            (true, None) => Err(StoreError::Refused(
                "a BLT release must name the state its round leaves (`noise.blt.state_out_blake3`)"
                    .into(),
            )),
            (true, Some(blake3)) => {
                let key = blt_state_key(context, &blake3)?;
                match self.blobs.stat(&key).await.map_err(blob_error)? {
                    Some(_) => Ok(()),
                    None => Err(StoreError::Refused(format!(
                        "no BLT state {blake3} was stored for this job; upload it first"
                    ))),
                }
            }
        }
    }

    /// The job's context, if `worker` holds its lease and its round is in `state` (what the
    /// round is making then: `making`); the guard of every state a worker stores beside a commit.
    async fn leased_in(
        &self,
        job_id: &str,
        worker: &str,
        state: crate::states::RoundState,
        making: &str,
    ) -> Result<JobContext, StoreError> {
        self.db
            .check_job_lease(job_id, worker)
            .await
            .map_err(db_error)?;
        let context = self.db.job_context(job_id).await.map_err(db_error)?;
        if context.round.state != state {
            return Err(StoreError::Conflict(format!(
                "round {} is {}, not {}: {making} is not being made",
                context.round.round_number,
                context.round.state.as_str(),
                state.as_str()
            )));
        }
        Ok(context)
    }

    /// Stores a sealed BLT state write-once under its BLAKE3, the first half of a BLT release's
    /// commit (the release's manifest names the digest): only the lease holder, only while the
    /// round is AGGREGATING, only for a BLT task. Returns the digest (hex).
    pub async fn put_blt_state(
        &self,
        job_id: &str,
        worker: &str,
        state: &[u8],
    ) -> Result<String, StoreError> {
        let context = self
            .leased_in(
                job_id,
                worker,
                crate::states::RoundState::Aggregating,
                "its release",
            )
            .await?;
        if !context.task.spec.privacy.is_blt() {
            return Err(StoreError::Refused(
                "the task's noise is not BLT: it keeps no state".into(),
            ));
        }
        let blake3 = hex(blake3::hash(state).as_bytes());
        let key = blt_state_key(&context, &blake3)?;
        match self.blobs.put(&key, state).await {
            Ok(_) => Ok(blake3),
            // Named by its content: other bytes under the name are a corrupted store.
            Err(BlobError::Conflict(what)) => Err(StoreError::Conflict(format!(
                "other bytes are stored under the BLT state's digest ({what})"
            ))),
            Err(e) => Err(blob_error(e)),
        }
    }

    /// Stores `state` (a server optimizer's state file) write-once under its digest next to the
    /// model version this job makes; returns the digest that `commit_model_linked` takes. The
    /// first half of a model commit with state: only the lease holder, only while the round is
    /// APPLYING, only a state that fits the task's optimizer and the model's size
    /// (`parameters`, else read from the base model's header).
    pub async fn put_optimizer_state(
        &self,
        job_id: &str,
        worker: &str,
        state: &[u8],
        parameters: Option<usize>,
    ) -> Result<String, StoreError> {
        let context = self
            .leased_in(
                job_id,
                worker,
                crate::states::RoundState::Applying,
                "its model",
            )
            .await?;
        let parameters = match parameters {
            Some(parameters) => parameters,
            None => parameter_count(&self.required_blob(&context.model.blob_key).await?)?,
        };
        confed_worker_api::optimizer::OptimizerState::decode(state)
            .and_then(|decoded| decoded.fits(&context.task.spec.server_optimizer, parameters))
            .map_err(|e| StoreError::Refused(e.to_string()))?;
        let sha = hex(Sha256::digest(state));
        let key = optimizer_state_key(&context, &sha)?;
        match self.blobs.put(&key, state).await {
            Ok(_) | Err(BlobError::Conflict(_)) => Ok(sha),
            Err(e) => Err(blob_error(e)),
        }
    }

    /// Stores model version `round` and commits it, linked to the optimizer state stored under
    /// `optimizer_state_sha256` (by `put_optimizer_state`): required exactly when the task's
    /// optimizer keeps state.
    pub async fn commit_model_linked(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state_sha256: Option<&str>,
    ) -> Result<(), StoreError> {
        let context = self.db.job_context(job_id).await.map_err(db_error)?;
        let optimizer = &context.task.spec.server_optimizer;
        let optimizer_state_key = match (optimizer.has_state(), optimizer_state_sha256) {
            (true, Some(sha)) => {
                let key = optimizer_state_key(&context, sha)?;
                if self.blobs.stat(&key).await.map_err(blob_error)?.is_none() {
                    return Err(StoreError::Refused(format!(
                        "no optimizer state {sha} was stored for this job; upload it first"
                    )));
                }
                Some(key.as_str().to_string())
            }
            (true, None) => {
                return Err(StoreError::Refused(format!(
                    "the task's optimizer ({}) keeps state: store it first and name its digest",
                    optimizer.name()
                )));
            }
            (false, Some(_)) => {
                return Err(StoreError::Refused(format!(
                    "the task's optimizer ({}) keeps no state",
                    optimizer.name()
                )));
            }
            (false, None) => None,
        };
        let sha = hex(Sha256::digest(model));
        let key = BlobKey::model(
            &context.task.tenant_id,
            &context.task.id,
            context.round.round_number,
            &sha,
        )
        .map_err(backend)?;
        self.blobs.put(&key, model).await.map_err(blob_error)?;
        let early_stop = crate::evaluation::early_stop_verdict(
            &self.db,
            &context.task,
            context.round.round_number,
        )
        .await
        .map_err(db_error)?;
        self.db
            .commit_model(
                job_id,
                worker,
                NewModel {
                    blob_key: key.as_str().to_string(),
                    sha256_hex: sha,
                    size_bytes: model.len() as i64,
                    optimizer_state_key,
                },
                early_stop,
            )
            .await
            .map_err(db_error)?;
        // The round is complete: its sealed partitions, if it had any, are read no more.
        self.discard_partitions(job_id).await;
        Ok(())
    }

    /// Deletes a completed round's sealed partitions (none for a round not partitioned); a
    /// failure is logged, not an error: the round is complete either way.
    async fn discard_partitions(&self, job_id: &str) {
        match self.db.partitions(job_id).await {
            Ok(partitions) => partitions::discard(self.blobs.as_ref(), &partitions).await,
            Err(error) => {
                tracing::warn!(round = job_id, %error, "the round's sealed partitions could not be listed for deletion")
            }
        }
    }
}

impl ModelCommitSteps for TaskDbJobStore {
    async fn stage_optimizer_state(
        &self,
        job_id: &str,
        worker: &str,
        state: &[u8],
        model: &[u8],
    ) -> Result<String, StoreError> {
        // The new model is at hand: its header gives the size without reading the base.
        let parameters = parameter_count(model)?;
        self.put_optimizer_state(job_id, worker, state, Some(parameters))
            .await
    }

    async fn put_model_linked(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state_sha256: Option<&str>,
    ) -> Result<(), StoreError> {
        self.commit_model_linked(job_id, worker, model, optimizer_state_sha256)
            .await
    }
}

/// What one turn of the lease loop took: a partition of a partitioned round, or a round's job.
enum Taken {
    Partition(LeasedPartition),
    Job(LeasedJob),
}

impl Taken {
    fn round_id(&self) -> &str {
        match self {
            Taken::Partition(partition) => &partition.round_id,
            Taken::Job(job) => &job.round_id,
        }
    }
}

/// How many values a model file holds, from its safetensors header alone (no value is read).
fn parameter_count(model: &[u8]) -> Result<usize, StoreError> {
    let (_, metadata) = safetensors::SafeTensors::read_metadata(model).map_err(backend)?;
    Ok(metadata
        .tensors()
        .values()
        .map(|info| info.shape.iter().product::<usize>())
        .sum())
}

/// Where the sealed BLT state a job's round leaves is stored, under its BLAKE3.
fn blt_state_key(context: &JobContext, blake3_hex: &str) -> Result<BlobKey, StoreError> {
    BlobKey::blt_state(
        &context.task.tenant_id,
        &context.task.id,
        context.round.round_number,
        blake3_hex,
    )
    .map_err(backend)
}

/// Where the optimizer state after a job's round is stored, under its digest.
fn optimizer_state_key(context: &JobContext, sha256_hex: &str) -> Result<BlobKey, StoreError> {
    BlobKey::optimizer_state(
        &context.task.tenant_id,
        &context.task.id,
        context.round.round_number,
        sha256_hex,
    )
    .map_err(backend)
}

impl BlobSource for TaskDbJobStore {
    async fn required_blob(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        self.blob(key)
            .await?
            .ok_or_else(|| backend(format!("blob {key} is missing")))
    }
}

/// A contribution read from the store: its bytes, `None` when the store has none.
fn fetched(read: Result<Vec<u8>, BlobError>) -> Result<Option<Vec<u8>>, StoreError> {
    match read {
        Ok(bytes) => Ok(Some(bytes)),
        Err(BlobError::NotFound(_)) => Ok(None),
        Err(e) => Err(blob_error(e)),
    }
}

/// `TaskDbJobStore::fetch_into` on the calling thread, over a store that reads local files.
struct ContributionReader(Arc<dyn SealedReader>);

impl BlockingFetch for ContributionReader {
    fn fetch_into(&self, blob_key: &str, buffer: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        let key = BlobKey::new(blob_key.to_string()).map_err(backend)?;
        fetched(self.0.get_sealed_into(&key, buffer))
    }
}

impl JobStore for TaskDbJobStore {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        // In process, a lease request is answered at once: it arrives now.
        let Some(wire) = self.lease_wire(worker, self.now(), lease).await? else {
            return Ok(None);
        };
        resolve(self, wire).await.map(Some)
    }

    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        self.renew_any(job_id, worker, lease).await
    }

    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.fetch_into(blob_key, Vec::new()).await
    }

    async fn fetch_into(
        &self,
        blob_key: &str,
        buffer: Vec<u8>,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let key = BlobKey::new(blob_key.to_string()).map_err(backend)?;
        // The enclave checks every byte against its committed BLAKE3 (and the AEAD): no store
        // digest on the way.
        fetched(self.contributions.get_sealed_into(&key, buffer).await)
    }

    fn blocking_fetch(&self) -> Option<Arc<dyn BlockingFetch>> {
        let reader = self.contributions.sealed_reader()?;
        Some(Arc::new(ContributionReader(reader)))
    }

    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        let manifest = release.manifest;
        if let Some(state) = release.blt_state {
            self.put_blt_state(job_id, worker, state).await?;
        }
        let staged = self.stage_release(job_id, release).await?;
        self.db
            .commit_release(job_id, worker, staged)
            .await
            .map_err(db_error)?;
        // An analytics round completes with its release (no model follows): its sealed
        // partitions, if it had any, are read no more.
        if manifest.analytics.is_some() {
            self.discard_partitions(job_id).await;
        }
        // Counted where the release commits, so whichever process runs the worker (in process,
        // or confed-enclave over an API replica's worker API) the front end counts it.
        metrics::counter!("confed_rounds_aggregated_total").increment(1);
        metrics::counter!("confed_contributions_included_total").increment(manifest.included);
        for (reason, count) in &manifest.excluded {
            metrics::counter!("confed_contributions_excluded_total", "reason" => reason.clone())
                .increment(*count);
        }
        Ok(())
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
        let key = BlobKey::new(key.to_string()).map_err(backend)?;
        fetched(self.blobs.get_sealed(&key).await)
    }

    async fn put_partition(
        &self,
        job_id: &str,
        worker: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        self.put_partition_sealed(job_id, worker, sealed).await
    }

    async fn fail(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        self.fail_any(job_id, worker, reason, permanent).await?;
        let kind = if permanent { "permanent" } else { "transient" };
        metrics::counter!("confed_aggregation_jobs_failed_total", "kind" => kind).increment(1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_outages_are_unavailable_and_faults_are_not() {
        let remote = BlobError::Remote {
            key: "k".into(),
            message: "503 from GCS".into(),
        };
        assert!(matches!(blob_error(remote), StoreError::Unavailable(_)));
        let full = BlobError::Io {
            key: "k".into(),
            source: std::io::Error::from_raw_os_error(28), // ENOSPC
        };
        assert!(matches!(blob_error(full), StoreError::Unavailable(_)));
        let invalid = BlobError::InvalidKey("../x".into());
        assert!(matches!(blob_error(invalid), StoreError::Backend(_)));
        let down = DbError::Sqlx(sqlx::Error::PoolTimedOut);
        assert!(matches!(db_error(down), StoreError::Unavailable(_)));
        assert!(matches!(
            db_error(DbError::LeaseLost("r".into())),
            StoreError::LeaseLost
        ));
        assert!(matches!(
            db_error(DbError::Corrupt("x".into())),
            StoreError::Backend(_)
        ));
    }
}
