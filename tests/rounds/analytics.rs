//! Analytics tasks end to end in process (docs/analytics.md): a task created with a query opens at
//! once on its fixed model version 0, simulated devices answer from their records (the Rust device
//! library, sealed at their drawn instants), the enclave worker releases each round's noised
//! result once, the round completes without a model, and every release verifies.

use crate::common;

use confed::tools::analytics_population::AnalyticsPopulation;
use confed::tools::simulate::{self, SimulationConfig};
use confed_enclave::worker::{AnalyticsStep, Phases};
use confed_worker_api::store::{JobSpec, JobStore, Partitioning};
use serde_json::{Value, json};
use std::time::Duration;

use common::system::{get, now_clock, rounds, start};

const DEVICES: usize = 40;

async fn create(system: &confed::embedded::EmbeddedSystem, token: &str, spec: Value) -> Value {
    let created = reqwest::Client::new()
        .post(format!("{}/v1/tasks", system.url))
        .bearer_auth(token)
        .json(&spec)
        .send()
        .await
        .unwrap();
    let status = created.status();
    let body: Value = created.json().await.unwrap();
    assert_eq!(status, 201, "{body}");
    body
}

/// An open-domain task over the "words" population: up to 4 words of 16 bytes a device.
fn open_domain_task(rounds: u32, report_goal: usize) -> Value {
    json!({
        "kind": "analytics",
        "analytics": {"query": "open_histogram", "max_key_bytes": 16, "keys_per_device": 4},
        "population": "words", "rounds": rounds, "report_goal": report_goal,
        "privacy": {"epsilon": 8.0, "delta": 1e-6},
        "upload_window": common::FAST_UPLOAD_WINDOW.clone(),
    })
}

