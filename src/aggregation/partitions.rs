//! Partitioned rounds on the untrusted side (docs/architecture.md, "Partitioned rounds"): how
//! many partitions a round's job is cut into, and the store's part of them: leasing a partition,
//! storing its sealed result, and handing the root the keys of them all. Nothing here can open a
//! partition: it holds un-noised sums sealed under a key only an enclave with the round's key
//! derives, and the root checks every one of them.

use std::time::Duration;

use confed_worker_api::store::{
    MAX_PARTITIONS, MIN_PARTITION_INPUTS, StoreError, parse_job_id, partition_job_id,
};
use confed_worker_api::wire::{JobWire, PartitioningWire};

use super::{TaskDbJobStore, backend, blob_error, db_error};
use crate::blob::{BlobError, BlobKey, BlobStore, is_partition_key};
use crate::db::jobs::{JobContext, StoredContribution};
use crate::db::partitions::{LeasedPartition, StoredPartition};
use crate::db::{Db, DbError, Resumed};
use crate::states::RoundState;

/// How rounds are cut into partitions (`confed serve --partition-workers`,
/// `--partition-min-contributions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionPolicy {
    /// Enclave workers the deployment runs: a round is cut into at most this many partitions.
    /// 1, the default: never (one worker aggregates each round, as the embedded default does).
    pub workers: u32,
    /// Fewest contributions a partition sums (at least `MIN_PARTITION_INPUTS`, 50, which the
    /// enclave enforces): a smaller round stays one job, with no overhead.
    pub min_contributions: usize,
}

impl Default for PartitionPolicy {
    fn default() -> Self {
        Self {
            workers: 1,
            min_contributions: 1000,
        }
    }
}

impl PartitionPolicy {
    /// Whether every round is one job, whatever its size or task (one worker, the default).
    pub fn never_cuts(&self) -> bool {
        self.workers <= 1
    }

    /// The partitions of a round of `contributions`.
    pub fn partitions(&self, contributions: usize) -> u32 {
        if self.never_cuts() {
            return 1;
        }
        let by_size = contributions / self.min_contributions.max(MIN_PARTITION_INPUTS);
        by_size.clamp(1, self.workers.min(MAX_PARTITIONS) as usize) as u32
    }
}

impl PartitionPolicy {
    /// The partitions of a round of `contributions` of the task `spec`. A masked round's
    /// sealed partition holds a slot an input (what the key services need of it) besides its
    /// sum: it is cut into enough partitions that each one's slots stay within half the sealed
    /// partition's slack, or aggregated whole when that takes more partitions than allowed.
    pub fn partitions_of(&self, spec: &crate::task_spec::TaskSpec, contributions: usize) -> u32 {
        let count = self.partitions(contributions);
        let Some(line) = &spec.masking else {
            return count;
        };
        if count <= 1 {
            return 1;
        }
        let Ok(masking) = confed_protocol::masking_keys::MaskingPolicy::parse(line) else {
            tracing::warn!(
                "a masked task's masking line does not parse: its round is aggregated whole"
            );
            return 1;
        };
        let slot = confed_protocol::masking::partition_slot_bytes(&masking.layout());
        let per_partition = (PARTITION_SLACK_BYTES / 2 / slot).max(1);
        let needed = contributions.div_ceil(per_partition);
        match u32::try_from(needed) {
            Ok(needed) if needed <= count => count,
            Ok(needed) if needed <= self.workers.min(MAX_PARTITIONS) => needed,
            _ => {
                tracing::info!(
                    contributions,
                    workers = self.workers,
                    "a masked round is aggregated whole: its inputs' slots need more partitions than there are workers"
                );
                1
            }
        }
    }
}

/// Contributions read at once when the store digests direct uploads before partitioning.
const DIGEST_READS: usize = 8;
/// ... and recorded at once (1 GB of 1 MB contributions: about a second of reading).
const DIGEST_CHUNK: usize = 1024;
/// How long each recorded chunk extends the planner's lease on the job.
const PLANNING_LEASE: Duration = Duration::from_secs(120);

/// A sealed partition is a sum (8 bytes a value: twice the model's 4) and one byte per
/// contribution, and for a masked round one slot per contribution (within half of this:
/// `partitions_of`): its upload is bounded by twice the largest model plus this.
pub const PARTITION_SLACK_BYTES: usize = 64 << 20;

/// The largest sealed analytics table (docs/analytics.md, "Partitioned rounds"): an open
/// domain's `MAX_OPEN_KEYS` slots of the longest keys (64 bytes, a length byte and a count),
/// beyond a closed domain's 2^22 counts of 8 bytes.
pub const MAX_SEALED_TABLE_BYTES: usize = (confed_dp::analytics::MAX_OPEN_KEYS as usize)
    * (1 + confed_protocol::analytics::MAX_KEY_BYTES as usize + 8);

