//! The operator of the front ends, the task database and the blob store as the attacker (issue
//! 12), against the embedded system with its real key services and an in-process enclave worker.
//! The operator's power is modelled exactly: it chooses what the job store tells the enclave (the
//! job row, the stored bytes) and whether the database "forgets" a committed round. Each test is
//! named for the attack and asserts that it yields nothing new: an identical release, or none.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::system::{GOAL, collect, now_clock, open_task_with, start};
use confed::aggregation::TaskDbJobStore;
use confed_enclave::worker::{JobError, Worker};
use confed_protocol::policy::TaskPolicy;
use confed_worker_api::manifest::Manifest;
use confed_worker_api::reads::BufferPool;
use confed_worker_api::store::{
    BlockingFetch, JobSpec, JobStore, StagedRelease, StoreError, fetch_each,
};
use futures_util::stream::BoxStream;
use serde_json::json;
use std::sync::atomic::Ordering::Relaxed;

/// What the enclave says of a contribution the store did not serve as committed.
const NOT_COMMITTED: &str = "not the bytes the round's commitment names";

type Edit = Box<dyn Fn(&mut JobSpec) + Send + Sync>;

/// The job store as a malicious operator runs it.
struct Operator {
    inner: Arc<TaskDbJobStore>,
    /// Edits every leased job (the database row).
    edit: Mutex<Option<Edit>>,
    /// A job handed out again, as if the round had been reset in the database.
    replay: Mutex<Option<JobSpec>>,
    /// The last job leased from the real store.
    leased: Mutex<Option<JobSpec>>,
    /// Every release the enclave handed over (average, manifest).
    releases: Mutex<Vec<(Vec<u8>, Manifest)>>,
    /// What it does to contribution reads, the asynchronous ones and the blocking ones alike.
    reads: Arc<Reads>,
    /// Whether it offers the worker reads on the calling thread (as the in-process store over
    /// the contribution log does), so the worker takes its other open path.
    blocking_reads: std::sync::atomic::AtomicBool,
    /// Contributions it answers per batch of reads, as the worker API does (0: one by one).
    batch: std::sync::atomic::AtomicUsize,
    /// Serves every batch of more than one contribution without its last.
    short_batches: std::sync::atomic::AtomicBool,
    /// Answers a batch of reads and never its bytes, and from then on refuses renewals as if
    /// another worker had taken the lease over.
    stall_batches: std::sync::atomic::AtomicBool,
    lease_taken: std::sync::atomic::AtomicBool,
}

/// What the operator does to contribution reads.
#[derive(Default)]
struct Reads {
    /// (blob key, bytes) served instead of what is stored.
    swap: Mutex<Option<(String, Vec<u8>)>>,
    /// Which read (1 or 2) of one contribution, the first the worker asks for, serves what
    /// instead of the stored bytes.
    tamper: Mutex<Option<(usize, Tamper)>>,
    /// The contribution `tamper` applies to: the first blob key fetched.
    victim: Mutex<Option<String>>,
    /// Reads of each contribution so far.
    counts: Mutex<std::collections::HashMap<String, usize>>,
}

impl Reads {
    /// The bytes served instead of `blob_key`'s, when it is the swapped one.
    fn swapped(&self, blob_key: &str) -> Option<Vec<u8>> {
        match self.swap.lock().unwrap().as_ref() {
            Some((key, bytes)) if key == blob_key => Some(bytes.clone()),
            _ => None,
        }
    }

    /// Counts a read of `blob_key` and serves `stored` as the operator chose.
    fn serve(&self, blob_key: &str, stored: Option<Vec<u8>>) -> Option<Vec<u8>> {
        let read = {
            let mut counts = self.counts.lock().unwrap();
            let count = counts.entry(blob_key.to_string()).or_default();
            *count += 1;
            *count
        };
        let victim = self
            .victim
            .lock()
            .unwrap()
            .get_or_insert_with(|| blob_key.to_string())
            == blob_key;
        match *self.tamper.lock().unwrap() {
            Some((at, Tamper::Missing)) if victim && at == read => None,
            Some((at, Tamper::Garbled)) if victim && at == read => stored.map(|mut bytes| {
                let last = bytes.len() - 1;
                bytes[last] ^= 1;
                bytes
            }),
            _ => stored,
        }
    }
}

