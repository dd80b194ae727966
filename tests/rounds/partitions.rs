//! Partitioned rounds end to end, in one process (docs/architecture.md, "Partitioned rounds"):
//! the store cuts a round into partitions, a worker of its own seals each, and the root merges
//! them into the release one worker would make; a partition whose worker died is leased again,
//! and nothing is counted twice. On SQLite, and on PostgreSQL + GCS when CI provides them.

use crate::common;

use std::time::Duration;

use common::system::{collect, collect_n, now_clock, open_task, open_task_of, start_partitioned};
use confed::aggregation::partitions::PartitionPolicy;
use confed_enclave::worker::{Phases, round_context};
use confed_worker_api::model::validate_model;
use confed_worker_api::store::{JobSpec, JobStore, Partitioning, StoreError};

const LEASE: Duration = Duration::from_secs(60);

/// Contributions of the tests' rounds: two partitions of the enclave's smallest (50).
const DEVICES: usize = 100;

/// Rounds of at least 100 contributions cut into up to 4 partitions of 50 or more: the tests'
/// 100 into 2.
fn partitioned() -> PartitionPolicy {
    PartitionPolicy {
        workers: 4,
        min_contributions: 50,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_in_two_partitions_releases_the_bytes_one_worker_would() {
    releases_the_one_worker_bytes(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_in_four_partitions_releases_the_bytes_one_worker_would() {
    releases_the_one_worker_bytes(4).await;
}

/// A round of `partitions` x 50 contributions, cut into `partitions`.
async fn releases_the_one_worker_bytes(partitions: u32) {
    let devices = 50 * partitions as usize;
    let clock = now_clock();
    let (system, _dir) = start_partitioned(clock.clone(), None, None, partitioned()).await;
    let (_, task) = open_task_of(&system, "parts", 50.0, devices).await;
    collect_n(&system, "parts", 1, false, devices).await;
    // A worker per partition (the first lease planned the round). A partition's job says
    // nothing of its contributions' outcomes: only the release does.
    let mut sealed = Vec::new();
    for worker in 0..partitions {
        let outcome = system
            .worker(&format!("w{worker}"))
            .run_once()
            .await
            .unwrap()
            .unwrap();
        let (index, count) = outcome.partition.expect("a partition's job");
        assert_eq!(count, partitions);
        sealed.push(index);
        assert_eq!((outcome.included, outcome.excluded), (0, 0));
        assert_eq!(outcome.epsilon_spent, None);
    }
    sealed.sort();
    assert_eq!(sealed, (0..partitions).collect::<Vec<_>>());
    // The root, as the store describes it: every partition's sealed result.
    let root = system.store.lease("probe", LEASE).await.unwrap().unwrap();
    let Some(Partitioning::Root { count, sealed_keys }) = &root.partitioning else {
        panic!("the root's job, got {:?}", root.partitioning);
    };
    assert_eq!(
        (*count, sealed_keys.len()),
        (partitions, partitions as usize)
    );
    // One worker over the same committed inputs, and the root over the partitions: the same
    // bytes (and the same commitment, so the key services release the key for both).
    let probe = system.worker("probe");
    let (policy, context) = round_context(&root).unwrap();
    let schema = validate_model(&root.model).unwrap();
    let whole_job = JobSpec {
        partitioning: None,
        ..root.clone()
    };
    let (whole, _) = probe
        .aggregate(
            &whole_job,
            &schema,
            &policy,
            context.clone(),
            &mut Phases::default(),
        )
        .await
        .unwrap();
    let (merged, _) = probe
        .aggregate(&root, &schema, &policy, context, &mut Phases::default())
        .await
        .unwrap();
    assert_eq!(merged.average, whole.average);
    assert_eq!(merged.manifest.to_json(), whole.manifest.to_json());
    assert_eq!(merged.manifest.included, devices as u64);
    // Partitions, root and one worker commit to the inputs and the sampler alike.
    assert_eq!(
        merged.manifest.inputs_digest,
        common::system::gaussian_inputs_digest(&root)
    );
    // The probe's lease lapses; a worker takes the root and commits those bytes.
    clock.advance(LEASE + Duration::from_secs(1));
    let outcome = system.worker("w1").run_once().await.unwrap().unwrap();
    assert_eq!(
        (outcome.partition, outcome.included),
        (None, devices as u64)
    );
    let releases = system.db.releases_of_task(&task).await.unwrap();
    assert_eq!(
        releases[0].manifest_json.as_bytes(),
        &whole.manifest.to_json()[..]
    );
    let average = system.store.blob(&releases[0].average_key).await.unwrap();
    assert_eq!(average.as_deref(), Some(&whole.average[..]));
    // The round is complete: its sealed partitions are deleted from the data directory (a GCS
    // bucket expires them by its lifecycle rule instead).
    if common::gcs::emulator().is_none() {
        for key in sealed_keys {
            assert_eq!(system.store.fetch_sealed(key).await.unwrap(), None, "{key}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_whose_worker_died_is_leased_again_and_nothing_counts_twice() {
    let clock = now_clock();
    let (system, _dir) = start_partitioned(clock.clone(), None, None, partitioned()).await;
    let (_, task) = open_task_of(&system, "failover", 50.0, DEVICES).await;
    collect_n(&system, "failover", 1, false, DEVICES).await;
    // A worker leases the first partition and dies holding it.
    let dead = system.store.lease("dead", LEASE).await.unwrap().unwrap();
    assert_eq!(
        dead.partitioning,
        Some(Partitioning::Partition { index: 0, count: 2 })
    );
    let outcome = system.worker("w2").run_once().await.unwrap().unwrap();
    assert_eq!(outcome.partition, Some((1, 2)));
    // Neither the dead worker's partition nor the root can be leased while its lease runs.
    assert!(system.store.lease("w5", LEASE).await.unwrap().is_none());
    clock.advance(LEASE + Duration::from_secs(1));
    let again = system.worker("w5").run_once().await.unwrap().unwrap();
    assert_eq!(again.partition, Some((0, 2)));
    // The dead worker, back, can store nothing (its lease was taken over), nor can anyone
    // store under a round's own job id.
    assert!(matches!(
        system
            .store
            .put_partition(&dead.job_id, &dead.lease_holder, b"x")
            .await,
        Err(StoreError::LeaseLost)
    ));
    let round_job = dead.job_id.split_once('.').unwrap().0.to_string();
    assert!(matches!(
        system.store.put_partition(&round_job, "w5", b"x").await,
        Err(StoreError::Refused(_))
    ));
    let root = system.worker("w2").run_once().await.unwrap().unwrap();
    assert_eq!(
        (root.partition, root.included, root.excluded),
        (None, DEVICES as u64, 0)
    );
    // Every contribution once: the manifest's digest is over the round's distinct refs.
    common::system::assert_released_every_contribution_once(&system, &task, DEVICES).await;
}

/// A partition's transient failure puts the whole job on its backoff; a permanent one fails the
/// round and the task; the operator's resume plans the round afresh (its partitions sealed
/// again, whatever was stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitions_failure_backs_off_its_job_or_fails_the_round_and_a_resume_replans_it() {
    let clock = now_clock();
    let (system, _dir) = start_partitioned(clock.clone(), None, None, partitioned()).await;
    let (token, task) = open_task_of(&system, "flaky", 50.0, DEVICES).await;
    collect_n(&system, "flaky", 1, false, DEVICES).await;
    let first = system.store.lease("a", LEASE).await.unwrap().unwrap();
    system
        .store
        .fail(
            &first.job_id,
            &first.lease_holder,
            "a key service was down",
            false,
        )
        .await
        .unwrap();
    // Backing off: neither partition, nor the root, is leasable for 2 s.
    assert!(system.store.lease("b", LEASE).await.unwrap().is_none());
    clock.advance(Duration::from_secs(3));
    let again = system.store.lease("b", LEASE).await.unwrap().unwrap();
    assert_eq!(again.job_id, first.job_id);
    // Sealed and stored by one worker, then the other partition fails for good.
    let stored = system.worker("c").run_once().await.unwrap().unwrap();
    assert_eq!(stored.partition, Some((1, 2)));
    system
        .store
        .fail(
            &again.job_id,
            &again.lease_holder,
            "the model is invalid",
            true,
        )
        .await
        .unwrap();
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "FAILED", "{states:?}");
    assert!(system.store.lease("d", LEASE).await.unwrap().is_none());
    // Resumed: planned again at the next lease, every partition to seal anew; the failed
    // attempt's sealed partition is deleted (locally; GCS's lifecycle rule expires it).
    let failed = system.db.round_partitions(&task, 1).await.unwrap();
    let stale = failed[1]
        .sealed_key
        .clone()
        .expect("partition 1 was stored");
    confed::aggregation::partitions::resume_failed_round(
        &system.db,
        system.store.blobs.as_ref(),
        &task,
        1,
    )
    .await
    .unwrap();
    let left = system.store.fetch_sealed(&stale).await.unwrap();
    assert_eq!(left.is_none(), common::gcs::emulator().is_none());
    assert!(
        system
            .db
            .round_partitions(&task, 1)
            .await
            .unwrap()
            .is_empty()
    );
    for _ in 0..2 {
        let outcome = system.worker("e").run_once().await.unwrap().unwrap();
        assert!(outcome.partition.is_some());
    }
    let root = system.worker("e").run_once().await.unwrap().unwrap();
    assert_eq!((root.partition, root.included), (None, DEVICES as u64));
}

/// A worker that restarts under its name (a new incarnation) takes its partition back at once,
/// as it does a job; a worker of another name waits for the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_takes_its_partition_back_at_once() {
    let (system, _dir) = start_partitioned(now_clock(), None, None, partitioned()).await;
    open_task_of(&system, "restart", 50.0, DEVICES).await;
    collect_n(&system, "restart", 1, false, DEVICES).await;
    let before = system.store.lease("vm-1/a", LEASE).await.unwrap().unwrap();
    let other = system.store.lease("vm-2/a", LEASE).await.unwrap().unwrap();
    assert_ne!(other.job_id, before.job_id);
    assert!(system.store.lease("vm-3/a", LEASE).await.unwrap().is_none());
    let after = system.store.lease("vm-1/b", LEASE).await.unwrap().unwrap();
    assert_eq!(after.job_id, before.job_id);
    assert!(matches!(
        system
            .store
            .renew(&before.job_id, &before.lease_holder, LEASE)
            .await,
        Err(StoreError::LeaseLost)
    ));
}

/// The worker API's partition route: only the partition's lease holder stores (409 for anyone
/// else, 422 for a round's own job id or an unknown partition). What it stores is not checked
/// there (the store cannot open it): a forged partition fails the root's merge, and the round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partition_route_fences_and_a_forged_partition_fails_the_merge() {
    const TOKEN: &str = "worker-token-for-partition-tests-0123456789";
    let (system, _dir) = start_partitioned(now_clock(), Some(TOKEN), None, partitioned()).await;
    let (token, task) = open_task_of(&system, "forged", 50.0, DEVICES).await;
    collect_n(&system, "forged", 1, false, DEVICES).await;
    let held = system.store.lease("holder", LEASE).await.unwrap().unwrap();
    let put = |job: String, worker: String, body: &'static [u8]| {
        let url = system.url.clone();
        async move {
            let response = reqwest::Client::new()
                .put(format!(
                    "{url}/internal/v1/jobs/{job}/partition?worker={worker}"
                ))
                .bearer_auth(TOKEN)
                .body(body)
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let holder = held.lease_holder.clone();
    let (status, body) = put(held.job_id.clone(), "intruder~0123".into(), b"x").await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("lease-lost"), "{body}");
    // The worker's bare id is no lease holder: a 400 that says to send the lease's holder.
    let (status, body) = put(held.job_id.clone(), "holder".into(), b"x").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("lease_holder"), "{body}");
    let round_job = held.job_id.split_once('.').unwrap().0.to_string();
    assert_eq!(put(round_job, holder.clone(), b"x").await.0, 422);
    let unknown = "00000000-0000-4000-8000-000000000000.p0".to_string();
    assert_eq!(put(unknown, holder.clone(), b"x").await.0, 422);
    // The holder stores bytes that are no sealed partition; the other is sealed honestly.
    assert_eq!(put(held.job_id.clone(), holder, b"forged").await.0, 204);
    let honest = system.worker("honest").run_once().await.unwrap().unwrap();
    assert!(honest.partition.is_some());
    let root = system.worker("root").run_once().await;
    assert!(
        matches!(
            &root,
            Err(confed_enclave::worker::JobError::Partition(
                confed_enclave::aggregate::partition::PartitionError::Malformed(_)
            ))
        ),
        "{root:?}"
    );
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "FAILED", "{states:?}");
    assert!(system.db.releases_of_task(&task).await.unwrap().is_empty());
}

/// A BLT task's rounds partitioned: each round's root continues the state the previous round's
/// root left (the partitions bind the same state into the one commitment), and the chain holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_blt_rounds_continue_the_state_chain() {
    let (system, _dir) = start_partitioned(now_clock(), None, None, partitioned()).await;
    let token = system.tenant("tenant-blt").await.unwrap();
    let privacy = serde_json::json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
                                      "mechanism": "blt", "min_separation": 1});
    let task = common::system::create_task_with(
        &system.url,
        &token,
        "blt-parts",
        8.0,
        DEVICES,
        serde_json::json!({"privacy": privacy}),
    )
    .await;
    let worker = system.worker("w");
    for round in 1..=2u64 {
        collect_n(&system, "blt-parts", round, false, DEVICES).await;
        let mut partitions = 0;
        let released = loop {
            let outcome = worker.run_once().await.unwrap().expect("a job");
            match outcome.partition {
                Some(_) => partitions += 1,
                None => break outcome,
            }
        };
        assert_eq!((partitions, released.round), (2, round));
        assert_eq!(released.included, DEVICES as u64);
    }
    let releases = system.db.releases_of_task(&task).await.unwrap();
    let blt = |i: usize| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(&releases[i].manifest_json).unwrap()["noise"]
            ["blt"]
            .clone()
    };
    assert_eq!(blt(0)["state_in_blake3"], serde_json::Value::Null);
    assert_eq!(blt(1)["state_in_blake3"], blt(0)["state_out_blake3"]);
}

