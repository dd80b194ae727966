#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Honest load under a flood (issue 13): a real `confed serve` (the release binary: run
//! `cargo build --release` first, or set CONFED_BIN), honest devices from a second process
//! (`confed devices simulate --no-train`), and from this process a flood of
//! - check-ins with the largest attributes accepted and with 256 KiB of attributes (refused),
//! - uploads of a declared 500 MiB to made-up assignment ids,
//! - challenges to the embedded key services,
//! - release requests with never-issued nonces,
//!
//! each at a fixed rate (a few hundred per second, above what the issue measured). Prints the
//! honest device cycles/s and rounds released/s without and with the flood, the ratio, the
//! server's peak RSS, and what the flood sent. Run with `cargo bench --bench flood`.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

const HONEST_DEVICES: usize = 8000;
const REPORT_GOAL: u32 = 2000;

#[path = "support/process.rs"]
mod process;
use process::{Server, binary, start};

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

async fn current_round(http: &reqwest::Client, server: &Server, task: &str) -> u64 {
    let task: serde_json::Value = http
        .get(format!("{}/v1/tasks/{task}", server.url))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    task["current_round"].as_u64().unwrap()
}

/// Runs the honest devices to completion; returns (cycles/s, rounds released/s).
async fn honest(http: &reqwest::Client, server: &Server, task: &str, seed: u64) -> (f64, f64) {
    let before = current_round(http, server, task).await;
    let started = Instant::now();
    let output = tokio::process::Command::new(binary())
        .args([
            "devices",
            "simulate",
            "--server",
            &server.url,
            "--population",
            "flood",
        ])
        .args([
            "--devices",
            &HONEST_DEVICES.to_string(),
            "--concurrency",
            "16",
        ])
        .args([
            "--trust",
            &server.trust,
            "--no-train",
            "--seed",
            &seed.to_string(),
        ])
        // Timed: no settling check after the last device (the bench reads the rounds itself).
        .args([
            "--max-retry-wait-ms",
            "50",
            "--idle-limit",
            "1000",
            "--settle-ms",
            "0",
        ])
        .env("RUST_LOG", "error")
        .output()
        .await
        .unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&output.stdout);
    let cycles: f64 = text
        .split("cycles/s: ")
        .nth(1)
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no summary from the simulator: {text}"));
    let rounds = current_round(http, server, task).await - before;
    (cycles, rounds as f64 / elapsed)
}

#[derive(Default)]
struct Sent {
    checkins: AtomicU64,
    uploads: AtomicU64,
    challenges: AtomicU64,
    releases: AtomicU64,
    server_errors: AtomicU64,
}

/// Calls `request` `per_second` times a second (4 in flight at most) until `stop`.
fn flood<F, Fut>(
    per_second: u64,
    stop: Arc<AtomicBool>,
    counter: impl Fn() + Send + Sync + 'static,
    request: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Option<u16>> + Send + 'static,
{
    let request = Arc::new(request);
    let counter = Arc::new(counter);
    tokio::spawn(async move {
        let permits = Arc::new(tokio::sync::Semaphore::new(4));
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / per_second));
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let Ok(permit) = permits.clone().try_acquire_owned() else {
                continue;
            };
            let (request, counter) = (request.clone(), counter.clone());
            tokio::spawn(async move {
                if request().await.is_some() {
                    counter();
                }
                drop(permit);
            });
        }
    })
}

fn junk_release(key_id: &str) -> serde_json::Value {
    let (_, ephemeral) = confed_protocol::hpke::generate_keypair();
    let signing = confed_attestation::exchange::generate_signing_key();
    let policy = confed_protocol::policy::TaskPolicy::sample("flood-task", 3);
    serde_json::json!({
        "token": "eyJhbGciOiJFUzI1NiJ9.e30.c2ln",
        "ephemeral_public_key": URL_SAFE_NO_PAD.encode(ephemeral.0),
        "enclave_signing_key": confed_attestation::exchange::encode_verifying_key(signing.verifying_key()),
        "nonce": URL_SAFE_NO_PAD.encode([7u8; 40]),
        "task_id": "flood-task",
        "round": 1,
        "commitment": {"task_id": "flood-task", "round": 1, "key_id": key_id,
            "policy_sha256": policy.sha256_hex(), "model_sha256": "0".repeat(64),
            "inputs_digest": "1".repeat(64)},
        "policy": policy.encode(),
    })
}

