//! What the device-cycle benchmarks share: the 16 KB task they load and the load generator's
//! configuration.

use std::time::Duration;

use confed::tools::simulate::SimulationConfig;
use confed_protocol::trust::TrustConfig;

/// Devices each run simulates.
pub(crate) const DEVICES: usize = 6000;

/// Creates the task `spec` describes and uploads its model: 4 x 1023 weights + 4 biases = 4096
/// floats, so every update is 16 KB.
pub(crate) async fn task(http: &reqwest::Client, base: &str, token: &str, spec: serde_json::Value) {
    let task: serde_json::Value = http
        .post(format!("{base}/v1/tasks"))
        .bearer_auth(token)
        .json(&spec)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = task["id"].as_str().unwrap_or_else(|| panic!("{task}"));
    let model = confed::tools::train::Softmax::zeros(4, 1023).to_safetensors();
    let put = http
        .put(format!("{base}/v1/tasks/{id}/model"))
        .bearer_auth(token)
        .body(model)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201);
}

/// `DEVICES` devices of `population`, from `first_device`, `concurrency` at a time, each
/// contributing once with a random update (the load generator keeps nothing on disk).
pub(crate) fn load(
    base: &str,
    population: &str,
    trust: &TrustConfig,
    first_device: u64,
    concurrency: usize,
) -> SimulationConfig {
    SimulationConfig {
        server: base.to_string(),
        population: population.into(),
        devices: DEVICES,
        first_device,
        concurrency,
        rounds: 1,
        trust: trust.clone(),
        train: false,
        seed: 1,
        rows_per_device: 0,
        max_retry_wait: Duration::from_millis(10),
        idle_limit: 3,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        analytics: None,
    }
}
