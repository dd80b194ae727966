//! `CONFED_BENCH_MASKED=1 cargo bench --bench round`: the cost of masking a round (issue 51).
//! Three rounds of `devices` 1 MB contributions at clip norm 1, all requiring device tokens from a
//! `confed issuer` process (dev attester): in the clear, with `secure_aggregation` (each device
//! clips on the grid and masks, in the ring of 2^32 at these report goals; the enclave sums
//! masked updates, and the three embedded key services agree to the included set and return
//! their mask sums, which the enclave removes; they add the uploads' streams while the round
//! collects, on the same cores, which the collection figures include), and with
//! `distributed_noise` too (the key services draw the noise). Prints the turnarounds and each masked one's throughput as a share
//! of the clear one's (the goal: at least 0.7), each the median of `CONFED_BENCH_REPEATS` (3)
//! interleaved runs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{WorkerKind, binary, round, spec, start_with};

/// A `confed issuer` with the dev attester and a fresh key, on a loopback port; its URL.
fn issuer(dir: &std::path::Path, tokens_per_window: usize) -> (Child, String) {
    let key = dir.join("token-key.pem");
    let made = Command::new(binary())
        .args(["issuer", "generate-key"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(made.status.success(), "issuer generate-key");
    let mut child = Command::new(binary())
        .args(["issuer", "--name", "bench-issuer", "--attester", "dev"])
        // Each device serves one round of each task.
        .args(["--tokens-per-window", &tokens_per_window.to_string()])
        .arg("--signing-key")
        .arg(&key)
        .arg("--state")
        .arg(dir.join("issuer"))
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let url = loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "the issuer exited"
        );
        if let Some(url) = line.trim().strip_prefix("confed: serving on ") {
            break url.to_string();
        }
    };
    (child, url)
}

pub(crate) async fn run(devices: usize) {
    let dir = tempfile::tempdir().unwrap();
    // Each configuration `repeats` times, interleaved, so that a slow moment of the machine
    // falls on all three alike; the medians are compared.
    let repeats: usize = std::env::var("CONFED_BENCH_REPEATS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3)
        .max(1);
    let (mut issuer_process, issuer_url) = issuer(dir.path(), 3 * repeats + 1);
    let trusted = confed::tools::issuer::trusted_issuer(&issuer_url)
        .await
        .unwrap();
    let auth = serde_json::json!({"issuer": trusted.name, "token_keys": trusted.token_keys});
    let http = confed_protocol::http::client(Duration::from_secs(60));
    let bytes = (devices * (super::PARAMS * 4 + 200)) as f64 / 1e9;
    println!(
        "== a round in the clear and masked: {devices} devices x 1 MB, clip norm 1, device tokens from a dev issuer, confed serve (embedded, 2-of-3 key services), {}",
        binary()
    );
    let configurations = [
        (
            "in the clear, with device tokens",
            "round-tokens",
            false,
            false,
        ),
        ("masked (secure_aggregation)", "round-masked", true, false),
        (
            "masked, distributed noise (distributed_noise)",
            "round-distributed",
            true,
            true,
        ),
    ];
    let mut turnarounds = vec![Vec::new(); configurations.len()];
    for repeat in 0..repeats {
        for (index, (label, population, masked, distributed)) in configurations.iter().enumerate() {
            let population = format!("{population}-{repeat}");
            let server = start_with(WorkerKind::InProcess);
            let mut task = spec(&population, devices, 1.0);
            task["device_auth"] = auth.clone();
            if *masked {
                task["secure_aggregation"] = serde_json::json!(true);
            }
            if *distributed {
                task["distributed_noise"] = serde_json::json!(true);
            }
            let m = round(
                &http,
                &server,
                (&population, task),
                devices,
                Some(&issuer_url),
            )
            .await;
            let job = server
                .jobs
                .recv_timeout(Duration::from_secs(10))
                .map_or(f64::NAN, |job| job.seconds);
            println!(
                "{label} ({} of {repeats}): collection {:.2} s ({:.0} cycles/s), turnaround {:.2} s ({:.2} GB/s; job {job:.2} s), peak RSS {:.0} MB",
                repeat + 1,
                m.collection,
                devices as f64 / m.collection,
                m.turnaround,
                bytes / m.turnaround,
                m.peak_rss_mb,
            );
            turnarounds[index].push(m.turnaround);
        }
    }
    let medians: Vec<f64> = turnarounds
        .iter_mut()
        .map(|runs| {
            runs.sort_by(f64::total_cmp);
            runs[runs.len() / 2]
        })
        .collect();
    println!(
        "median turnarounds of {repeats}: clear {:.2} s, masked {:.2} s, masked with distributed noise {:.2} s",
        medians[0], medians[1], medians[2]
    );
    println!(
        "masked turnaround at {:.2} of the clear one's throughput, {:.2} with distributed noise (medians; goal: at least 0.7)",
        medians[0] / medians[1],
        medians[0] / medians[2]
    );
    let _ = issuer_process.kill();
    let _ = issuer_process.wait();
}
