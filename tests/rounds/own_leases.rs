//! A worker that lost track of a lease it holds takes it back at once, and its old lease is
//! fenced off (issue 47): a lease's holder is `worker~token`, a new token at every lease, and a
//! worker asks for a lease only when it holds none, so a lease still under its name is one it
//! lost. Before, a worker took a lease back only from another incarnation of its name and waited
//! out its own (60 s by default). On SQLite, and on PostgreSQL when CI provides it.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::system::{
    collect, collect_n, now_clock, open_task, open_task_of, start_partitioned, start_with,
};
use confed::aggregation::partitions::PartitionPolicy;
use confed::clock::Clock;
use confed_enclave::remote::HttpJobStore;
use confed_enclave::worker::Worker;
use confed_worker_api::store::{JobSpec, JobStore, StagedRelease, StoreError};
use serde_json::{Value, json};
use zeroize::Zeroizing;

const TOKEN: &str = "worker-token-for-own-lease-tests-0123456789";

/// The task database as a worker sees it while the database is down from the model update on:
/// nothing can be written, the worker's report of its failure included.
struct DatabaseDownAtModelUpdate {
    inner: Arc<confed::aggregation::TaskDbJobStore>,
    down: AtomicBool,
    /// The last lease's job and holder.
    leased: std::sync::Mutex<Option<(String, String)>>,
}

impl DatabaseDownAtModelUpdate {
    fn unreachable(&self) -> Result<(), StoreError> {
        if self.down.load(Ordering::SeqCst) {
            return Err(StoreError::Backend(
                "error communicating with database: Connection refused (os error 111)".into(),
            ));
        }
        Ok(())
    }
}

impl JobStore for DatabaseDownAtModelUpdate {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        self.unreachable()?;
        let job = self.inner.lease(worker, lease).await?;
        if let Some(job) = &job {
            *self.leased.lock().unwrap() = Some((job.job_id.clone(), job.lease_holder.clone()));
        }
        Ok(job)
    }
    async fn renew(&self, job_id: &str, holder: &str, lease: Duration) -> Result<(), StoreError> {
        self.unreachable()?;
        self.inner.renew(job_id, holder, lease).await
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.fetch(blob_key).await
    }
    async fn commit_release(
        &self,
        job_id: &str,
        holder: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        self.unreachable()?;
        let committed = self.inner.commit_release(job_id, holder, release).await;
        // PostgreSQL stops right after the release's commit, during the model update.
        self.down.store(true, Ordering::SeqCst);
        committed
    }
    async fn commit_model(
        &self,
        job_id: &str,
        holder: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        self.unreachable()?;
        self.inner
            .commit_model(job_id, holder, model, optimizer_state)
            .await
    }
    async fn fetch_sealed(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.fetch_sealed(key).await
    }
    async fn put_partition(
        &self,
        job_id: &str,
        holder: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        self.unreachable()?;
        self.inner.put_partition(job_id, holder, sealed).await
    }
    async fn fail(
        &self,
        job_id: &str,
        holder: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        self.unreachable()?;
        self.inner.fail(job_id, holder, reason, permanent).await
    }
}

/// The database stops during the model update: the worker can record neither the model nor its
/// failure, so its lease stays in the database. Once the database is back, the same worker
/// takes the job back at once (no clock moves here: a 60 s lease never expires) and completes
/// the round from its committed release; the lease it lost is fenced off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_could_not_record_its_failure_takes_its_job_back_at_once() {
    let (system, _dir) = start_with(now_clock(), None).await;
    let (token, task) = open_task(&system, "db-down", 8.0).await;
    collect(&system, "db-down", 1, false).await;
    let store = Arc::new(DatabaseDownAtModelUpdate {
        inner: system.store.clone(),
        down: AtomicBool::new(false),
        leased: Default::default(),
    });
    let worker = Worker::new(store.clone(), system.worker_config("enclave-a/1"));
    let failed = worker.run_once().await;
    assert!(
        matches!(&failed, Err(error) if error.to_string().contains("Connection refused")),
        "{failed:?}"
    );
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "APPLYING", "{states:?}");
    let (job_id, lost) = store.leased.lock().unwrap().clone().expect("a lease");

    store.down.store(false, Ordering::SeqCst);
    let outcome = worker
        .run_once()
        .await
        .unwrap()
        .expect("its own job back at once, not a lease later");
    assert_eq!(outcome.round, 1);
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED", "{states:?}");
    assert_eq!(system.db.releases_of_task(&task).await.unwrap().len(), 1);
    // Whatever the old lease still sends is refused: the takeover wrote a new holder.
    assert!(matches!(
        system
            .store
            .renew(&job_id, &lost, Duration::from_secs(60))
            .await,
        Err(StoreError::LeaseLost)
    ));
}

