//! A worker that reads over the network starts the open step's reads with the key request
//! (`enclave/src/worker/ahead.rs`): with a budget, contributions are read before the open step's
//! first lease renewal, each once, and the round completes with every contribution; without one,
//! nothing is read before the open.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): what this tells apart is the order of a
//! worker's reads and renewals, the same over either engine; uploads straight to GCS are listed
//! without a digest and read (and the lease renewed) before the key, so the order of calls could
//! not tell the reads during the key from that first read, and each is read twice (the library
//! keeps none from its first read).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::system::{collect, now_clock, open_task, start_with};
use confed_enclave::remote::HttpJobStore;
use confed_enclave::worker::Worker;
use confed_worker_api::reads::BufferPool;
use confed_worker_api::store::{JobSpec, JobStore, StagedRelease, StoreError};
use futures_util::stream::BoxStream;
use zeroize::Zeroizing;

const TOKEN: &str = "worker-token-for-tests-0123456789abcdefghij";

/// The worker API's store, noting the order of its reads and lease renewals.
struct Noting {
    inner: HttpJobStore,
    calls: Mutex<Vec<&'static str>>,
    /// Every key a batch of reads named.
    read: Mutex<Vec<String>>,
}

impl Noting {
    fn note(&self, call: &'static str) {
        self.calls.lock().unwrap().push(call);
    }

    /// Whether the first batch of reads was asked for before the first renewal (the open
    /// step's first call).
    fn read_before_the_open(&self) -> bool {
        let calls = self.calls.lock().unwrap();
        let first = |name| calls.iter().position(|call| *call == name);
        let (read, renew) = (first("read"), first("renew"));
        assert!(read.is_some() && renew.is_some(), "{calls:?}");
        read < renew
    }
}

impl JobStore for Noting {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        self.inner.lease(worker, lease).await
    }
    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        self.note("renew");
        self.inner.renew(job_id, worker, lease).await
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.fetch(blob_key).await
    }
    fn batch_reads(&self) -> usize {
        self.inner.batch_reads()
    }
    fn fetch_batch<'a>(
        &'a self,
        keys: Vec<String>,
        buffers: &'a BufferPool,
    ) -> BoxStream<'a, Result<Option<Vec<u8>>, StoreError>> {
        self.note("read");
        self.read.lock().unwrap().extend(keys.iter().cloned());
        self.inner.fetch_batch(keys, buffers)
    }
    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        self.inner.commit_release(job_id, worker, release).await
    }
    async fn commit_model(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        self.inner
            .commit_model(job_id, worker, model, optimizer_state)
            .await
    }
    async fn fetch_sealed(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.fetch_sealed(key).await
    }
    async fn put_partition(
        &self,
        job_id: &str,
        worker: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        self.inner.put_partition(job_id, worker, sealed).await
    }
    async fn fail(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        self.inner.fail(job_id, worker, reason, permanent).await
    }
}

/// A round over the worker API by a worker holding up to `budget` bytes before the open:
/// whether it read before the open step, once the round completed with every contribution.
async fn round_read_before_the_open(budget: usize) -> bool {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    open_task(&system, "ahead", 8.0).await;
    collect(&system, "ahead", 3, false).await;
    let store = Arc::new(Noting {
        inner: HttpJobStore::new(
            &system.url,
            Zeroizing::new(TOKEN.to_string()),
            Duration::from_secs(30),
        ),
        calls: Mutex::new(Vec::new()),
        read: Mutex::new(Vec::new()),
    });
    let worker =
        Worker::new(Arc::clone(&store), system.worker_config("ahead-1")).read_ahead_bytes(budget);
    let outcome = worker.run_once().await.unwrap().expect("a job");
    assert_eq!(
        (outcome.round, outcome.included),
        (1, common::system::GOAL as u64),
        "every contribution opened once"
    );
    let mut read = store.read.lock().unwrap().clone();
    read.sort();
    let count = read.len();
    read.dedup();
    assert_eq!(
        (count, read.len()),
        (common::system::GOAL, common::system::GOAL),
        "each contribution read once"
    );
    system.shutdown().await;
    store.read_before_the_open()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_budget_reads_while_its_key_is_fetched() {
    assert!(round_read_before_the_open(64 << 20).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_without_a_budget_reads_only_in_the_open_step() {
    assert!(!round_read_before_the_open(0).await);
}