/// The operator's reads on the calling thread, over the real store's.
struct BlockingReads {
    reads: Arc<Reads>,
    inner: Arc<dyn BlockingFetch>,
}

impl BlockingFetch for BlockingReads {
    fn fetch_into(&self, blob_key: &str, buffer: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(bytes) = self.reads.swapped(blob_key) {
            return Ok(Some(bytes));
        }
        let stored = self.inner.fetch_into(blob_key, buffer)?;
        Ok(self.reads.serve(blob_key, stored))
    }
}

#[derive(Clone, Copy, Debug)]
enum Tamper {
    /// As if the object were gone.
    Missing,
    /// The stored bytes with one flipped (the envelope no longer opens).
    Garbled,
}

impl Operator {
    fn new(inner: Arc<TaskDbJobStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            edit: Mutex::default(),
            replay: Mutex::default(),
            leased: Mutex::default(),
            releases: Mutex::default(),
            reads: Arc::default(),
            blocking_reads: Default::default(),
            batch: Default::default(),
            short_batches: Default::default(),
            stall_batches: Default::default(),
            lease_taken: Default::default(),
        })
    }

    fn replaying(&self) -> bool {
        self.replay.lock().unwrap().is_some()
    }
}

impl JobStore for Operator {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        let replay = self.replay.lock().unwrap().clone();
        let mut job = match replay {
            Some(job) => job,
            None => match self.inner.lease(worker, lease).await? {
                Some(job) => {
                    *self.leased.lock().unwrap() = Some(job.clone());
                    job
                }
                None => return Ok(None),
            },
        };
        if let Some(edit) = self.edit.lock().unwrap().as_ref() {
            edit(&mut job);
        }
        Ok(Some(job))
    }
    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        if self.lease_taken.load(Relaxed) {
            return Err(StoreError::LeaseLost);
        }
        if self.replaying() {
            return Ok(());
        }
        self.inner.renew(job_id, worker, lease).await
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        if let Some(bytes) = self.reads.swapped(blob_key) {
            return Ok(Some(bytes));
        }
        let stored = self.inner.fetch(blob_key).await?;
        Ok(self.reads.serve(blob_key, stored))
    }
    fn batch_reads(&self) -> usize {
        self.batch.load(Relaxed).max(1)
    }
    fn fetch_batch<'a>(
        &'a self,
        keys: Vec<String>,
        buffers: &'a BufferPool,
    ) -> BoxStream<'a, Result<Option<Vec<u8>>, StoreError>> {
        if self.stall_batches.load(Relaxed) {
            self.lease_taken.store(true, Relaxed);
            return futures_util::StreamExt::boxed(futures_util::stream::pending());
        }
        let served = if self.short_batches.load(Relaxed) && keys.len() > 1 {
            keys.len() - 1
        } else {
            keys.len()
        };
        fetch_each(self, keys.into_iter().take(served).collect(), buffers)
    }
    fn blocking_fetch(&self) -> Option<Arc<dyn BlockingFetch>> {
        if !self.blocking_reads.load(Relaxed) {
            return None;
        }
        Some(Arc::new(BlockingReads {
            reads: Arc::clone(&self.reads),
            inner: self.inner.blocking_fetch()?,
        }))
    }
    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        self.releases
            .lock()
            .unwrap()
            .push((release.average.to_vec(), release.manifest.clone()));
        if self.replaying() {
            return Ok(());
        }
        self.inner.commit_release(job_id, worker, release).await
    }
    async fn commit_model(
        &self,
        job_id: &str,
        worker: &str,
        model: &[u8],
        optimizer_state: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        if self.replaying() {
            return Ok(());
        }
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
        if self.replaying() {
            return Ok(());
        }
        self.inner.fail(job_id, worker, reason, permanent).await
    }
}