impl TaskDbJobStore {
    /// Plans a job its lease found not planned (`LeasedJob::plan`; a plan once made is kept until
    /// an operator's resume clears it with the job's partitions):
    /// `true` when it was cut into partitions, its lease then given back so that workers lease
    /// the partitions.
    pub(crate) async fn plan(
        &self,
        context: &JobContext,
        contributions: &[StoredContribution],
        worker: &str,
    ) -> Result<bool, StoreError> {
        let round_id = &context.round.id;
        if context.release.is_some() {
            return Ok(false);
        }
        let count = self
            .partitioning
            .partitions_of(&context.task.spec, contributions.len());
        if count > 1 {
            self.digest_direct_uploads(context, contributions, worker)
                .await?;
        }
        self.db
            .plan_job(round_id, worker, count)
            .await
            .map_err(db_error)?;
        if count > 1 {
            tracing::info!(round = %round_id, partitions = count, contributions = contributions.len(),
                "aggregation job cut into partitions");
        }
        Ok(count > 1)
    }

    /// Computes and records the digest of every contribution the server did not see arrive
    /// (direct uploads to the blob store), so that each partition's worker reads only its own
    /// range: without them, each would have to read and digest the whole round to compute its
    /// commitment. A contribution missing from the store stays without one (the enclave commits
    /// it as missing). The digests are claims like any the store lists: a wrong one fails the
    /// job, never changes a release.
    async fn digest_direct_uploads(
        &self,
        context: &JobContext,
        contributions: &[StoredContribution],
        worker: &str,
    ) -> Result<(), StoreError> {
        let undigested: Vec<(String, String)> = contributions
            .iter()
            .filter(|c| c.blake3_hex.is_none())
            .map(|c| (c.assignment_ref.clone(), c.blob_key.clone()))
            .collect();
        if undigested.is_empty() {
            return Ok(());
        }
        // In chunks, each recorded under the job's lease, which the recording renews: a large
        // round's digests survive a takeover, and its planner keeps the job while it reads.
        for chunk in undigested.chunks(DIGEST_CHUNK) {
            let digests = self.digest_chunk(chunk.to_vec()).await?;
            self.db
                .record_contribution_digests(&context.round.id, worker, digests, PLANNING_LEASE)
                .await
                .map_err(db_error)?;
        }
        Ok(())
    }

    /// The BLAKE3 (hex) of each of `chunk`'s contributions present in the store.
    async fn digest_chunk(
        &self,
        chunk: Vec<(String, String)>,
    ) -> Result<Vec<(String, String)>, StoreError> {
        use futures_util::StreamExt;
        let digests: Vec<Option<(String, String)>> = futures_util::stream::iter(chunk)
            .map(|(assignment_ref, blob_key)| async move {
                let key = BlobKey::new(blob_key).map_err(backend)?;
                match self.contributions.get_sealed_into(&key, Vec::new()).await {
                    Ok(bytes) => {
                        let digest = tokio::task::spawn_blocking(move || {
                            confed_protocol::hex::encode(blake3::hash(&bytes).as_bytes())
                        })
                        .await
                        .map_err(backend)?;
                        Ok(Some((assignment_ref, digest)))
                    }
                    Err(BlobError::NotFound(_)) => Ok(None),
                    Err(e) => Err(blob_error(e)),
                }
            })
            .buffer_unordered(DIGEST_READS)
            .collect::<Vec<Result<_, StoreError>>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        Ok(digests.into_iter().flatten().collect())
    }

