//! End to end, in one process: key services, APIs, simulated devices and enclave workers over
//! SQLite and the blob directory. Rounds go from encrypted uploads to released, noised averages
//! and new model versions, exactly once, also when a worker dies or stalls.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::system::{GOAL, collect, get, now_clock, open_task, rounds, start};

use confed::tools::simulate;
use confed_worker_api::manifest::Manifest;
use confed_worker_api::store::{JobSpec, JobStore, StagedRelease, StoreError};
use serde_json::{Value, json};

fn model_values(bytes: &[u8]) -> Vec<f32> {
    let schema = confed_worker_api::model::validate_model(bytes).unwrap();
    confed_enclave::updater::average_values(&schema, bytes).unwrap()
}

fn params_len() -> usize {
    model_values(&simulate::initial_model(7)).len()
}

/// The round's key, reconstructed from the ceremony's share files (test only: the point of the
/// system is that nothing outside the enclave does this).
fn round_key(dir: &std::path::Path) -> confed_protocol::hpke::PrivateKey {
    let mut shares = Vec::new();
    for entry in std::fs::read_dir(dir.join("data/ceremony")).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("share-")
        {
            shares.push(confed::keys::ShareFile::load(&path).unwrap().share);
        }
    }
    let refs: Vec<&[u8]> = shares.iter().map(|s| &s[..]).collect();
    let secret = confed_protocol::shares::combine(2, &refs[..2]).unwrap();
    confed_protocol::hpke::PrivateKey::from_bytes(&secret).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_rounds_complete_with_consistent_manifests_and_a_model_that_follows_the_updates() {
    let (system, dir) = start(now_clock()).await;
    let (token, task) = open_task(&system, "e2e", 50.0).await;
    let worker = system.worker("w1");
    let key = round_key(dir.path());
    for round in 1..=3u64 {
        collect(&system, "e2e", round, true).await;
        // What the devices really sent: the clipped mean, from their ciphertexts.
        let contributions = system
            .db
            .completed_contributions(&task, round as i64)
            .await
            .unwrap();
        assert_eq!(contributions.len(), GOAL);
        let params = model_values(&simulate::initial_model(7)).len();
        let mut mean = vec![0f64; params];
        let mut refs = Vec::new();
        let mut listed = Vec::new();
        let context = system.db.round_context(&task, round as i64).await.unwrap();
        for (assignment_ref, blob_key) in &contributions {
            let stored = system.store.fetch(blob_key).await.unwrap().unwrap();
            listed.push((assignment_ref.clone(), *blake3::hash(&stored).as_bytes()));
            let envelope = confed_protocol::envelope::Envelope::from_cbor(&stored).unwrap();
            let plain =
                confed_enclave::envelope::open(&key, &envelope, &context, assignment_ref).unwrap();
            let update = model_values(&plain);
            let norm = update
                .iter()
                .map(|v| f64::from(*v).powi(2))
                .sum::<f64>()
                .sqrt();
            let clip = (1.0 / norm).min(1.0);
            for (m, v) in mean.iter_mut().zip(&update) {
                *m += f64::from(*v) * clip / GOAL as f64;
            }
            refs.push(assignment_ref.clone());
        }

        let outcome = worker.run_once().await.unwrap().expect("a job was ready");
        assert_eq!(
            (outcome.round, outcome.included, outcome.excluded),
            (round, GOAL as u64, 0)
        );

        let states = rounds(&system, &token, &task).await;
        assert_eq!(
            states[round as usize - 1]["state"],
            "COMPLETED",
            "{states:?}"
        );
        let before = get(
            &system,
            &token,
            &format!("/v1/tasks/{task}/models/{}", round - 1),
        )
        .await;
        let after = get(&system, &token, &format!("/v1/tasks/{task}/models/{round}")).await;
        assert_eq!(after.status(), 200);
        let (before, after) = (
            model_values(&before.bytes().await.unwrap()),
            model_values(&after.bytes().await.unwrap()),
        );

        let releases = system.db.releases_of_task(&task).await.unwrap();
        assert_eq!(releases.len(), round as usize);
        let manifest: Manifest =
            serde_json::from_str(&releases[round as usize - 1].manifest_json).unwrap();
        refs.sort();
        assert_eq!(manifest.included, GOAL as u64);
        assert_eq!(
            manifest.included_digest,
            confed_enclave::aggregate::digest(&refs)
        );
        assert!(manifest.excluded.is_empty());
        assert!(manifest.privacy.epsilon_spent <= 50.0);
        // The inputs digest as protocol.md writes it: every contribution in ref order, then (a
        // Gaussian round) the sampler its noise is drawn with.
        listed.sort();
        let mut inputs = blake3::Hasher::new();
        for (assignment_ref, digest) in &listed {
            inputs.update(assignment_ref.as_bytes());
            inputs.update(&[1]);
            inputs.update(digest);
        }
        let inputs = inputs.finalize().to_hex();
        let named = blake3::hash(format!("{inputs}sampler=steps-v1").as_bytes());
        assert_eq!(manifest.inputs_digest, named.to_hex().as_str());

        // The model moved by learning rate 1 x (the devices' clipped mean + noise of the
        // recorded size), and in the devices' direction.
        let moved: Vec<f64> = after
            .iter()
            .zip(&before)
            .map(|(a, b)| f64::from(a - b))
            .collect();
        let off: f64 = moved
            .iter()
            .zip(&mean)
            .map(|(m, t)| (m - t).powi(2))
            .sum::<f64>()
            .sqrt();
        let expected_noise = manifest.noise.stddev_average * (params as f64).sqrt();
        assert!(
            off < 2.0 * expected_noise + 1e-3,
            "off by {off}, noise ~{expected_noise}"
        );
        let dot: f64 = moved.iter().zip(&mean).map(|(m, t)| m * t).sum();
        assert!(dot > 0.0, "the model moved against the devices' updates");
    }
    // The partner sees each round's release and can download its noised average.
    let listed = get(&system, &token, &format!("/v1/tasks/{task}/releases"))
        .await
        .text()
        .await
        .unwrap();
    // The list carries each manifest as the exact bytes the enclave signed (a parse and
    // re-serialisation once came back one ULP off in a float).
    for round in 1..=3 {
        let exact = get(
            &system,
            &token,
            &format!("/v1/tasks/{task}/releases/{round}/manifest"),
        )
        .await
        .text()
        .await
        .unwrap();
        assert!(
            listed.contains(&exact),
            "round {round}'s manifest was rewritten"
        );
    }
    let releases: Value = serde_json::from_str(&listed).unwrap();
    let releases = releases["releases"].as_array().unwrap();
    assert_eq!(releases.len(), 3);
    assert_eq!(releases[2]["round"], 3);
    assert_eq!(releases[2]["included"], GOAL);
    assert_eq!(releases[2]["manifest"]["format"], "confed-release/v2");
    let average = get(
        &system,
        &token,
        &format!("/v1/tasks/{task}/releases/2/average"),
    )
    .await;
    assert_eq!(average.status(), 200);
    let etag = average.headers()["etag"].to_str().unwrap().to_string();
    assert_eq!(
        etag,
        format!("\"{}\"", releases[1]["average_sha256"].as_str().unwrap())
    );
    assert_eq!(
        model_values(&average.bytes().await.unwrap()).len(),
        params_len()
    );
    let none = get(
        &system,
        &token,
        &format!("/v1/tasks/{task}/releases/9/average"),
    )
    .await;
    assert_eq!(none.status(), 404);
    let other = system.tenant("someone-else").await.unwrap();
    assert_eq!(
        get(&system, &other, &format!("/v1/tasks/{task}/releases"))
            .await
            .status(),
        404
    );

    let task_state: Value = get(&system, &token, &format!("/v1/tasks/{task}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(task_state["state"], "COMPLETED");
    assert!(worker.run_once().await.unwrap().is_none());
    system.shutdown().await;
}

/// A worker that dies after writing its release to the blob store and before the database
/// commit: it reports nothing (a dead process cannot), and keeps what it staged.
struct DiesBeforeCommit {
    inner: Arc<confed::aggregation::TaskDbJobStore>,
    staged: std::sync::Mutex<Option<Vec<u8>>>,
}

impl JobStore for DiesBeforeCommit {
    async fn lease(&self, worker: &str, lease: Duration) -> Result<Option<JobSpec>, StoreError> {
        self.inner.lease(worker, lease).await
    }
    async fn renew(&self, job_id: &str, worker: &str, lease: Duration) -> Result<(), StoreError> {
        self.inner.renew(job_id, worker, lease).await
    }
    async fn fetch(&self, blob_key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.fetch(blob_key).await
    }
    async fn commit_release(
        &self,
        job_id: &str,
        worker: &str,
        release: StagedRelease<'_>,
    ) -> Result<(), StoreError> {
        if let Some(state) = release.blt_state {
            self.inner.put_blt_state(job_id, worker, state).await?;
        }
        self.inner
            .stage_release(
                job_id,
                StagedRelease {
                    average: release.average,
                    manifest: release.manifest,
                    proof: release.proof,
                    blt_state: release.blt_state,
                },
            )
            .await?;
        *self.staged.lock().unwrap() = Some(release.average.to_vec());
        Err(StoreError::Backend(
            "killed between noising and commit".into(),
        ))
    }
    async fn commit_model(
        &self,
        _: &str,
        _: &str,
        _: &[u8],
        _: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        unreachable!("the worker died before")
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
    async fn fail(&self, _: &str, _: &str, _: &str, _: bool) -> Result<(), StoreError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_noising_and_commit_leads_to_one_identical_release() {
    killed_between_noising_and_commit("crash", json!({})).await;
}

/// The same under BLT noise, where the manifest names the sealed state: the retry seals the same
/// state byte for byte (the release was staged under write-once names), so it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blt_worker_killed_between_noising_and_commit_leads_to_one_identical_release() {
    let privacy = json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
                         "mechanism": "blt", "min_separation": 1});
    killed_between_noising_and_commit("crash-blt", json!({ "privacy": privacy })).await;
}

async fn killed_between_noising_and_commit(population: &str, spec: Value) {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (token, task) = common::system::open_task_with(&system, population, 8.0, spec).await;
    collect(&system, population, 1, false).await;

    let dying = Arc::new(DiesBeforeCommit {
        inner: system.store.clone(),
        staged: Default::default(),
    });
    let doomed = confed_enclave::worker::Worker::new(dying.clone(), system.worker_config("doomed"));
    assert!(doomed.run_once().await.is_err());
    let staged = dying.staged.lock().unwrap().clone();
    assert!(
        staged.is_some(),
        "the doomed worker got as far as staging its release"
    );

    // Its lease still holds: nobody else may take the job yet.
    let rescuer = system.worker("rescuer");
    assert!(rescuer.run_once().await.unwrap().is_none());
    clock.advance(Duration::from_secs(61));
    let outcome = rescuer
        .run_once()
        .await
        .unwrap()
        .expect("the job after the lease expired");
    assert_eq!(outcome.round, 1);

    let releases = system.db.releases_of_task(&task).await.unwrap();
    assert_eq!(releases.len(), 1);
    let blob = system.store.blob(&releases[0].average_key).await.unwrap();
    assert_eq!(
        blob, staged,
        "the retry must release the bytes the dead worker noised"
    );
    let states = rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED");
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_workers_job_is_taken_over_and_released_once() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (token, task) = open_task(&system, "stall", 8.0).await;
    collect(&system, "stall", 2, false).await;

    // Worker A leases the job and stalls.
    let stalled: JobSpec = system
        .store
        .lease("stalled", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a job");
    clock.advance(Duration::from_secs(61));
    let outcome = system
        .worker("B")
        .run_once()
        .await
        .unwrap()
        .expect("taken over");
    assert_eq!(outcome.round, 1);

    // A wakes up: everything it tries is refused.
    assert!(matches!(
        system
            .store
            .renew(
                &stalled.job_id,
                &stalled.lease_holder,
                Duration::from_secs(60)
            )
            .await,
        Err(StoreError::LeaseLost)
    ));
    let committed = &system.db.releases_of_task(&task).await.unwrap()[0];
    let manifest: Manifest = serde_json::from_str(&committed.manifest_json).unwrap();
    let proof = serde_json::from_str(committed.proof_json.as_deref().unwrap()).unwrap();
    let other = vec![0u8; 8];
    assert!(matches!(
        system
            .store
            .commit_release(
                &stalled.job_id,
                &stalled.lease_holder,
                StagedRelease {
                    average: &other,
                    manifest: &manifest,
                    proof: &proof,
                    blt_state: None,
                }
            )
            .await,
        Err(StoreError::LeaseLost) | Err(StoreError::Conflict(_)) | Err(StoreError::Refused(_))
    ));
    assert_eq!(system.db.releases_of_task(&task).await.unwrap().len(), 1);
    let states = rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED");
    assert_eq!(states[1]["state"], "COLLECTING");
    system.shutdown().await;
}
