//! The embedded system (key services, APIs, scheduler) in-process for end-to-end tests, with
//! helpers to open a task and let simulated devices fill a round.

use confed::clock::Millis;
use std::sync::Arc;
use std::time::Duration;

use confed::clock::ManualClock;
use confed::embedded::{EmbeddedOptions, EmbeddedSystem};
use confed::tools::simulate::{self, SimulationConfig};
use serde_json::{Value, json};

pub(crate) const GOAL: usize = 20;

pub(crate) async fn start(clock: Arc<ManualClock>) -> (EmbeddedSystem, tempfile::TempDir) {
    start_with(clock, None).await
}

/// `start`, with the worker API on when `worker_token` is given.
pub(crate) async fn start_with(
    clock: Arc<ManualClock>,
    worker_token: Option<&str>,
) -> (EmbeddedSystem, tempfile::TempDir) {
    start_full(clock, worker_token, None).await
}

/// `start_with`, with the dev attester's key chosen by the caller.
pub(crate) async fn start_full(
    clock: Arc<ManualClock>,
    worker_token: Option<&str>,
    attester_key: Option<p256::ecdsa::SigningKey>,
) -> (EmbeddedSystem, tempfile::TempDir) {
    start_partitioned(clock, worker_token, attester_key, Default::default()).await
}

/// `start_full`, with large rounds cut into partitions as `partitioning` says.
pub(crate) async fn start_partitioned(
    clock: Arc<ManualClock>,
    worker_token: Option<&str>,
    attester_key: Option<p256::ecdsa::SigningKey>,
    partitioning: confed::aggregation::partitions::PartitionPolicy,
) -> (EmbeddedSystem, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let system = EmbeddedSystem::start(EmbeddedOptions {
        blobs: super::gcs::test_blobs().await,
        data_dir: dir.path().join("data"),
        keyservices: 3,
        threshold: 2,
        clock,
        background_worker: false,
        scheduler_period: Duration::from_secs(3600),
        worker_token: worker_token
            .map(|t| confed::auth::AdminToken::from_secret(t.to_string()).unwrap()),
        attester_key,
        database: match super::database::postgres_url() {
            Some(server) => Some(super::database::fresh_postgres_database(&server).await),
            None => None,
        },
        partitioning,
        ports: None,
    })
    .await
    .unwrap();
    (system, dir)
}

pub(crate) fn now_clock() -> Arc<ManualClock> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    Arc::new(ManualClock::starting_at(Millis(now)))
}

/// Creates a task on `population` with a zero model and returns (token, task id).
pub(crate) async fn open_task(
    system: &EmbeddedSystem,
    population: &str,
    epsilon: f64,
) -> (String, String) {
    open_task_with(system, population, epsilon, json!({})).await
}

/// `open_task` with `extra` fields of the task's spec (e.g. `min_reports`) set.
pub(crate) async fn open_task_with(
    system: &EmbeddedSystem,
    population: &str,
    epsilon: f64,
    extra: Value,
) -> (String, String) {
    let token = system
        .tenant(&format!("tenant-{population}"))
        .await
        .unwrap();
    let id = create_task_with(&system.url, &token, population, epsilon, GOAL, extra).await;
    (token, id)
}

/// Creates a three-round task through the partner API of the server at `base` and uploads a
/// zero model as version 0; returns the task id.
pub(crate) async fn create_task(
    base: &str,
    token: &str,
    population: &str,
    epsilon: f64,
    report_goal: usize,
) -> String {
    create_task_with(base, token, population, epsilon, report_goal, json!({})).await
}

