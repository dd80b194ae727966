//! The task database and blob store as an enclave worker sees them (`JobStore`), and the job it
//! leases from them. The untrusted side implements the trait (in process: `confed`'s aggregation
//! store; over HTTP: the worker API), and everything it returns is untrusted input to the
//! enclave (`confed_enclave::worker` says how each part is checked).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use confed_attestation::release::ReleaseProof;
use confed_protocol::hpke::PublicKey;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use thiserror::Error;

use crate::manifest::Manifest;
use crate::optimizer::ServerOptimizer;
use crate::reads::BufferPool;

/// One leased aggregation job, as the untrusted store describes it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// The round's id.
    pub job_id: String,
    pub task_id: String,
    pub round: u64,
    /// The store's attempt counter: for logs only, nothing the enclave computes depends on it.
    pub attempt: u64,
    /// `worker~token`: the lease's holder, named by every later call under this lease (`renew`,
    /// `commit_release`, `commit_model`, `put_partition`, `fail`). The store writes a new one
    /// at every lease, so a worker that lost track of a lease and leased again no longer acts
    /// under the old one.
    pub lease_holder: String,
    pub key_id: String,
    pub public_key: PublicKey,
    /// The task policy text (`policy.rs`): the only source of the privacy parameters.
    pub policy: String,
    /// Model version `round - 1`.
    pub model: Vec<u8>,
    /// The task's server optimizer (post-processing of the release: it spends no privacy, so
    /// it may come from the store like the model does).
    pub optimizer: ServerOptimizer,
    /// The optimizer's state after round `round - 1` (None before its first round).
    pub optimizer_state: Option<Vec<u8>>,
    /// Adaptive clipping only: this round's clip norm (the previous release's `next_clip_norm`,
    /// or the policy's for round 1). Bound into the release commitment; privacy does not depend
    /// on it (`PrivacyParams::for_round`).
    pub clip_norm: Option<f64>,
    /// Whether the partner asked to evaluate this round on demand (the store's word: each device
    /// counts its own on-demand evaluations against the policy's `on_demand`, and the enclave
    /// charges that many; `PrivacyParams::for_round`).
    pub on_demand_evaluation: bool,
    /// Every completed contribution.
    pub contributions: Vec<JobContribution>,
    /// The committed release, when the round is already APPLYING.
    pub committed_average: Option<Vec<u8>>,
    /// BLT noise only: the sealed state round `round - 1` left (`None` in round 1). Opaque here:
    /// only the enclave can open it, and it refuses one not sealed by round `round - 1` of this
    /// task and policy.
    pub blt_state: Option<Vec<u8>>,
    /// A partitioned round's step: one partition to sum and seal, or the root that merges them
    /// (`None`: the whole round in one job).
    pub partitioning: Option<Partitioning>,
}

/// What a job of a partitioned round does (docs/architecture.md, "Partitioned rounds").
#[derive(Debug, Clone, PartialEq)]
pub enum Partitioning {
    /// Sum partition `index` of `count` of the round's inputs and store it sealed
    /// (`JobStore::put_partition`); release nothing.
    Partition { index: u32, count: u32 },
    /// Merge the `count` partitions' sealed results, fetched one at a time by their blob keys
    /// (`JobStore::fetch_sealed`; untrusted until the enclave opens and checks them: any
    /// missing, repeated or foreign one fails the merge), noise and release.
    Root {
        count: u32,
        sealed_keys: Vec<String>,
    },
}

/// Most partitions a round is cut into.
pub const MAX_PARTITIONS: u32 = 4096;

/// Fewest contributions a partition of a partitioned round may hold (the batches of the ODP
/// server's workers are 50). The enclave refuses a plan with smaller ones: the store chooses the
/// plan and can run a partition's job as often as it likes, so a partition of one contribution
/// would time that device's update alone (docs/threat-model.md, row 9).
pub const MIN_PARTITION_INPUTS: usize = 50;

/// The job id of partition `index` of the round whose job is `job_id` (job ids are UUIDs, which
/// hold no `.`): what its lease, renewals, failure and sealed result are addressed by.
pub fn partition_job_id(job_id: &str, index: u32) -> String {
    format!("{job_id}.p{index}")
}

/// A job id's round job id and, for a partition's, its index; `None` for a malformed suffix.
pub fn parse_job_id(job_id: &str) -> Option<(&str, Option<u32>)> {
    match job_id.split_once('.') {
        None => Some((job_id, None)),
        Some((round, suffix)) => {
            let index = suffix.strip_prefix('p')?;
            if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((round, Some(index.parse().ok()?)))
        }
    }
}

/// One completed contribution of a job, as the store lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobContribution {
    pub assignment_ref: String,
    pub blob_key: String,
    /// BLAKE3 of the stored bytes, as the server computed it when they arrived; `None` where it
    /// never saw them (a direct upload to the blob store), and the enclave digests them itself
    /// before it asks for the key. Untrusted like the rest of the job: the round's commitment
    /// names it, and a contribution whose bytes have another digest (or none) when it is opened
    /// fails the job, so whatever the store claims, the release is over the committed bytes.
    pub blake3: Option<[u8; 32]>,
}

/// What a worker hands the store to commit.
pub struct StagedRelease<'a> {
    pub average: &'a [u8],
    pub manifest: &'a Manifest,
    /// The enclave's signature and the key services' receipts.
    pub proof: &'a ReleaseProof,
    /// BLT noise only: the sealed state the round leaves for the next (its BLAKE3 is the
    /// manifest's `noise.blt.state_out_blake3`); committed with the release, atomically.
    pub blt_state: Option<&'a [u8]>,
}

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("the job's lease was taken over (by another worker, or by a newer lease of this one)")]
    LeaseLost,
    #[error("conflict: {0}")]
    Conflict(String),
    #[error("release refused: {0}")]
    Refused(String),
    /// The store cannot serve the call now (its database or blob store unreachable, a full
    /// disk): worth a retry, and no fault of the caller's or the store's code (503).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store: {0}")]
    Backend(String),
}