    /// The root's part of a leased job's description: the keys of every partition's sealed
    /// result, when the job was partitioned and its release is not committed yet.
    pub(crate) async fn root_partitioning(
        &self,
        context: &JobContext,
    ) -> Result<Option<PartitioningWire>, StoreError> {
        if context.release.is_some() {
            return Ok(None);
        }
        let partitions = self
            .db
            .partitions(&context.round.id)
            .await
            .map_err(db_error)?;
        let Some(first) = partitions.first() else {
            return Ok(None);
        };
        let sealed_keys = partitions
            .iter()
            .map(|p| p.sealed_key.clone())
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| backend("a partition of the job is not stored yet"))?;
        Ok(Some(PartitioningWire::Root {
            count: first.count,
            sealed_keys,
        }))
    }

    /// Stores a partition's sealed result under its BLAKE3 and records it: only the partition's
    /// lease holder, only while its round is AGGREGATING. The bytes are the same whichever worker
    /// sealed the partition, so a second store of them is a no-op; and a partition sealed again
    /// after an operator's resume never collides with a stored copy that was damaged.
    pub async fn put_partition_sealed(
        &self,
        job_id: &str,
        worker: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        let (round_id, index) = partition_of(job_id)?;
        self.db
            .check_partition_lease(round_id, index, worker)
            .await
            .map_err(db_error)?;
        let context = self.db.job_context(round_id).await.map_err(db_error)?;
        if context.round.state != RoundState::Aggregating {
            return Err(StoreError::Conflict(format!(
                "round {} is {}, not AGGREGATING: its partitions are not being made",
                context.round.round_number,
                context.round.state.as_str()
            )));
        }
        let count = self
            .db
            .partitions(round_id)
            .await
            .map_err(db_error)?
            .first()
            .map(|p| p.count)
            .ok_or_else(|| backend("the job has no partitions"))?;
        let key = BlobKey::partition(
            &context.task.tenant_id,
            &context.task.id,
            context.round.round_number,
            context.round.attempt,
            index,
            count,
            &confed_protocol::hex::encode(blake3::hash(sealed).as_bytes()),
        )
        .map_err(backend)?;
        match self.blobs.put(&key, sealed).await {
            Ok(_) => {}
            // Named by its content: other bytes under the name are a corrupted store.
            Err(BlobError::Conflict(what)) => {
                return Err(StoreError::Conflict(format!(
                    "other bytes are stored under the partition's digest ({what})"
                )));
            }
            Err(e) => return Err(blob_error(e)),
        }
        self.db
            .store_partition(round_id, index, worker, key.as_str())
            .await
            .map_err(db_error)
    }

    /// `JobStore::renew` for either kind of job id.
    pub(crate) async fn renew_any(
        &self,
        job_id: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<(), StoreError> {
        match parse_job_id(job_id) {
            Some((round_id, Some(index))) => self
                .db
                .renew_partition(round_id, index, worker, lease)
                .await
                .map_err(db_error),
            _ => self
                .db
                .renew_job(job_id, worker, lease)
                .await
                .map_err(db_error),
        }
    }

    /// `JobStore::fail` for either kind of job id.
    pub(crate) async fn fail_any(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        match parse_job_id(job_id) {
            Some((round_id, Some(index))) => self
                .db
                .fail_partition(round_id, index, worker, reason, permanent)
                .await
                .map_err(db_error),
            _ => self
                .db
                .fail_job(job_id, worker, reason, permanent)
                .await
                .map_err(db_error),
        }
    }
}

/// A partition's job id split into its round's job id and its index.
fn partition_of(job_id: &str) -> Result<(&str, u32), StoreError> {
    match parse_job_id(job_id) {
        Some((round_id, Some(index))) => Ok((round_id, index)),
        _ => Err(StoreError::Refused(format!(
            "{job_id:?} is not a partition's job id (`<job id>.p<index>`)"
        ))),
    }
}

/// Resumes a failed round (`Db::resume_failed_round`), then deletes the sealed partitions of the
/// attempt that failed: the resumed round plans its partitions again, under its next attempt's
/// names, so nothing reads those any more.
pub async fn resume_failed_round(
    db: &Db,
    blobs: &dyn BlobStore,
    task_id: &str,
    round: i64,
) -> Result<Resumed, DbError> {
    let failed = db.round_partitions(task_id, round).await?;
    let resumed = db.resume_failed_round(task_id, round).await?;
    discard(blobs, &failed).await;
    Ok(resumed)
}

/// Deletes the stored sealed partitions among `partitions`, once nothing will read them (their
/// round completed, or was resumed under a new attempt). A partition holds a round's exact,
/// un-noised sums, sealed: sealed objects that outlive their use are still the one thing not to
/// keep. A failure is logged and left to the store's own expiry (GCS's lifecycle rule); the
/// local data directory would keep the object.
/// Only a key of `BlobKey::partition`'s shape is deleted: the keys come from the database, and
/// a row naming a model, release or state must not turn the cleanup into a delete of it.
pub(crate) async fn discard(blobs: &dyn BlobStore, partitions: &[StoredPartition]) {
    for sealed in partitions.iter().filter_map(|p| p.sealed_key.as_deref()) {
        if !is_partition_key(sealed) {
            tracing::warn!(
                key = sealed,
                "a partition row names an object that is not a sealed partition; not deleted"
            );
            continue;
        }
        let discarded = match BlobKey::new(sealed.to_string()) {
            Ok(key) => blobs.discard(&key).await,
            Err(e) => Err(e),
        };
        if let Err(error) = discarded {
            tracing::warn!(key = sealed, %error, "a sealed partition could not be deleted");
        }
    }
}