/// `create_task` with `extra` fields of the spec set (they replace the defaults).
pub(crate) async fn create_task_with(
    base: &str,
    token: &str,
    population: &str,
    epsilon: f64,
    report_goal: usize,
    extra: Value,
) -> String {
    let http = reqwest::Client::new();
    let mut spec = json!({
        "population": population, "rounds": 3, "report_goal": report_goal,
        "privacy": {"epsilon": epsilon, "delta": 1e-6, "clip_norm": 1.0},
        "server_learning_rate": 1.0,
        "plan": {"epochs": 2, "batch_size": 16, "learning_rate": 0.1},
        "upload_window": super::FAST_UPLOAD_WINDOW.clone(),
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    let task: Value = http
        .post(format!("{base}/v1/tasks"))
        .bearer_auth(token)
        .json(&spec)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = task["id"].as_str().expect("task created").to_string();
    let put = http
        .put(format!("{base}/v1/tasks/{id}/model"))
        .bearer_auth(token)
        .header("content-type", "application/octet-stream")
        .body(simulate::initial_model(7))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201, "{}", put.text().await.unwrap());
    id
}

/// `GOAL` devices each contribute once to the collecting round.
pub(crate) async fn collect(system: &EmbeddedSystem, population: &str, seed: u64, train: bool) {
    collect_n(system, population, seed, train, GOAL).await;
}

/// `devices` devices each contribute once to the collecting round (of that report goal).
pub(crate) async fn collect_n(
    system: &EmbeddedSystem,
    population: &str,
    seed: u64,
    train: bool,
    devices: usize,
) {
    collect_trusting(
        system,
        population,
        seed,
        train,
        devices,
        system.trust.clone(),
    )
    .await;
}

/// One round of `devices` simulated devices of `population` training on 40 rows each, fast
/// retries, trusting the system: what tests override field by field.
pub(crate) fn simulation(
    system: &EmbeddedSystem,
    population: &str,
    devices: usize,
    seed: u64,
) -> SimulationConfig {
    SimulationConfig {
        server: system.url.clone(),
        population: population.into(),
        devices,
        first_device: 0,
        concurrency: 4,
        rounds: 1,
        trust: system.trust.clone(),
        train: true,
        seed,
        rows_per_device: 40,
        max_retry_wait: Duration::from_millis(20),
        idle_limit: 20,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        analytics: None,
    }
}

/// `collect_n` by devices holding `trust` (e.g. with a token issuer).
pub(crate) async fn collect_trusting(
    system: &EmbeddedSystem,
    population: &str,
    seed: u64,
    train: bool,
    devices: usize,
    trust: confed_device::TrustConfig,
) {
    let summary = simulate::run(SimulationConfig {
        trust,
        train,
        ..simulation(system, population, devices, seed)
    })
    .await
    .unwrap();
    assert_eq!(summary.contributions, devices, "{:?}", summary.failures);
}

/// `open_task` with a report goal of `goal` devices.
pub(crate) async fn open_task_of(
    system: &EmbeddedSystem,
    population: &str,
    epsilon: f64,
    goal: usize,
) -> (String, String) {
    let token = system
        .tenant(&format!("tenant-{population}"))
        .await
        .unwrap();
    let id = create_task_with(&system.url, &token, population, epsilon, goal, json!({})).await;
    (token, id)
}

pub(crate) async fn get(system: &EmbeddedSystem, token: &str, path: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{}{path}", system.url))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

pub(crate) async fn rounds(system: &EmbeddedSystem, token: &str, task: &str) -> Vec<Value> {
    rounds_at(&system.url, token, task).await
}

/// A task's rounds as the partner API of the server at `base` lists them.
pub(crate) async fn rounds_at(base: &str, token: &str, task: &str) -> Vec<Value> {
    let body: Value = reqwest::Client::new()
        .get(format!("{base}/v1/tasks/{task}/rounds"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["rounds"]
        .as_array()
        .or(body.as_array())
        .cloned()
        .unwrap_or_default()
}

/// Asserts that round 1 of `task` released every completed contribution exactly once: its one
/// release's manifest names the digest of the round's `devices` distinct refs.
pub(crate) async fn assert_released_every_contribution_once(
    system: &EmbeddedSystem,
    task: &str,
    devices: usize,
) {
    let releases = system.db.releases_of_task(task).await.unwrap();
    assert_eq!(releases.len(), 1, "one release");
    let manifest: confed_worker_api::manifest::Manifest =
        serde_json::from_str(&releases[0].manifest_json).unwrap();
    let mut refs: Vec<String> = system
        .db
        .completed_contributions(task, 1)
        .await
        .unwrap()
        .into_iter()
        .map(|(assignment_ref, _)| assignment_ref)
        .collect();
    refs.sort();
    refs.dedup();
    assert_eq!(refs.len(), devices);
    assert_eq!(manifest.included, devices as u64);
    assert_eq!(
        manifest.included_digest,
        confed_enclave::aggregate::digest(&refs)
    );
}

/// The inputs digest a Gaussian round's `job` commits to (protocol.md, `inputs_digest`): every
/// listed contribution in ref order, then the sampler its release noise is drawn with.
pub(crate) fn gaussian_inputs_digest(job: &confed_worker_api::store::JobSpec) -> String {
    use confed_enclave::aggregate::inputs;
    let mut listed: Vec<(&str, Option<&[u8; 32]>)> = job
        .contributions
        .iter()
        .map(|c| (c.assignment_ref.as_str(), c.blake3.as_ref()))
        .collect();
    listed.sort();
    inputs::bind_gaussian_sampler(&inputs::inputs_digest(listed))
}