struct Scene {
    system: confed::embedded::EmbeddedSystem,
    _dir: tempfile::TempDir,
    operator: Arc<Operator>,
    worker: Worker<Operator>,
}

/// The embedded system with a task whose first round holds `GOAL` contributions, of which a
/// release needs `GOAL - 2` (so excluding one contribution would still release).
async fn scene(population: &str) -> (Scene, String) {
    let (system, dir) = start(now_clock()).await;
    let min_reports = GOAL - 2;
    let (_, task) = open_task_with(
        &system,
        population,
        8.0,
        json!({"min_reports": min_reports}),
    )
    .await;
    collect(&system, population, 3, false).await;
    let operator = Operator::new(system.store.clone());
    let worker = Worker::new(operator.clone(), system.worker_config("w"));
    (
        Scene {
            system,
            _dir: dir,
            operator,
            worker,
        },
        task,
    )
}

/// Runs the leased round 1 to its end.
async fn run_round_1(scene: &Scene) {
    scene
        .worker
        .run_once()
        .await
        .unwrap()
        .expect("round 1 runs");
}

/// Completes round 1 honestly; then resets it (replays its job) with `edit` applied.
async fn complete_then_replay(scene: &Scene, edit: Edit) -> Result<(), JobError> {
    run_round_1(scene).await;
    assert_eq!(scene.operator.releases.lock().unwrap().len(), 1);
    let mut job = scene.operator.leased.lock().unwrap().clone().unwrap();
    job.committed_average = None;
    *scene.operator.replay.lock().unwrap() = Some(job);
    *scene.operator.edit.lock().unwrap() = Some(edit);
    scene.worker.run_once().await.map(drop)
}