/// A store that lost its sealed partitions (they are listed, but not served).
struct LostPartitions(std::sync::Arc<confed::aggregation::TaskDbJobStore>);

impl JobStore for LostPartitions {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        self.0.lease(worker, lease).await
    }
    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        self.0.renew(job_id, worker, lease).await
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.0.fetch(blob_key).await
    }
    async fn fetch_sealed(&self, _: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(None)
    }
    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: confed_worker_api::store::StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        self.0.commit_release(job_id, worker, release).await
    }
    async fn commit_model(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        state: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        self.0.commit_model(job_id, worker, model, state).await
    }
    async fn put_partition(
        &self,
        job_id: &str,
        worker: &str,
        sealed: &[u8],
    ) -> Result<(), StoreError> {
        self.0.put_partition(job_id, worker, sealed).await
    }
    async fn fail(
        &self,
        job_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), StoreError> {
        self.0.fail(job_id, worker, reason, permanent).await
    }
}

/// A sealed partition the store lists but no longer has is never sealed again by itself: the
/// round fails at once (a resume seals them anew) instead of retrying forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_sealed_partition_fails_the_round_instead_of_retrying_forever() {
    let (system, _dir) = start_partitioned(now_clock(), None, None, partitioned()).await;
    let (token, task) = open_task_of(&system, "lost", 50.0, DEVICES).await;
    collect_n(&system, "lost", 1, false, DEVICES).await;
    for worker in ["w1", "w2"] {
        let outcome = system.worker(worker).run_once().await.unwrap().unwrap();
        assert!(outcome.partition.is_some());
    }
    let root = confed_enclave::worker::Worker::new(
        std::sync::Arc::new(LostPartitions(system.store.clone())),
        system.worker_config("root"),
    );
    let failed = root.run_once().await;
    assert!(
        matches!(
            &failed,
            Err(confed_enclave::worker::JobError::Partition(
                confed_enclave::aggregate::partition::PartitionError::NotStored(_)
            ))
        ),
        "{failed:?}"
    );
    let states = common::system::rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "FAILED", "{states:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_round_stays_one_job() {
    let (system, _dir) = start_partitioned(
        now_clock(),
        None,
        None,
        PartitionPolicy {
            workers: 4,
            min_contributions: 1000,
        },
    )
    .await;
    open_task(&system, "small", 50.0).await;
    collect(&system, "small", 1, true).await;
    let job = system.store.lease("w1", LEASE).await.unwrap().unwrap();
    assert_eq!(job.partitioning, None);
    assert!(!job.job_id.contains('.'));
}
