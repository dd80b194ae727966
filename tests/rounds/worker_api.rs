//! The worker API over HTTP: an enclave worker that reaches the server only through
//! `/internal/v1` (as `confed-enclave` does from Confidential Space) completes a round; the API is
//! off without a token, refuses wrong tokens and bad input, and fences a worker whose lease was
//! taken over.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::system::{collect, get, now_clock, open_task, rounds, start, start_with};
use confed_enclave::remote::HttpJobStore;
use confed_enclave::worker::Worker;
use confed_worker_api::store::{JobStore, StoreError};
use serde_json::{Value, json};
use zeroize::Zeroizing;

const TOKEN: &str = "worker-token-for-tests-0123456789abcdefghij";

fn remote(url: &str, token: &str) -> HttpJobStore {
    HttpJobStore::new(
        url,
        Zeroizing::new(token.to_string()),
        Duration::from_secs(30),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_over_http_completes_a_round() {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    let (token, task) = open_task(&system, "remote", 8.0).await;
    collect(&system, "remote", 3, false).await;
    let worker = Worker::new(
        Arc::new(remote(&system.url, TOKEN)),
        system.worker_config("remote-1"),
    );
    let outcome = worker.run_once().await.unwrap().expect("a job");
    assert_eq!(
        (outcome.round, outcome.included),
        (1, common::system::GOAL as u64)
    );
    let states = rounds(&system, &token, &task).await;
    assert_eq!(states[0]["state"], "COMPLETED");
    assert_eq!(
        get(&system, &token, &format!("/v1/tasks/{task}/models/1"))
            .await
            .status(),
        200
    );
    assert!(worker.run_once().await.unwrap().is_none());
    system.shutdown().await;
}

/// A BLT task's rounds over HTTP: the worker stores each round's sealed state (`PUT
/// .../blt-state`) before its release, whose manifest names it; the next round's job hands that
/// state back, and round 2's manifest says it continued round 1's. Nobody but the lease holder
/// may store a state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blt_task_carries_its_sealed_state_through_the_worker_api() {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    let privacy = json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
                         "mechanism": "blt", "min_separation": 1});
    let (token, task) =
        common::system::open_task_with(&system, "remote-blt", 8.0, json!({"privacy": privacy}))
            .await;
    let worker = Worker::new(
        Arc::new(remote(&system.url, TOKEN)),
        system.worker_config("remote-blt"),
    );
    for round in 1..=2u64 {
        collect(&system, "remote-blt", round, false).await;
        let outcome = worker.run_once().await.unwrap().expect("a job");
        assert_eq!(outcome.round, round);
    }
    let releases = system.db.releases_of_task(&task).await.unwrap();
    let blt = |i: usize| -> Value {
        serde_json::from_str::<Value>(&releases[i].manifest_json).unwrap()["noise"]["blt"].clone()
    };
    assert_eq!(blt(0)["state_in_blake3"], Value::Null);
    assert_eq!(blt(1)["state_in_blake3"], blt(0)["state_out_blake3"]);
    // Round 3's job lists round 2's state; a worker without the lease cannot store one.
    collect(&system, "remote-blt", 3, false).await;
    let store = remote(&system.url, TOKEN);
    let job = store
        .lease("remote-blt-2", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("round 3's job");
    assert_eq!(job.round, 3);
    let state = job.blt_state.as_deref().expect("round 2's state");
    assert_eq!(
        blt(1)["state_out_blake3"],
        json!(confed_protocol::hex::encode(blake3::hash(state).as_bytes()))
    );
    let refused = reqwest::Client::new()
        .put(format!(
            "{}/internal/v1/jobs/{}/blt-state?worker=intruder~0123",
            system.url, job.job_id
        ))
        .bearer_auth(TOKEN)
        .body(state.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 409, "{}", refused.text().await.unwrap());
    let put_state = |job: String, worker: String| {
        let url = system.url.clone();
        let body = state.to_vec();
        async move {
            reqwest::Client::new()
                .put(format!(
                    "{url}/internal/v1/jobs/{job}/blt-state?worker={worker}"
                ))
                .bearer_auth(TOKEN)
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    // The lease holder may (the same bytes again are fine: stored under their digest) ...
    assert_eq!(
        put_state(job.job_id.clone(), job.lease_holder.clone()).await,
        204
    );
    assert_eq!(
        put_state(job.job_id.clone(), job.lease_holder.clone()).await,
        204
    );
    // ... but not for a task whose noise is not BLT.
    store
        .fail(&job.job_id, &job.lease_holder, "test done", true)
        .await
        .unwrap();
    let _ = open_task(&system, "remote-gauss", 8.0).await;
    collect(&system, "remote-gauss", 4, false).await;
    let gaussian = store
        .lease("remote-gauss", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the Gaussian task's job");
    assert_eq!(put_state(gaussian.job_id, gaussian.lease_holder).await, 422);
    let _ = token;
    system.shutdown().await;
}

/// A lease that waits (long polling) is answered with the job as soon as this server closes the
/// round, not when the wait ends; a wait above the limit is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_lease_gets_the_job_when_the_round_closes() {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    let (_, _task) = open_task(&system, "waiting", 8.0).await;
    let http = reqwest::Client::new();
    let lease = |wait: u64| {
        http.post(format!("{}/internal/v1/jobs/lease", system.url))
            .bearer_auth(TOKEN)
            .json(&json!({"worker": "w1", "lease_seconds": 60, "wait_seconds": wait}))
            .send()
    };
    assert_eq!(lease(26).await.unwrap().status(), 400);
    assert_eq!(lease(0).await.unwrap().status(), 204, "no job, no wait");
    let waiting = tokio::spawn(lease(25));
    let started = std::time::Instant::now();
    collect(&system, "waiting", 1, false).await;
    let reply = waiting.await.unwrap().unwrap();
    assert_eq!(reply.status(), 200, "the job, while the lease waited");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "answered when the round closed, not when the wait ended ({:?})",
        started.elapsed()
    );
    system.shutdown().await;
}

/// A failed attempt (retried 2 s later) cost about 20 s with `confed-enclave` workers: a waiting
/// lease woke for newly closed rounds only, never for a retry becoming due. It is leased again
/// within 2.5 s of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_attempt_is_leased_again_by_a_waiting_worker_when_its_retry_is_due() {
    let clock = now_clock();
    let (system, _dir) = start_with(clock.clone(), Some(TOKEN)).await;
    let (_, _task) = open_task(&system, "retried", 8.0).await;
    collect(&system, "retried", 1, false).await;
    let http = reqwest::Client::new();
    let lease = |wait: u64| {
        http.post(format!("{}/internal/v1/jobs/lease", system.url))
            .bearer_auth(TOKEN)
            .json(&json!({"worker": "w1", "lease_seconds": 60, "wait_seconds": wait}))
            .send()
    };
    let job: Value = lease(0).await.unwrap().json().await.unwrap();
    let job_id = job["job_id"].as_str().unwrap().to_string();
    let failed = http
        .post(format!("{}/internal/v1/jobs/{job_id}/fail", system.url))
        .bearer_auth(TOKEN)
        .json(&json!({"worker": job["lease_holder"], "reason": "key services unreachable", "permanent": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 204);
    let started = std::time::Instant::now();
    let waiting = tokio::spawn(lease(25));
    // The server's clock reaches the retry (2 s after the failure) while the lease waits.
    tokio::time::sleep(Duration::from_millis(200)).await;
    clock.advance(Duration::from_secs(2));
    let reply = waiting.await.unwrap().unwrap();
    assert_eq!(
        reply.status(),
        200,
        "the retried job, while the lease waited"
    );
    let again: Value = reply.json().await.unwrap();
    assert_eq!(again["job_id"], job_id.as_str());
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "leased again {:?} after the failure",
        started.elapsed()
    );
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_lease_was_taken_over_is_refused_over_http() {
    let clock = now_clock();
    let (system, _dir) = start_with(clock.clone(), Some(TOKEN)).await;
    let (_, _task) = open_task(&system, "fence", 8.0).await;
    collect(&system, "fence", 4, false).await;
    let store = remote(&system.url, TOKEN);
    let first = store
        .lease("A", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a job");
    assert!(
        store
            .lease("B", Duration::from_secs(60))
            .await
            .unwrap()
            .is_none()
    );
    clock.advance(Duration::from_secs(61));
    let second = store
        .lease("B", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("taken over");
    assert_eq!(first.job_id, second.job_id);
    assert!(matches!(
        store
            .renew(&first.job_id, &first.lease_holder, Duration::from_secs(60))
            .await,
        Err(StoreError::LeaseLost)
    ));
    assert!(matches!(
        store
            .commit_model(&first.job_id, &first.lease_holder, &first.model, None)
            .await,
        Err(StoreError::LeaseLost)
    ));
    store
        .renew(
            &second.job_id,
            &second.lease_holder,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    system.shutdown().await;
}

#[tokio::test]
async fn the_worker_api_is_off_without_a_token_and_refuses_wrong_ones_and_bad_input() {
    let (off, _d1) = start(now_clock()).await;
    let http = reqwest::Client::new();
    let lease = |url: &str, token: &str, body: Value| {
        http.post(format!("{url}/internal/v1/jobs/lease"))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let body = json!({"worker": "w1", "lease_seconds": 60});
    let reply = lease(&off.url, TOKEN, body.clone()).await.unwrap();
    assert_eq!(reply.status(), 404);
    assert_eq!(reply.headers()["content-type"], "application/problem+json");
    let problem: Value = reply.json().await.unwrap();
    assert_eq!(problem["type"], confed_worker_api::wire::API_OFF);
    // A worker reads nothing there as a missing object, nor anything it sends as done.
    let store = remote(&off.url, TOKEN);
    for outcome in [
        store.fetch("contributions/x").await.map(drop),
        store.renew("job", "w1", Duration::from_secs(60)).await,
    ] {
        let error = outcome.unwrap_err().to_string();
        assert!(error.contains("the worker API is off"), "{error}");
    }
    off.shutdown().await;

    let (on, _d2) = start_with(now_clock(), Some(TOKEN)).await;
    let wrong = lease(&on.url, "not-the-token", body.clone()).await.unwrap();
    assert_eq!(wrong.status(), 401);
    let bad_worker = lease(
        &on.url,
        TOKEN,
        json!({"worker": "has space", "lease_seconds": 60}),
    )
    .await
    .unwrap();
    assert_eq!(bad_worker.status(), 400);
    let bad_lease = lease(&on.url, TOKEN, json!({"worker": "w1", "lease_seconds": 5}))
        .await
        .unwrap();
    assert_eq!(bad_lease.status(), 400);
    let unknown_field = lease(
        &on.url,
        TOKEN,
        json!({"worker": "w1", "lease_seconds": 60, "x": 1}),
    )
    .await
    .unwrap();
    assert_eq!(unknown_field.status(), 400);
    let nothing = lease(&on.url, TOKEN, body).await.unwrap();
    assert_eq!(nothing.status(), 204);
    let missing = http
        .get(format!(
            "{}/internal/v1/blobs/tenants/x/nothing.bin",
            on.url
        ))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert!(matches!(
        remote(&on.url, "wrong-token")
            .lease("w", Duration::from_secs(60))
            .await,
        Err(StoreError::Backend(_))
    ));
    on.shutdown().await;
}

/// `POST /internal/v1/contributions` answers one frame per key in the order named (a missing
/// one as such), the bytes `GET .../contributions/{key}` serves; the enclave's client decodes the
/// same; an empty, oversized or malformed batch is a 400, a wrong token a 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_contributions_answers_each_key_in_order_and_refuses_bad_batches() {
    use confed_worker_api::batch::{FrameDecoder, MAX_BATCH_KEYS};
    use futures_util::StreamExt;

    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    open_task(&system, "batches", 8.0).await;
    collect(&system, "batches", 3, false).await;
    let store = remote(&system.url, TOKEN);
    let job = store
        .lease("batch-reader", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("the round closed");
    let stored: Vec<String> = job
        .contributions
        .iter()
        .map(|c| c.blob_key.clone())
        .collect();
    let keys = vec![
        stored[1].clone(),
        "tenants/x/contributions/none.cbor".to_string(),
        stored[0].clone(),
    ];
    let http = reqwest::Client::new();
    let mut want = Vec::new();
    for key in &keys {
        let one = http
            .get(format!("{}/internal/v1/contributions/{key}", system.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        want.push((one.status() == 200).then_some(one.bytes().await.unwrap().to_vec()));
    }
    assert!(want[0].is_some() && want[1].is_none() && want[2].is_some());
    assert_ne!(want[0], want[2]);

    let batch = |token: &str, body: Value| {
        http.post(format!("{}/internal/v1/contributions", system.url))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let answer = batch(TOKEN, json!({"keys": keys})).await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["content-type"], "application/octet-stream");
    let body = answer.bytes().await.unwrap();
    // Byte for byte as docs/protocol.md ("Batches of contributions") describes it.
    let mut expected = Vec::new();
    for frame in &want {
        match frame {
            Some(bytes) => {
                expected.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
                expected.extend_from_slice(bytes);
            }
            None => expected.extend_from_slice(&[0xff; 8]),
        }
    }
    assert!(
        body[..] == expected[..],
        "the body is not the documented frames"
    );
    let mut decoder = FrameDecoder::new(keys.len(), 1 << 20);
    let mut frames = Vec::new();
    decoder
        .feed(&body, &mut Vec::new, &mut |frame| frames.push(frame))
        .unwrap();
    decoder.finish().unwrap();
    assert_eq!(frames, want);

    let pool = confed_worker_api::reads::BufferPool::new(1 << 20);
    let decoded: Vec<Option<Vec<u8>>> = store
        .fetch_batch(keys.clone(), &pool)
        .map(Result::unwrap)
        .collect()
        .await;
    assert_eq!(decoded, want);

    // As many keys as a batch may name, the same one more than once: a frame for each.
    let most = vec![stored[0].clone(); MAX_BATCH_KEYS];
    let answer = batch(TOKEN, json!({"keys": most})).await.unwrap();
    assert_eq!(answer.status(), 200);
    let frame = 8 + want[2].as_ref().unwrap().len();
    assert_eq!(answer.bytes().await.unwrap().len(), MAX_BATCH_KEYS * frame);

    let too_many = vec![stored[0].clone(); MAX_BATCH_KEYS + 1];
    for (case, body) in [
        ("empty", json!({"keys": []})),
        ("too many", json!({"keys": too_many})),
        (
            "a dot segment",
            json!({"keys": [stored[0], "tenants/../secrets"]}),
        ),
        ("not a list", json!({"keys": stored[0]})),
        (
            "an unknown field",
            json!({"keys": [stored[0]], "all": true}),
        ),
    ] {
        let refused = batch(TOKEN, body).await.unwrap();
        assert_eq!(refused.status(), 400, "{case}");
        assert_eq!(
            refused.headers()["content-type"],
            "application/problem+json",
            "{case}"
        );
    }
    // A body past the route's limit (64 keys of at most 1024 bytes, escaped) is a 413.
    let huge = json!({"keys": [stored[0], "x".repeat(200_000)]});
    assert_eq!(batch(TOKEN, huge).await.unwrap().status(), 413);
    let wrong = batch("not-the-token", json!({"keys": [stored[0]]}))
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    system.shutdown().await;
}

/// A holder of the worker token commits, over the worker API, a release no enclave made (its own
/// average, enclave key and receipts): 422, and nothing is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_forged_with_the_worker_token_is_refused_over_http() {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    let (_, task) = open_task(&system, "forged", 8.0).await;
    collect(&system, "forged", 6, false).await;
    let store = remote(&system.url, TOKEN);
    let job = store
        .lease("forger", Duration::from_secs(60))
        .await
        .unwrap()
        .expect("a job");
    let (average, manifest, proof) = common::forgery::forged_release(&system, &job).await;
    let refused = store
        .commit_release(
            &job.job_id,
            &job.lease_holder,
            confed_worker_api::store::StagedRelease {
                average: &average,
                manifest: &manifest,
                proof: &proof,
                blt_state: None,
            },
        )
        .await;
    assert!(
        matches!(&refused, Err(StoreError::Refused(why)) if why.contains("receipts needed")),
        "{refused:?}"
    );
    assert!(system.db.releases_of_task(&task).await.unwrap().is_empty());
    system.shutdown().await;
}

/// A job store that, when the worker commits a FedAdam model, first tries what a confused or
/// hostile worker might (through the worker API), then commits as the worker meant to.
struct Probing {
    inner: HttpJobStore,
    url: String,
    refused: std::sync::Mutex<Vec<(String, u16, String)>>,
}

impl Probing {
    async fn try_put(&self, path: &str, body: Vec<u8>) -> (u16, String) {
        let reply = reqwest::Client::new()
            .put(format!("{}/internal/v1/{path}", self.url))
            .bearer_auth(TOKEN)
            .header("content-type", "application/octet-stream")
            .body(body)
            .send()
            .await
            .unwrap();
        (reply.status().as_u16(), reply.text().await.unwrap())
    }
}

impl JobStore for Probing {
    async fn lease(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<confed_worker_api::store::JobSpec>, StoreError> {
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
        release: confed_worker_api::store::StagedRelease<'_>,
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
        let state = optimizer_state.expect("FedAdam keeps state").to_vec();
        let wrong_size = confed_worker_api::optimizer::OptimizerState {
            m: vec![0.0; 3],
            v: Some(vec![1e-6; 3]),
        }
        .encode()
        .unwrap();
        let probes = [
            (
                "another worker's state",
                format!("jobs/{job_id}/optimizer-state?worker=intruder~0123"),
                state.clone(),
            ),
            (
                "a state of another size",
                format!("jobs/{job_id}/optimizer-state?worker={worker}"),
                wrong_size,
            ),
            (
                "not a state file",
                format!("jobs/{job_id}/optimizer-state?worker={worker}"),
                b"junk".to_vec(),
            ),
            (
                "a model without its state",
                format!("jobs/{job_id}/model?worker={worker}"),
                model.to_vec(),
            ),
            (
                "a model naming a state never stored",
                format!(
                    "jobs/{job_id}/model?worker={worker}&optimizer_state_sha256={}",
                    "0".repeat(64)
                ),
                model.to_vec(),
            ),
        ];
        for (what, path, body) in probes {
            let (status, detail) = self.try_put(&path, body).await;
            self.refused
                .lock()
                .unwrap()
                .push((what.to_string(), status, detail));
        }
        self.inner
            .commit_model(job_id, worker, model, Some(&state))
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

/// The optimizer state's route takes only the lease holder's state, of the task's optimizer and
/// the model's size, and a stateful optimizer's model commit must name a stored state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optimizer_state_is_taken_only_from_the_lease_holder_and_must_fit() {
    let (system, _dir) = start_with(now_clock(), Some(TOKEN)).await;
    let (token, task) = common::system::open_task_with(
        &system,
        "adam",
        8.0,
        json!({"server_optimizer": {"name": "fedadam"}}),
    )
    .await;
    collect(&system, "adam", 3, false).await;
    let store = Arc::new(Probing {
        inner: remote(&system.url, TOKEN),
        url: system.url.clone(),
        refused: Default::default(),
    });
    let worker = Worker::new(store.clone(), system.worker_config("adam-1"));
    worker.run_once().await.unwrap().expect("a job");
    let refused = store.refused.lock().unwrap().clone();
    let statuses: Vec<(&str, u16)> = refused.iter().map(|(w, s, _)| (w.as_str(), *s)).collect();
    assert_eq!(
        statuses,
        [
            ("another worker's state", 409),
            ("a state of another size", 422),
            ("not a state file", 422),
            ("a model without its state", 422),
            ("a model naming a state never stored", 422),
        ],
        "{refused:?}"
    );
    // The worker's own commit went through: model version 1 exists, the round is complete.
    assert_eq!(
        rounds(&system, &token, &task).await[0]["state"],
        "COMPLETED"
    );
    system.shutdown().await;
}