/// Reads contributions on the calling thread (`JobStore::blocking_fetch`).
pub trait BlockingFetch: Send + Sync {
    /// `JobStore::fetch_into`, on the calling thread.
    fn fetch_into(&self, blob_key: &str, buffer: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError>;
}

/// The two halves of a model commit with a server optimizer's state, which both sides of the
/// worker API offer (the store in the front end, the enclave's HTTP client):
/// `commit_model_in_order` runs them in the one order the store links them by.
pub trait ModelCommitSteps: Sync {
    /// Stores the optimizer's new `state` write-once under its SHA-256 next to the model version
    /// the job makes (`model`, whose header gives its size), and returns that digest (hex).
    fn stage_optimizer_state(
        &self,
        job_id: &str,
        holder: &str,
        state: &[u8],
        model: &[u8],
    ) -> impl Future<Output = Result<String, StoreError>> + Send;
    /// Stores `model` and commits it, linking the state staged under `optimizer_state_sha256`.
    fn put_model_linked(
        &self,
        job_id: &str,
        holder: &str,
        model: &[u8],
        optimizer_state_sha256: Option<&str>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A model commit (`JobStore::commit_model`): the optimizer's state first, stored write-once under
/// its digest, then the model, which names that digest, so the store links both in the model's
/// one commit and never commits a model whose state is missing.
pub async fn commit_model_in_order<S: ModelCommitSteps>(
    store: &S,
    job_id: &str,
    holder: &str,
    model: &[u8],
    optimizer_state: Option<&[u8]>,
) -> Result<(), StoreError> {
    let link = match optimizer_state {
        Some(state) => Some(
            store
                .stage_optimizer_state(job_id, holder, state, model)
                .await?,
        ),
        None => None,
    };
    store
        .put_model_linked(job_id, holder, model, link.as_deref())
        .await
}

/// `JobStore::fetch_batch` read one key after the other with `fetch_into` (its default).
pub fn fetch_each<'a, S: JobStore + ?Sized>(
    store: &'a S,
    keys: Vec<String>,
    buffers: &'a BufferPool,
) -> BoxStream<'a, Result<Option<Vec<u8>>, StoreError>> {
    futures_util::stream::iter(keys)
        .then(move |key| async move { store.fetch_into(&key, buffers.take()).await })
        .boxed()
}

/// The task database and blob store, as the enclave sees them. `lease` takes the worker's id
/// (`name/incarnation`); every later call under the lease names `JobSpec::lease_holder`.
pub trait JobStore: Send + Sync {
    fn lease(
        &self,
        worker: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<Option<JobSpec>, StoreError>> + Send;
    fn renew(
        &self,
        job_id: &str,
        holder: &str,
        lease: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// A contribution's stored bytes (`None` if missing).
    fn fetch(
        &self,
        blob_key: &str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;
    /// `fetch`, reading into `buffer` (a pooled one, whatever its length and contents) where the
    /// store can, so its memory is reused instead of a fresh allocation per contribution.
    fn fetch_into(
        &self,
        blob_key: &str,
        buffer: Vec<u8>,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send {
        drop(buffer);
        self.fetch(blob_key)
    }
    /// How many contributions `fetch_batch` reads in one exchange to pay off: 1 (the default)
    /// where each read stands alone, more where a store answers several in one request (the
    /// worker API: `batch`).
    fn batch_reads(&self) -> usize {
        1
    }
    /// The contributions `keys`, one item per key in the order named (`None` if missing), each
    /// read into a buffer from `buffers` where the store can. The default reads them one after
    /// the other with `fetch_into`. The caller checks that it got one item per key.
    fn fetch_batch<'a>(
        &'a self,
        keys: Vec<String>,
        buffers: &'a BufferPool,
    ) -> BoxStream<'a, Result<Option<Vec<u8>>, StoreError>> {
        fetch_each(self, keys, buffers)
    }
    /// A reader of contributions on the calling thread, for a store whose reads are local file
    /// reads (the in-process store over the contribution log): the worker then reads, checks and
    /// opens each contribution on one thread, with no hand-off between the steps. `None` (the
    /// default, and any store over a network): contributions are read with `fetch_into`.
    fn blocking_fetch(&self) -> Option<Arc<dyn BlockingFetch>> {
        None
    }
    /// Commits the round's release (AGGREGATING -> APPLYING), once.
    fn commit_release(
        &self,
        job_id: &str,
        holder: &str,
        release: StagedRelease<'_>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Stores model version `round` (with the server optimizer's new state, if it keeps one)
    /// and completes the round (APPLYING -> COMPLETED), opening the next round or completing
    /// the task.
    fn commit_model(
        &self,
        job_id: &str,
        holder: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// A partition's sealed result by its blob key (`Partitioning::Root`; `None` if missing).
    fn fetch_sealed(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, StoreError>> + Send;
    /// Stores a partition's sealed result (`Partitioning::Partition`; its lease holder only,
    /// once): when it is the round's last, the root can be leased.
    fn put_partition(
        &self,
        job_id: &str,
        holder: &str,
        sealed: &[u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Gives the job back: retried later, or (`permanent`) the round and task fail.
    fn fail(
        &self,
        job_id: &str,
        holder: &str,
        reason: &str,
        permanent: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