/// A worker API lease the front end wrote but never answered (the front end was killed right
/// after writing it).
async fn lease_answer_lost(url: &str, worker: &str) -> Value {
    let answer = reqwest::Client::new()
        .post(format!("{url}/internal/v1/jobs/lease"))
        .bearer_auth(TOKEN)
        .json(&json!({"worker": worker, "lease_seconds": 60}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    answer.json().await.unwrap()
}

/// The front end is killed just after writing two partition leases, and its answers never reach
/// the two workers. Once it is back, each worker leases again and gets its own partition back
/// at once (the clock never moves), the root merges them, and the round releases; the lost
/// answers' holders can store nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_leases_whose_answers_were_lost_are_taken_back_at_once() {
    const DEVICES: usize = 100;
    let policy = PartitionPolicy {
        workers: 4,
        min_contributions: 50,
    };
    let (system, _dir) = start_partitioned(now_clock(), Some(TOKEN), None, policy).await;
    let (token, task) = open_task_of(&system, "killed-front-end", 50.0, DEVICES).await;
    collect_n(&system, "killed-front-end", 1, false, DEVICES).await;
    let lost = [
        lease_answer_lost(&system.url, "vm-1/a").await,
        lease_answer_lost(&system.url, "vm-2/a").await,
    ];
    let partitions = system.db.round_partitions(&task, 1).await.unwrap();
    assert_eq!(partitions.len(), 2);
    assert!(partitions.iter().all(|p| p.lease_owner.is_some()));

    let remote = || {
        Arc::new(HttpJobStore::new(
            &system.url,
            Zeroizing::new(TOKEN.to_string()),
            Duration::from_secs(30),
        ))
    };
    let workers = ["vm-1/a", "vm-2/a"].map(|id| Worker::new(remote(), system.worker_config(id)));
    let mut sealed = Vec::new();
    for worker in &workers {
        let outcome = worker
            .run_once()
            .await
            .unwrap()
            .expect("its own partition back at once, not a lease later");
        sealed.push(outcome.partition.expect("a partition").0);
    }
    sealed.sort();
    assert_eq!(sealed, [0, 1]);
    let root = workers[0].run_once().await.unwrap().expect("the root");
    assert_eq!((root.partition, root.included), (None, DEVICES as u64));
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED", "{states:?}");
    // The answers that never arrived name holders the takeover fenced off.
    let store = remote();
    for answer in &lost {
        let stored = store
            .put_partition(
                answer["job_id"].as_str().unwrap(),
                answer["lease_holder"].as_str().unwrap(),
                b"late",
            )
            .await;
        assert!(matches!(stored, Err(StoreError::LeaseLost)), "{stored:?}");
    }
}

/// The reclaim is one's own only: another worker, or a bare name, still waits for the lease,
/// and a worker that keeps losing its job takes it back at most three times in a row before
/// waiting for it like anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_holder_takes_its_lease_back_and_only_a_few_times() {
    let clock = now_clock();
    let (system, _dir) = start_with(clock.clone(), None).await;
    open_task(&system, "own", 8.0).await;
    collect(&system, "own", 1, false).await;
    const LEASE_MS: i64 = 60_000;
    const LEASE: Duration = Duration::from_millis(LEASE_MS as u64);
    let first = system.db.lease_job("solo", LEASE).await.unwrap().unwrap();
    for other in ["other", "other/1", "sol", "solo/1"] {
        let taken = system.db.lease_job(other, LEASE).await.unwrap();
        assert!(taken.is_none(), "{other} took {first:?}");
    }
    let mut holders = vec![first.holder.clone()];
    for _ in 0..3 {
        let again = system.db.lease_job("solo", LEASE).await.unwrap();
        holders.push(again.expect("its own lease back").holder);
    }
    holders.dedup();
    assert_eq!(holders.len(), 4, "a new holder at every lease: {holders:?}");
    assert!(
        system.db.lease_job("solo", LEASE).await.unwrap().is_none(),
        "a fourth immediate takeover waits for the lease"
    );
    for stale in &holders[..3] {
        assert!(matches!(
            system.db.renew_job(&first.round_id, stale, LEASE).await,
            Err(confed::db::DbError::LeaseLost(_))
        ));
        assert!(matches!(
            system
                .db
                .fail_job(&first.round_id, stale, "late", false)
                .await,
            Err(confed::db::DbError::LeaseLost(_))
        ));
    }
}

/// A lease request the worker gave up on (a long poll still served after the worker's client
/// timed out, here or on another replica) keeps asking: it must not take back the lease the
/// worker's newer request got, or the two would take the job from each other. Only a request
/// that arrived no earlier than the one that wrote the lease takes it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_request_the_worker_gave_up_on_cannot_take_back_its_retrys_lease() {
    let clock = now_clock();
    let (system, _dir) = start_with(clock.clone(), None).await;
    open_task(&system, "retried", 8.0).await;
    collect(&system, "retried", 1, false).await;
    const LEASE_MS: i64 = 60_000;
    const LEASE: Duration = Duration::from_millis(LEASE_MS as u64);
    let gave_up = clock.now_millis().0;
    clock.advance(Duration::from_secs(30));
    let retry_arrived = clock.now_millis().0;
    let retry = system
        .db
        .lease_job_for("enclave-a/1", retry_arrived, LEASE)
        .await
        .unwrap()
        .expect("the retry's lease");
    clock.advance(Duration::from_millis(500));
    let now = clock.now_millis().0;
    let stale = system
        .db
        .lease_job_for("enclave-a/1", gave_up, LEASE)
        .await
        .unwrap();
    assert!(stale.is_none(), "the old request took {stale:?}");
    system
        .db
        .renew_job(&retry.round_id, &retry.holder, LEASE)
        .await
        .expect("the retry still holds its lease");
    // A later request of the same worker (it lost the retry's answer too) takes it back.
    let later = system
        .db
        .lease_job_for("enclave-a/1", now, LEASE)
        .await
        .unwrap()
        .expect("taken back by a newer request");
    assert_ne!(later.holder, retry.holder);
}