fn refused_by_the_ledger(error: &JobError) -> bool {
    error.to_string().contains("release_ledger")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerunning_a_completed_round_after_a_database_reset_releases_identical_bytes() {
    let (scene, _) = scene("reset").await;
    complete_then_replay(&scene, Box::new(|_| {}))
        .await
        .unwrap();
    let releases = scene.operator.releases.lock().unwrap().clone();
    assert_eq!(releases.len(), 2);
    assert_eq!(
        releases[0].0, releases[1].0,
        "the same noised average, byte for byte"
    );
    assert_eq!(releases[0].1, releases[1].1);
    scene.system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_attempt_number_releases_identical_bytes() {
    let (scene, _) = scene("attempt").await;
    complete_then_replay(&scene, Box::new(|job| job.attempt = 9))
        .await
        .unwrap();
    let releases = scene.operator.releases.lock().unwrap().clone();
    assert_eq!(releases[0].0, releases[1].0);
    scene.system.shutdown().await;
}

/// Whether this pass runs on the GCS emulator, where devices upload straight to the bucket.
fn uploads_are_direct() -> bool {
    common::gcs::emulator().is_some()
}

/// As a direct upload to the blob store would be listed: without the digest the server computes
/// for an upload through it, so the worker reads and digests the bytes itself before the key.
fn without_digests(job: &mut JobSpec) {
    for contribution in &mut job.contributions {
        contribution.blake3 = None;
    }
}

/// An envelope the operator sealed itself, with the public key, for the assignment ref of the
/// job's first contribution (it knows the round's policy and model hashes): a zero update.
async fn forged_for_first(scene: &Scene, task: &str, job: &JobSpec) -> Vec<u8> {
    let victim_ref = &job.contributions[0].assignment_ref;
    let context = scene.system.db.round_context(task, 1).await.unwrap();
    let zero = confed_worker_api::model::validate_model(&job.model).unwrap();
    let values = vec![0f32; zero.parameter_count()];
    let update = confed_enclave::aggregate::encode(&zero, &values).unwrap();
    let aad = confed_enclave::envelope::aad(&context, victim_ref);
    let (enc, ct) = confed_enclave::hpke_awslc::seal(
        &job.public_key,
        &confed_enclave::envelope::info(&job.key_id),
        &aad,
        &update,
    )
    .unwrap();
    confed_protocol::envelope::Envelope {
        key_id: job.key_id.clone(),
        encapsulated_key: enc,
        ciphertext: ct,
        chunk: None,
        token: None,
        seeds: None,
    }
    .to_cbor()
}

/// The attack that recovered a device's update before: replace one stored envelope with one the
/// operator sealed with the public key for the same assignment ref, list the digest of its bytes
/// (or none, so the worker digests what it reads), and run the round again. The inputs differ, so
/// the commitment differs, and the key services refuse it for a round already committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_envelope_for_a_committed_round_is_refused_by_the_key_services() {
    for (population, listed) in [("swap-listed", true), ("swap-unlisted", false)] {
        let (scene, task) = scene(population).await;
        scene.worker.run_once().await.unwrap().unwrap();
        let job = scene.operator.leased.lock().unwrap().clone().unwrap();
        let forged = forged_for_first(&scene, &task, &job).await;
        let forged_digest = *blake3::hash(&forged).as_bytes();
        let victim_key = job.contributions[0].blob_key.clone();
        *scene.operator.reads.swap.lock().unwrap() = Some((victim_key, forged));
        let mut replay = job.clone();
        replay.committed_average = None;
        if listed {
            replay.contributions[0].blake3 = Some(forged_digest);
        } else {
            without_digests(&mut replay);
        }
        *scene.operator.replay.lock().unwrap() = Some(replay);
        let error = scene.worker.run_once().await.unwrap_err();
        assert!(refused_by_the_ledger(&error), "{population}: {error}");
        assert_eq!(
            scene.operator.releases.lock().unwrap().len(),
            1,
            "{population}: no second release"
        );
        scene.system.shutdown().await;
    }
}

/// The differencing attack on a committed round's reads: the key services commit to the inputs
/// (and the noise is keyed by them) as the job lists their digests, or as the worker's first read
/// digested them; then the store makes one contribution disappear, or serves it garbled so it
/// no longer opens, or the job lists another digest than the stored bytes have. Had the enclave
/// excluded that contribution, the release (the round needs `GOAL - 2`) would differ from an
/// honest one by that device's update under the same noise. It refuses instead: nothing is
/// released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contributions_not_served_as_committed_release_nothing() {
    let cases: [(&str, bool, Option<Tamper>, bool); 5] = [
        ("listed-missing", true, Some(Tamper::Missing), false),
        ("listed-garbled", true, Some(Tamper::Garbled), false),
        ("listed-wrong-digest", true, None, true),
        ("reread-missing", false, Some(Tamper::Missing), false),
        ("reread-garbled", false, Some(Tamper::Garbled), false),
    ];
    // Each case on both open paths: reads handed across threads (a store over the network, one
    // by one and in batches of two as over the worker API), and each core reading, checking and
    // opening on its own (the in-process store over the contribution log; it has no blocking
    // reads over GCS, whose reads are asynchronous only).
    let paths = [(false, 0), (false, 2), (true, 0)];
    for ((population, listed, tamper, wrong_digest), (blocking, batch)) in cases
        .into_iter()
        .flat_map(|case| paths.map(move |path| (case, path)))
    {
        if listed && uploads_are_direct() {
            continue; // no digest is listed for a direct upload: the local pass covers these
        }
        let population = format!(
            "{population}-{}-{batch}",
            if blocking { "blocking" } else { "async" }
        );
        let (scene, _) = scene(&population).await;
        scene.operator.blocking_reads.store(blocking, Relaxed);
        scene.operator.batch.store(batch, Relaxed);
        // Over GCS the real store has no blocking reads: both runs take the asynchronous path.
        // The contribution log always offers them.
        let offered = scene.operator.inner.blocking_fetch().is_some();
        assert!(offered || uploads_are_direct(), "{population}");
        assert_eq!(
            scene.operator.blocking_fetch().is_some(),
            blocking && offered,
            "{population}"
        );
        // A listed contribution is read once (after the key); an unlisted one is digested on
        // the first read and opened from the second.
        *scene.operator.reads.tamper.lock().unwrap() =
            tamper.map(|tamper| (if listed { 1 } else { 2 }, tamper));
        *scene.operator.edit.lock().unwrap() = Some(Box::new(move |job| {
            if !listed {
                without_digests(job);
            }
            if wrong_digest {
                job.contributions[0].blake3 = Some([7; 32]);
            }
        }));
        let error = scene.worker.run_once().await.unwrap_err().to_string();
        assert!(error.contains(NOT_COMMITTED), "{population}: {error}");
        assert!(scene.operator.releases.lock().unwrap().is_empty());
        scene.system.shutdown().await;
    }
}

