//! Analytics tasks end to end in process (docs/analytics.md): a task created with a query opens at
//! once on its fixed model version 0, simulated devices answer from their records (the Rust device
//! library, sealed at their drawn instants), the enclave worker releases each round's noised
//! result once, the round completes without a model, and every release verifies.

use crate::common;

use confed::tools::analytics_population::AnalyticsPopulation;
use confed::tools::simulate::{self, SimulationConfig};
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

fn devices(system: &confed::embedded::EmbeddedSystem, seed: u64) -> SimulationConfig {
    SimulationConfig {
        server: system.url.clone(),
        population: "words".into(),
        devices: DEVICES,
        first_device: 0,
        concurrency: 8,
        rounds: 1,
        trust: system.trust.clone(),
        train: false,
        seed,
        rows_per_device: 1,
        max_retry_wait: Duration::from_millis(20),
        idle_limit: 20,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        // Every device holds "planted-all", nine in ten "planted-most", and two Zipf words
        // of a 100,000-word vocabulary (nearly all held by one device each).
        analytics: Some(AnalyticsPopulation::new(
            100_000,
            1.0,
            2,
            vec![("planted-all".into(), 1.0), ("planted-most".into(), 0.9)],
        )),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_domain_task_releases_the_words_many_devices_hold_every_round() {
    let (system, _dir) = start(now_clock()).await;
    let token = system.tenant("tenant-words").await.unwrap();
    let task = create(
        &system,
        &token,
        json!({
            "kind": "analytics",
            "analytics": {"query": "open_histogram", "max_key_bytes": 16, "keys_per_device": 4},
            "population": "words", "rounds": 2, "report_goal": DEVICES,
            "privacy": {"epsilon": 8.0, "delta": 1e-6},
            "upload_window": common::FAST_UPLOAD_WINDOW.clone(),
        }),
    )
    .await;
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