fn devices(system: &confed::embedded::EmbeddedSystem, seed: u64) -> SimulationConfig {
    SimulationConfig {
        concurrency: 8,
        train: false,
        rows_per_device: 1,
        // Every device holds "planted-all", nine in ten "planted-most", and two Zipf words
        // of a 100,000-word vocabulary (nearly all held by one device each).
        analytics: Some(AnalyticsPopulation::new(
            100_000,
            1.0,
            2,
            vec![("planted-all".into(), 1.0), ("planted-most".into(), 0.9)],
        )),
        ..common::system::simulation(system, "words", DEVICES, seed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_domain_task_releases_the_words_many_devices_hold_every_round() {
    let (system, _dir) = start(now_clock()).await;
    let token = system.tenant("tenant-words").await.unwrap();
    let task = create(&system, &token, open_domain_task(2, DEVICES)).await;
    let id = task["id"].as_str().unwrap().to_string();
    // Open at once: its model version 0 is the fixed stand-in, and its policy binds the query.
    assert_eq!(task["state"], "OPEN", "{task}");
    assert_eq!(task["kind"], "analytics");
    let policy = task["policy"].as_str().unwrap();
    assert!(
        policy.ends_with("analytics=open_histogram;max_key_bytes=16;keys_per_device=4\n"),
        "{policy}"
    );
    // Its version 0 is fixed: no partner's model takes its place.
    let upload = reqwest::Client::new()
        .put(format!("{}/v1/tasks/{id}/model", system.url))
        .bearer_auth(&token)
        .header("content-type", "application/octet-stream")
        .body(confed::tools::simulate::initial_model(7))
        .send()
        .await
        .unwrap();
    assert!(upload.status().is_client_error(), "{}", upload.status());
    let worker = system.worker("w1");
    for round in 1..=2u64 {
        let summary = simulate::run(devices(&system, round)).await.unwrap();
        assert_eq!(summary.contributions, DEVICES, "{:?}", summary.failures);
        assert!(summary.zeroed.is_empty(), "{:?}", summary.zeroed);
        let outcome = worker.run_once().await.unwrap().expect("a job was ready");
        assert_eq!((outcome.round, outcome.included), (round, DEVICES as u64));
        let states = rounds(&system, &token, &id).await;
        assert_eq!(
            states[round as usize - 1]["state"],
            "COMPLETED",
            "{states:?}"
        );

        let manifest: Value = get(
            &system,
            &token,
            &format!("/v1/tasks/{id}/releases/{round}/manifest"),
        )
        .await
        .json()
        .await
        .unwrap();
        let analytics = &manifest["analytics"];
        let tau = analytics["threshold"].as_i64().unwrap();
        assert!(tau > 1 && tau < 36, "{manifest}");
        let result: Value = get(
            &system,
            &token,
            &format!("/v1/tasks/{id}/releases/{round}/average"),
        )
        .await
        .json()
        .await
        .unwrap();
        assert_eq!(result["format"], "confed-analytics-release/v1");
        let keys: Vec<(String, i64)> = serde_json::from_value(result["keys"].clone()).unwrap();
        let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
        // The planted words pass; no word only a device or two hold does.
        assert!(names.contains(&"planted-all"), "{names:?}");
        assert!(names.contains(&"planted-most"), "{names:?}");
        assert!(keys.iter().all(|(_, count)| *count >= tau), "{keys:?}");
        assert!(names.len() <= 4, "{names:?}");
        // Every device holds "planted-all": its count is the round's, within the stated noise.
        let stddev = analytics["noise_stddev"].as_f64().unwrap();
        let all = keys.iter().find(|(k, _)| k == "planted-all").unwrap().1;
        assert!(
            (all - DEVICES as i64).abs() as f64 <= 6.0 * stddev,
            "planted-all released as {all} of {DEVICES} (stddev {stddev})"
        );
        let verified =
            confed::verify::verify_release(&system.url, &token, &id, round, &system.trust)
                .await
                .unwrap();
        assert!(verified.ok(), "{:?}", verified.failures);
    }
    // Both rounds done: the task completes without a model version beyond the stand-in.
    let task: Value = get(&system, &token, &format!("/v1/tasks/{id}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(task["state"], "COMPLETED", "{task}");
    assert_eq!(task["model_version"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_analytics_task_refuses_training_fields_and_a_query_past_the_caps() {
    let (system, _dir) = start(now_clock()).await;
    let token = system.tenant("tenant-refusals").await.unwrap();
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/tasks", system.url))
        .bearer_auth(&token)
        .json(&json!({
            "kind": "analytics",
            "analytics": {"query": "histogram", "domain_size": 100_000_000u64, "keys_per_device": 4},
            "population": "words", "rounds": 1, "report_goal": 100,
            "privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": 1.0},
            "server_learning_rate": 0.5,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let problem: Value = refused.json().await.unwrap();
    let names: Vec<&str> = problem["invalid_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec![
            "analytics.domain_size",
            "privacy.clip_norm",
            "server_learning_rate"
        ],
        "{problem}"
    );
}

/// A round of 100 answers cut into two partitions: each partition's worker seals its range's
/// table, the root merges them and releases once, and a worker that aggregates the same
/// committed inputs whole makes the same bytes (the store accepts them as the same release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_open_domain_round_releases_the_bytes_one_worker_would() {
    const LEASE: Duration = Duration::from_secs(60);
    let devices_in_round = 100;
    let clock = now_clock();
    let partitioning = confed::aggregation::partitions::PartitionPolicy {
        workers: 4,
        min_contributions: 50,
    };
    let (system, _dir) =
        common::system::start_partitioned(clock.clone(), None, None, partitioning).await;
    let token = system.tenant("tenant-parts").await.unwrap();
    let task = create(&system, &token, open_domain_task(1, devices_in_round)).await;
    let id = task["id"].as_str().unwrap().to_string();
    let summary = simulate::run(SimulationConfig {
        devices: devices_in_round,
        ..devices(&system, 1)
    })
    .await
    .unwrap();
    assert_eq!(
        summary.contributions, devices_in_round,
        "{:?}",
        summary.failures
    );
    for worker in ["w1", "w2"] {
        let outcome = system.worker(worker).run_once().await.unwrap().unwrap();
        let (_, count) = outcome.partition.expect("a partition's job");
        assert_eq!((count, outcome.included), (2, 0));
    }
    // The root's job, as the store describes it, leased by a probe.
    let root = system.store.lease("probe", LEASE).await.unwrap().unwrap();
    let Some(Partitioning::Root {
        count: 2,
        sealed_keys,
    }) = root.partitioning.clone()
    else {
        panic!(
            "the root's job of 2 partitions, got {:?}",
            root.partitioning
        );
    };
    // One worker over the same committed inputs, and the root over the partitions: the same
    // bytes (and the same commitment, so the key services release the key for both).
    let probe = system.worker("probe");
    let released = |step: AnalyticsStep| match step {
        AnalyticsStep::Released { release, .. } => release,
        AnalyticsStep::Sealed { .. } => panic!("a whole round's or a root's job seals nothing"),
    };
    let whole_job = JobSpec {
        partitioning: None,
        ..root.clone()
    };
    let whole = released(
        probe
            .aggregate_analytics(&whole_job, &mut Phases::default())
            .await
            .unwrap(),
    );
    let merged = released(
        probe
            .aggregate_analytics(&root, &mut Phases::default())
            .await
            .unwrap(),
    );
    assert_eq!(merged.result, whole.result);
    assert_eq!(merged.manifest.to_json(), whole.manifest.to_json());
    assert_eq!(merged.manifest.included, devices_in_round as u64);
    // The probe's lease lapses; a worker takes the root and commits those bytes.
    clock.advance(LEASE + Duration::from_secs(1));
    let outcome = system.worker("w3").run_once().await.unwrap().unwrap();
    assert_eq!(
        (outcome.partition, outcome.included),
        (None, devices_in_round as u64)
    );
    let states = rounds(&system, &token, &id).await;
    assert_eq!(states[0]["state"], "COMPLETED", "{states:?}");
    let verified = confed::verify::verify_release(&system.url, &token, &id, 1, &system.trust)
        .await
        .unwrap();
    assert!(verified.ok(), "{:?}", verified.failures);
    let stored = get(
        &system,
        &token,
        &format!("/v1/tasks/{id}/releases/1/average"),
    )
    .await
    .bytes()
    .await
    .unwrap();
    assert_eq!(&stored[..], &whole.result[..]);
    // The round completed with its release: its sealed tables are deleted from the data
    // directory (a GCS bucket expires them by its lifecycle rule instead).
    if common::gcs::emulator().is_none() {
        for key in &sealed_keys {
            assert_eq!(system.store.fetch_sealed(key).await.unwrap(), None, "{key}");
        }
    }
    let result: Value = get(
        &system,
        &token,
        &format!("/v1/tasks/{id}/releases/1/average"),
    )
    .await
    .json()
    .await
    .unwrap();
    let keys = result["keys"].to_string();
    assert!(keys.contains("planted-all"), "{keys}");
}