/// A contribution uploaded through the server is read once: the job lists the BLAKE3 the server
/// computed as it arrived. Without those digests (as for direct uploads) the worker reads each
/// twice, or once if it keeps the round in memory; all three commit to the same inputs and
/// release the same bytes (the digest names the bytes, whoever computed it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listed_digests_read_each_contribution_once_and_release_the_same_bytes() {
    // On both open paths: reads handed across threads (one by one, and in batches of two as
    // over the worker API), and each core reading on its own.
    for (blocking, batch) in [(false, 0), (false, 2), (true, 0)] {
        reads_and_releases(blocking, batch).await;
    }
}

async fn reads_and_releases(blocking: bool, batch: usize) {
    let (scene, _) = scene(&format!(
        "listed-{}-{batch}",
        if blocking { "blocking" } else { "async" }
    ))
    .await;
    scene.operator.blocking_reads.store(blocking, Relaxed);
    scene.operator.batch.store(batch, Relaxed);
    if uploads_are_direct() {
        // Devices upload straight to the bucket: the server never sees the bytes, lists no
        // digest, and the worker reads and digests each contribution itself.
        run_round_1(&scene).await;
        let job = scene.operator.leased.lock().unwrap().clone().unwrap();
        assert!(job.contributions.iter().all(|c| c.blake3.is_none()));
        scene.system.shutdown().await;
        return;
    }
    run_round_1(&scene).await;
    let reads = |expected: usize| {
        let reads = scene.operator.reads.counts.lock().unwrap().clone();
        assert_eq!(reads.len(), GOAL);
        assert!(
            reads.values().all(|&n| n == expected),
            "{expected}: {reads:?}"
        );
    };
    reads(1);
    let mut job = scene.operator.leased.lock().unwrap().clone().unwrap();
    assert!(job.contributions.iter().all(|c| c.blake3.is_some()));
    job.committed_average = None;
    without_digests(&mut job);
    *scene.operator.replay.lock().unwrap() = Some(job);
    let keeping = Worker::new(scene.operator.clone(), scene.system.worker_config("keeper"))
        .retain_bytes(usize::MAX);
    keeping.run_once().await.unwrap();
    reads(2);
    scene.worker.run_once().await.unwrap();
    reads(4);
    let releases = scene.operator.releases.lock().unwrap().clone();
    assert_eq!(releases.len(), 3);
    assert!(
        releases
            .iter()
            .all(|r| r.0 == releases[0].0 && r.1 == releases[0].1)
    );
    scene.system.shutdown().await;
}

/// A store that answers several contributions per read (as the worker API does) serves a batch
/// with its last contribution left out: the worker fails the job rather than release a sum
/// without a contribution the commitment names, whether the batch was the read after the key
/// (contributions listed with their digests) or the first read that digests them (as for
/// direct uploads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_reads_served_short_releases_nothing() {
    for listed in [true, false] {
        let (scene, _) = scene(&format!("short-batch-{listed}")).await;
        scene.operator.batch.store(2, Relaxed);
        scene.operator.short_batches.store(true, Relaxed);
        if !listed {
            *scene.operator.edit.lock().unwrap() = Some(Box::new(without_digests));
        }
        let error = scene.worker.run_once().await.unwrap_err().to_string();
        let expected = if listed && !uploads_are_direct() {
            NOT_COMMITTED
        } else {
            "fewer contributions than a batch of reads named"
        };
        assert!(error.contains(expected), "listed {listed}: {error}");
        assert!(scene.operator.releases.lock().unwrap().is_empty());
        scene.system.shutdown().await;
    }
}