fn main() {
    confed_protocol::http::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let server = start();
        let pid = server.child.id();
        let http = confed_protocol::http::client(Duration::from_secs(30));
        let model = std::env::temp_dir().join(format!("flood-model-{pid}.safetensors"));
        assert!(Command::new(binary()).args(["devices", "init-model", "--out"]).arg(&model)
            .stdout(Stdio::null()).status().unwrap().success());
        let spec = serde_json::json!({"population": "flood", "rounds": 100,
            "report_goal": REPORT_GOAL, "min_reports": 1,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0}});
        let task = server.open_task(&http, spec, std::fs::read(&model).unwrap()).await;
        let key_id = {
            let set: serde_json::Value = http
                .get(format!("{}/v1/keys", server.keyservices[0]))
                .send().await.unwrap().json().await.unwrap();
            set["keys"][0]["key_id"].as_str().unwrap().to_string()
        };

        let peak = Arc::new(AtomicU64::new(0));
        let sampling = Arc::new(AtomicBool::new(true));
        {
            let (peak, sampling) = (peak.clone(), sampling.clone());
            tokio::spawn(async move {
                while sampling.load(Ordering::Relaxed) {
                    peak.fetch_max(rss_kib(pid, "VmRSS:"), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }

        // Warm-up, then the unflooded figure.
        honest(&http, &server, &task, 1).await;
        let quiet = honest(&http, &server, &task, 2).await;
        let quiet_peak = peak.swap(0, Ordering::Relaxed);

        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Sent::default());
        let mut floods = Vec::new();
        let big_attributes: serde_json::Map<String, serde_json::Value> =
            (0..32).map(|i| (format!("a{i:02}"), serde_json::json!("x".repeat(256)))).collect();
        let huge_attributes: serde_json::Map<String, serde_json::Value> =
            (0..1000).map(|i| (format!("b{i:04}"), serde_json::json!("y".repeat(250)))).collect();
        for (attributes, rate) in [(big_attributes, 200), (huge_attributes, 100)] {
            let (http, url, sent_now, sent_errors) =
                (http.clone(), server.url.clone(), sent.clone(), sent.clone());
            let body = serde_json::json!({"client_version": "1.0", "attributes": attributes});
            floods.push(flood(rate, stop.clone(), move || { sent_now.checkins.fetch_add(1, Ordering::Relaxed); }, move || {
                let (http, url, body, errors) = (http.clone(), url.clone(), body.clone(), sent_errors.clone());
                async move {
                    let status = http.post(format!("{url}/v1/populations/someone-elses/checkin"))
                        .json(&body).send().await.ok()?.status().as_u16();
                    if status >= 500 { errors.server_errors.fetch_add(1, Ordering::Relaxed); }
                    Some(status)
                }
            }));
        }
        {
            let (http, url, sent_now, sent_errors) = (http.clone(), server.url.clone(), sent.clone(), sent.clone());
            floods.push(flood(50, stop.clone(), move || { sent_now.uploads.fetch_add(1, Ordering::Relaxed); }, move || {
                let (http, url, errors) = (http.clone(), url.clone(), sent_errors.clone());
                async move {
                    // 500 MiB declared; the body never comes unless the server asks for it.
                    let body = reqwest::Body::wrap_stream(futures_util::stream::pending::<Result<Vec<u8>, std::io::Error>>());
                    let made_up = URL_SAFE_NO_PAD.encode(rand_bytes());
                    let status = http.put(format!("{url}/v1/assignments/{made_up}/contribution"))
                        .header("content-type", "application/cbor")
                        .header("content-length", (500u64 << 20).to_string())
                        .body(body).send().await.ok()?.status().as_u16();
                    if status >= 500 { errors.server_errors.fetch_add(1, Ordering::Relaxed); }
                    Some(status)
                }
            }));
        }
        for keyservice in server.keyservices.clone() {
            let (client, key, sent_now, sent_errors) = (http.clone(), key_id.clone(), sent.clone(), sent.clone());
            let url = keyservice.clone();
            floods.push(flood(100, stop.clone(), move || { sent_now.challenges.fetch_add(1, Ordering::Relaxed); }, move || {
                let (http, url, key, errors) = (client.clone(), url.clone(), key.clone(), sent_errors.clone());
                async move {
                    let status = http.post(format!("{url}/v1/keys/{key}/challenge")).send().await.ok()?.status().as_u16();
                    if status >= 500 { errors.server_errors.fetch_add(1, Ordering::Relaxed); }
                    Some(status)
                }
            }));
            let (client, key, sent_now, sent_errors) = (http.clone(), key_id.clone(), sent.clone(), sent.clone());
            let body = junk_release(&key_id);
            floods.push(flood(250, stop.clone(), move || { sent_now.releases.fetch_add(1, Ordering::Relaxed); }, move || {
                let (http, url, key, body, errors) = (client.clone(), keyservice.clone(), key.clone(), body.clone(), sent_errors.clone());
                async move {
                    let status = http.post(format!("{url}/v1/keys/{key}/release")).json(&body).send().await.ok()?.status().as_u16();
                    if status >= 500 { errors.server_errors.fetch_add(1, Ordering::Relaxed); }
                    Some(status)
                }
            }));
        }
        let flood_started = Instant::now();
        let flooded = honest(&http, &server, &task, 3).await;
        let flood_seconds = flood_started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for f in floods {
            let _ = f.await;
        }
        let flooded_peak = peak.load(Ordering::Relaxed);
        sampling.store(false, Ordering::Relaxed);
        let rate = |n: &AtomicU64| n.load(Ordering::Relaxed) as f64 / flood_seconds;

        println!("honest load: {HONEST_DEVICES} devices, 16 at a time, rounds of {REPORT_GOAL}");
        println!("| phase | device cycles/s | rounds released/s | server peak RSS |");
        println!("|---|---|---|---|");
        println!("| no flood | {:.0} | {:.2} | {:.0} MB |", quiet.0, quiet.1, quiet_peak as f64 / 1024.0);
        println!("| flood | {:.0} | {:.2} | {:.0} MB |", flooded.0, flooded.1, flooded_peak as f64 / 1024.0);
        println!("honest throughput under the flood: {:.0} % of unflooded (cycles), {:.0} % (rounds)",
            100.0 * flooded.0 / quiet.0, 100.0 * flooded.1 / quiet.1.max(1e-9));
        println!("flood answered per second: check-ins {:.0}, 500 MiB uploads to made-up ids {:.0}, challenges {:.0}, junk releases {:.0}; 5xx answers: {}",
            rate(&sent.checkins), rate(&sent.uploads), rate(&sent.challenges), rate(&sent.releases),
            sent.server_errors.load(Ordering::Relaxed));
        println!("server peak RSS over the run (VmHWM): {:.0} MB", rss_kib(pid, "VmHWM:") as f64 / 1024.0);
        let _ = std::fs::remove_file(model);
    });
}

fn rand_bytes() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).unwrap();
    bytes
}
