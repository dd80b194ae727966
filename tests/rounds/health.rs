//! The noised health signal end to end, through `confed serve`, its enclave worker and the Rust
//! simulator's devices: a round where about half the devices' training overflows (the probe
//! model of `side_channels`, theta at the devices' median) releases a health count near the
//! number of devices that sent zeros, within its stated noise, in the manifest, the releases API
//! and `confed verify`. (That nothing exact says which or how many is `side_channels`' test.)
//!
//! Not run again on PostgreSQL and GCS (.ci/run): `confed serve` with its own data directory
//! (SQLite); the engines' paths run in the modules that use the test database.

use crate::common;

use serde_json::json;

use super::side_channels::{ROWS, feature_0_maxima, probe_model};
use common::process::Server;

const DEVICES: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_where_half_the_devices_fail_releases_a_noised_count_near_half() {
    let dir = tempfile::tempdir().unwrap();
    let server = Server::start(&dir.path().join("data")).await;
    let mut maxima = feature_0_maxima(DEVICES);
    maxima.sort_by(f32::total_cmp);
    // Between the two middle devices: training overflows on the half whose feature 0 exceeds it.
    let theta = (maxima[DEVICES / 2 - 1] + maxima[DEVICES / 2]) / 2.0;
    let failing = maxima.iter().filter(|&&m| m > theta).count();
    assert_eq!(failing, DEVICES / 2, "{maxima:?}");
    let task = server
        .open_task(
            json!({
                "population": "health", "rounds": 1, "report_goal": DEVICES,
                "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0,
                            "health": {"stddev": 1.0}},
                "plan": {"epochs": 1, "batch_size": 10, "learning_rate": 0.1},
            }),
            probe_model(theta),
        )
        .await;
    let created = server.get(&format!("/v1/tasks/{task}")).await;
    assert_eq!(created["privacy"]["health"], json!({"stddev": 1.0}));
    assert!(
        created["policy"]
            .as_str()
            .unwrap()
            .contains(";health=1e0\n"),
        "{}",
        created["policy"]
    );
    let config = common::process::simulated_devices(
        &server.url,
        "health",
        &server.trust_file(),
        DEVICES,
        0,
        ROWS,
    );
    let summary = confed::tools::simulate::run(config).await.unwrap();
    assert!(summary.failures.is_empty(), "{:?}", summary.failures);
    assert_eq!(summary.zeroed.len(), failing, "{:?}", summary.zeroed);
    server.wait_for_model(&task, 1).await;

    // The manifest: every device included, the count noised at the stated scale.
    let manifest: serde_json::Value = serde_json::from_slice(
        &server
            .get_bytes(&format!("/v1/tasks/{task}/releases/1/manifest"))
            .await,
    )
    .unwrap();
    assert_eq!(manifest["included"], DEVICES);
    assert_eq!(manifest["excluded"], json!({}));
    let zeroed = manifest["health"]["zeroed"].as_i64().unwrap();
    let stddev = manifest["health"]["stddev"].as_f64().unwrap();
    assert!((1.0..1.01).contains(&stddev), "{manifest}");
    assert!(
        (zeroed - failing as i64).abs() as f64 <= 6.0 * stddev,
        "noised {zeroed} for {failing} zeroed devices"
    );
    // The releases API states it beside the counts.
    let releases = server.get(&format!("/v1/tasks/{task}/releases")).await;
    assert_eq!(
        releases["releases"][0]["health"],
        json!({"zeroed": zeroed, "stddev": stddev})
    );
    // `confed verify release` prints it once the release verifies.
    let trust = confed_device::load_trust(&server.trust_file()).unwrap();
    let verified = confed::verify::verify_release(&server.url, &server.token, &task, 1, &trust)
        .await
        .unwrap();
    assert!(verified.ok(), "{:?}", verified.failures);
    assert!(
        verified.lines.iter().any(|l| l.starts_with(&format!(
            "health: {zeroed} of {DEVICES} included devices sent zeros"
        ))),
        "{:?}",
        verified.lines
    );
    server.stop().await;
}