/// A store that stalls mid-batch (it answers a batch's request, then never its bytes) while the
/// job's lease is taken over: the worker renews on time, not only as contributions complete, so
/// it learns its lease is lost and stops, instead of waiting on the stalled read for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stalled_mid_batch_renews_on_time_and_stops_when_its_lease_is_lost() {
    if uploads_are_direct() {
        // Contributions then have a first read (their digests, before the key), which renews
        // between its batches and waits out a stalled read on the store's own timeout (the
        // worker API client's: each wait for the server); this is the open step's case.
        return;
    }
    let (scene, _) = scene("stalled-batch").await;
    scene.operator.batch.store(2, Relaxed);
    scene.operator.stall_batches.store(true, Relaxed);
    let mut config = scene.system.worker_config("stalled");
    // Renewed every quarter lease: 400 ms.
    config.lease = Duration::from_millis(1600);
    let worker = Worker::new(scene.operator.clone(), config);
    let outcome = tokio::time::timeout(Duration::from_secs(60), worker.run_once())
        .await
        .expect("the worker stops instead of waiting on the stalled batch");
    let error = outcome.unwrap_err().to_string();
    assert!(error.contains("lease was taken over"), "{error}");
    assert!(scene.operator.releases.lock().unwrap().is_empty());
    scene.system.shutdown().await;
}

/// Privacy parameters changed in the database before the round is aggregated: the enclave takes
/// the changed policy, but every contribution is bound to the devices' policy, so nothing opens
/// and nothing is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn privacy_parameters_changed_in_the_database_open_nothing() {
    type Change = fn(&mut TaskPolicy);
    let edits: [(&str, Change); 3] = [
        ("clip", |p| p.clip_norm = 4.0),
        ("epsilon", |p| p.epsilon = 50.0),
        ("rounds", |p| p.rounds = 30),
    ];
    for (population, change) in edits {
        let (scene, _) = scene(population).await;
        *scene.operator.edit.lock().unwrap() = Some(Box::new(move |job: &mut JobSpec| {
            let mut policy = TaskPolicy::parse(&job.policy).unwrap();
            change(&mut policy);
            job.policy = policy.encode();
        }));
        let error = scene.worker.run_once().await.unwrap_err();
        assert!(
            error.to_string().contains(&format!(
                "no contribution of the round was valid ({GOAL} excluded)"
            )),
            "{population}: {error}"
        );
        assert!(
            scene.operator.releases.lock().unwrap().is_empty(),
            "{population}"
        );
        scene.system.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_beyond_the_plan_is_refused() {
    let (scene, _) = scene("beyond").await;
    *scene.operator.edit.lock().unwrap() = Some(Box::new(|job: &mut JobSpec| job.round = 4));
    let error = scene.worker.run_once().await.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("outside the task's 3 planned rounds"),
        "{error}"
    );
    assert!(scene.operator.releases.lock().unwrap().is_empty());
    scene.system.shutdown().await;
}

/// A holder of the worker token commits a release the enclave did not make: an average of its
/// choice, a manifest that names the right policy and model, an enclave signature and receipts
/// made with keys of its own. The front end verifies the proof and refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_committed_with_the_worker_token_but_no_valid_receipts_is_refused() {
    let (scene, task) = scene("forge").await;
    let store = &scene.system.store;
    let job = store
        .lease("forger", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    let (average, manifest, proof) = common::forgery::forged_release(&scene.system, &job).await;
    let refused = store
        .commit_release(
            &job.job_id,
            "forger",
            StagedRelease {
                average: &average,
                manifest: &manifest,
                proof: &proof,
                blt_state: None,
            },
        )
        .await;
    let Err(StoreError::Refused(why)) = refused else {
        panic!("a forged release was accepted: {refused:?}");
    };
    assert!(why.contains("0 of the 3 receipts"), "{why}");
    assert!(
        scene
            .system
            .db
            .releases_of_task(&task)
            .await
            .unwrap()
            .is_empty()
    );
    scene.system.shutdown().await;
}