/// A leased partition described as a job of its own (`partition_job_id`), from its round's
/// job `wire`: it sums its range and seals the result, so it has no committed average to read.
pub(super) fn partition_wire(mut wire: JobWire, leased: LeasedPartition) -> JobWire {
    wire.job_id = partition_job_id(&wire.job_id, leased.index);
    wire.committed_average_key = None;
    wire.partitioning = Some(PartitioningWire::Partition {
        index: leased.index,
        count: leased.count,
    });
    wire.lease_holder = leased.holder;
    wire
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_cleanup_deletes_sealed_partitions_only_whatever_the_rows_say() {
        let dir = tempfile::tempdir().unwrap();
        let blobs = crate::blob::LocalBlobStore::open(dir.path()).unwrap();
        let partition = BlobKey::partition("a", "t", 1, 1, 0, 2, &"ab".repeat(32)).unwrap();
        let model = BlobKey::model("a", "t", 1, &"cd".repeat(32)).unwrap();
        for key in [&partition, &model] {
            blobs.put(key, b"bytes").await.unwrap();
        }
        let row = |key: &BlobKey| StoredPartition {
            index: 0,
            count: 2,
            sealed_key: Some(key.as_str().to_string()),
            lease_owner: None,
        };
        // A rewritten row names the model: it stays; the real partition goes.
        discard(&blobs, &[row(&model), row(&partition)]).await;
        assert!(dir.path().join(model.as_str()).exists());
        assert!(!dir.path().join(partition.as_str()).exists());
    }

    #[test]
    fn small_rounds_and_single_worker_deployments_stay_one_job() {
        let one_worker = PartitionPolicy::default();
        assert_eq!(one_worker.partitions(1_000_000), 1);
        let eight = PartitionPolicy {
            workers: 8,
            min_contributions: 1000,
        };
        assert_eq!(eight.partitions(999), 1);
        assert_eq!(eight.partitions(2500), 2);
        assert_eq!(eight.partitions(100_000), 8);
        // Never below the enclave's floor, whatever the operator asks.
        let tiny = PartitionPolicy {
            workers: 8,
            min_contributions: 1,
        };
        assert_eq!(tiny.partitions(99), 1);
        assert_eq!(tiny.partitions(100), 2);
    }

    /// A masking line of `n` key services of threshold `t`, each with a signed masking key.
    fn masking_line(n: usize, t: u8) -> String {
        use confed_protocol::masking_keys::{MaskingPolicy, MaskingService, sign_masking_key};
        let services = (1..=n)
            .map(|i| {
                let signer = confed_protocol::keyset::generate_signing_key();
                let (_, public) = confed_protocol::hpke::generate_keypair();
                let id = format!("ks{i}");
                MaskingService {
                    key: sign_masking_key(&signer, &id, &public),
                    verifying_key: confed_protocol::keyset::encode_verifying_key(
                        signer.verifying_key(),
                    ),
                    keyservice_id: id,
                }
            })
            .collect();
        MaskingPolicy::new(t, services).unwrap().encode()
    }

    #[test]
    fn a_masked_tasks_round_is_cut_so_that_each_partitions_slots_fit() {
        let request: crate::task_spec::CreateTaskRequest =
            serde_json::from_value(serde_json::json!({
                "population": "p", "rounds": 5, "report_goal": 100,
                "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0},
            }))
            .unwrap();
        let mut spec = request.validate().unwrap();
        let eight = PartitionPolicy {
            workers: 8,
            min_contributions: 1000,
        };
        assert_eq!(eight.partitions_of(&spec, 100_000), 8);
        // A masked round is cut as any, while its slots fit each partition; a line that does not
        // parse (never stored) keeps the round whole.
        let line = masking_line(3, 2);
        let slot = confed_protocol::masking::partition_slot_bytes(
            &confed_protocol::masking_keys::MaskingPolicy::parse(&line)
                .unwrap()
                .layout(),
        );
        spec.masking = Some(line);
        assert_eq!(eight.partitions_of(&spec, 100_000), 8);
        // More inputs than 8 partitions' slots hold: more partitions, if the workers allow.
        let many = 9 * (PARTITION_SLACK_BYTES / 2 / slot);
        let sixteen = PartitionPolicy {
            workers: 16,
            min_contributions: 1000,
        };
        assert_eq!(sixteen.partitions_of(&spec, many), 16);
        // Partitions of at least 100,000 by size (4 of them), but 9 for the slots.
        let large = PartitionPolicy {
            workers: 16,
            min_contributions: 100_000,
        };
        assert_eq!(large.partitions(many), 4);
        assert_eq!(large.partitions_of(&spec, many), 9);
        assert_eq!(eight.partitions_of(&spec, many), 1);
        spec.masking = Some("confed-masking/v1;threshold=2;services=...".into());
        assert_eq!(eight.partitions_of(&spec, 100_000), 1);
    }
}
