//! A whole round as a user runs it (issue 15): a real `confed serve` (the release binary: run
//! `cargo build --release` first, or set CONFED_BIN), a task with a 1 MB model (262,144 f32) and
//! a report goal of 1,000, and `confed devices simulate --no-train` for 1,000 devices from a
//! second process. Prints the collection time (devices checking in, uploading and reporting until
//! the goal closes the round) and the turnaround (from the round's close to model version 1 being
//! readable, both seen by a poller), with the turnaround's GB/s of contributions, once with
//! every update below the clip norm and once with every update above it (the simulator's random
//! updates have an L2 norm of about 3). Compare with `cargo bench -p confed-enclave --bench
//! aggregation` (the "1 MB" rows) for the same bytes on the same cores.
//!
//! `cargo bench --bench round`

use std::time::{Duration, Instant};

const DEVICES: usize = 1000;
const PARAMS: usize = 262_144;

#[path = "support/process.rs"]
mod process;
use process::{Server, binary, start};

/// A safetensors file with one F32 tensor `w` of `PARAMS` zeros.
fn model() -> Vec<u8> {
    let header = format!(
        r#"{{"w":{{"dtype":"F32","shape":[{PARAMS}],"data_offsets":[0,{}]}}}}"#,
        PARAMS * 4
    );
    let padded = header.len().div_ceil(8) * 8;
    let mut bytes = (padded as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.resize(8 + padded, b' ');
    bytes.resize(8 + padded + PARAMS * 4, 0);
    bytes
}

/// One round of `DEVICES` 1 MB contributions with `clip_norm`: (collection s, turnaround s).
async fn round(
    http: &reqwest::Client,
    server: &Server,
    population: &str,
    clip_norm: f64,
) -> (f64, f64) {
    let created: serde_json::Value = http
        .post(format!("{}/v1/tasks", server.url))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({
            "population": population,
            "rounds": 1,
            "report_goal": DEVICES,
            "min_reports": DEVICES,
            "round_deadline_seconds": 3600,
            "assignment_timeout_seconds": 600,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": clip_norm},
            "plan": {"epochs": 1, "batch_size": 32, "learning_rate": 0.1},
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let task = created["id"].as_str().expect("a task id").to_string();
    let uploaded = http
        .put(format!("{}/v1/tasks/{task}/model", server.url))
        .bearer_auth(&server.token)
        .body(model())
        .send()
        .await
        .unwrap();
    assert!(
        uploaded.status().is_success(),
        "model upload: {}",
        uploaded.status()
    );
    // A poller watches the round: the first time it is seen out of COLLECTING is its close, the
    // first time model version 1 is readable the end of the turnaround (both to within the 5 ms
    // poll and one loopback request).
    let watcher = {
        let (http, url, token, task) = (
            http.clone(),
            server.url.clone(),
            server.token.clone(),
            task.clone(),
        );
        tokio::spawn(async move {
            let get = |path: String| {
                let request = http.get(format!("{url}{path}")).bearer_auth(&token);
                async move {
                    request
                        .send()
                        .await
                        .unwrap()
                        .json::<serde_json::Value>()
                        .await
                        .unwrap()
                }
            };
            let deadline = Instant::now() + Duration::from_secs(900);
            let mut closed = None;
            loop {
                if closed.is_none() {
                    let rounds = get(format!("/v1/tasks/{task}/rounds")).await;
                    if rounds["rounds"][0]["state"].as_str() != Some("COLLECTING") {
                        closed = Some(Instant::now());
                    }
                }
                if let Some(closed) = closed {
                    let state = get(format!("/v1/tasks/{task}")).await;
                    if state["model_version"].as_i64() == Some(1) {
                        return closed.elapsed().as_secs_f64();
                    }
                }
                assert!(Instant::now() < deadline, "no model version 1");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let started = Instant::now();
    let output = tokio::process::Command::new(binary())
        .args(["devices", "simulate", "--server", &server.url])
        .args([
            "--population",
            population,
            "--devices",
            &DEVICES.to_string(),
        ])
        .args([
            "--concurrency",
            "32",
            "--trust",
            &server.trust,
            "--no-train",
        ])
        .args(["--max-retry-wait-ms", "50"])
        .env("RUST_LOG", "error")
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let collection = started.elapsed().as_secs_f64();
    let turnaround = watcher.await.unwrap();
    (collection, turnaround)
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let server = start();
        let http = confed_protocol::http::client(Duration::from_secs(60));
        let bytes = (DEVICES * (PARAMS * 4 + 200)) as f64 / 1e9;
        println!(
            "== whole rounds: {DEVICES} devices x 1 MB ({PARAMS} f32), confed serve (embedded), {}",
            binary()
        );
        for (label, population, clip_norm) in [
            ("below the clip norm (clip 10)", "round-unclipped", 10.0),
            ("above the clip norm (clip 1)", "round-clipped", 1.0),
        ] {
            let (collection, turnaround) = round(&http, &server, population, clip_norm).await;
            println!(
                "{label}: collection {collection:.2} s ({:.0} cycles/s), turnaround {turnaround:.2} s ({:.2} GB/s)",
                DEVICES as f64 / collection,
                bytes / turnaround
            );
        }
    });
}
