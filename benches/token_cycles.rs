#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! What device tokens cost the server, measured on the server alone
//! (`cargo bench --bench token_cycles`): `confed serve` and `confed issuer` run as processes of
//! their own, the load generator (6,000 devices, 64 concurrent, 16 KB updates, SQLite) in this
//! one, and the server's CPU time (from /proc) is read around each run, once on a task without
//! device tokens and once on one that requires them. The server's capacity is its cores over its
//! CPU per cycle, so the ratio of the two CPU figures is what tokens cost a server whose issuer
//! and devices run elsewhere, as deployed; the cycles/s printed beside it are this 2-core
//! machine's, shared by all three.
//!
//! With `CONFED_BENCH_GCS_ENDPOINT` set to a GCS emulator (`deploy/local/gcs-emulator.sh start DIR
//! PORT` prints one), the server keeps its blobs in a fresh bucket there: devices upload straight
//! to signed URLs and the report checks the object, and with tokens reads the envelope's head and
//! tail back and verifies the token (issue 46), so the CPU figures compare that path.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use confed::tools::simulate::run;
use confed_protocol::trust::TrustConfig;

mod cycles;
use cycles::{DEVICES, load, task};

const CONCURRENCY: usize = 64;

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    // SAFETY: sysconf only reads a configuration value.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

/// Starts `confed ARGS`, returns it and the lines it printed up to `confed: serving on URL`.
fn start(args: &[&str], env: &[(&str, &str)]) -> (Child, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_confed"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "{args:?} exited: {lines:?}"
        );
        let done = line.starts_with("confed: serving on ");
        lines.push(line.trim().to_string());
        if done {
            break;
        }
    }
    // Keep draining, so a full pipe never stops the child.
    std::thread::spawn(move || for _ in reader.lines() {});
    (child, lines)
}

fn url_of(lines: &[String]) -> String {
    lines
        .last()
        .unwrap()
        .strip_prefix("confed: serving on ")
        .unwrap()
        .to_string()
}

#[tokio::main]
async fn main() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "a".repeat(40);
    let data = dir.path().join("data");
    let mut serve_args: Vec<String> = ["serve", "--listen", "127.0.0.1:0", "--data-dir"]
        .map(String::from)
        .to_vec();
    serve_args.push(data.to_str().unwrap().into());
    if let Ok(endpoint) = std::env::var("CONFED_BENCH_GCS_ENDPOINT") {
        let bucket = format!("confed-bench-{}", std::process::id());
        let created = confed_protocol::http::client(Duration::from_secs(30))
            .post(format!("{endpoint}/storage/v1/b"))
            .json(&serde_json::json!({ "name": bucket }))
            .send()
            .await
            .unwrap();
        assert!(created.status().is_success(), "{}", created.status());
        let signer = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gcs-test-signer.json");
        serve_args.extend([
            "--blobs".into(),
            format!("gs://{bucket}/confed"),
            "--gcs-endpoint".into(),
            endpoint.clone(),
            "--gcs-signing-key-file".into(),
            signer.to_str().unwrap().into(),
        ]);
        println!("blobs on the GCS emulator at {endpoint}: devices upload to signed URLs");
    }
    let serve_args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let (mut server, lines) = start(&serve_args, &[("CONFED_ADMIN_TOKEN", admin.as_str())]);
    let base = url_of(&lines);
    let trust_path = lines
        .iter()
        .find_map(|l| {
            l.split_once("Device trust file: ")
                .map(|(_, p)| p.to_string())
        })
        .expect("the embedded server names its trust file");
    let mut trust: TrustConfig =
        serde_json::from_str(&std::fs::read_to_string(trust_path).unwrap()).unwrap();
    let key = dir.path().join("token-key.pem");
    let made = Command::new(env!("CARGO_BIN_EXE_confed"))
        .args(["issuer", "generate-key"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(made.status.success());
    let (mut issuer, lines) = start(
        &[
            "issuer",
            "--name",
            "bench-issuer",
            "--attester",
            "dev",
            "--tokens-per-window",
            "10",
            "--signing-key",
            key.to_str().unwrap(),
            "--state",
            dir.path().join("issuer").to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ],
        &[],
    );
    let issuer_url = url_of(&lines);
    let trusted = confed::tools::issuer::trusted_issuer(&issuer_url)
        .await
        .unwrap();

    let http = confed_protocol::http::client(Duration::from_secs(30));
    let tenant: serde_json::Value = http
        .post(format!("{base}/v1/admin/tenants"))
        .bearer_auth(&admin)
        .json(
            &serde_json::json!({"name": "bench", "max_active_tasks": 100,
            "max_report_goal": 1_000_000, "max_device_hours": 1_000_000_000}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = tenant["token"]
        .as_str()
        .unwrap_or_else(|| panic!("{tenant}"));
    let spec = |population: &str| {
        serde_json::json!({
            "population": population, "rounds": 1, "report_goal": 1_000_000, "min_reports": 1,
            "over_selection": 0.0, "round_deadline_seconds": 3600,
            "assignment_timeout_seconds": 600,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            // Every device sends at once (its send instant 0 ms after the assignment, so the
            // update is zeros): the server's and the issuer's CPU per cycle, as before windows.
            "upload_window": {"start_ms": 0, "end_ms": 0},
        })
    };
    task(&http, &base, token, spec("plain")).await;
    let mut authed = spec("authed");
    authed["device_auth"] =
        serde_json::json!({"issuer": trusted.name, "token_keys": trusted.token_keys});
    task(&http, &base, token, authed).await;

    // The server's CPU per cycle falls as its load rises (group commits carry more writes), so
    // the plain task runs saturated and also at fewer concurrent devices, near the rate the
    // token run reaches on these shared cores: compare at a matched rate.
    let runs = [
        ("plain", CONCURRENCY, "without tokens, saturated"),
        ("plain", 8, "without tokens, 8 concurrent"),
        ("plain", 4, "without tokens, 4 concurrent"),
        ("plain", 2, "without tokens, 2 concurrent"),
        ("authed", CONCURRENCY, "with device tokens, 64 concurrent"),
    ];
    let mut per_cycle = Vec::new();
    for (index, (population, concurrency, label)) in runs.into_iter().enumerate() {
        if population == "authed" {
            trust.token_issuers.push(trusted.clone());
        }
        let (server_before, issuer_before) = (cpu_seconds(server.id()), cpu_seconds(issuer.id()));
        let started = Instant::now();
        let first = (index * DEVICES) as u64;
        let summary = run(load(&base, population, &trust, first, concurrency))
            .await
            .unwrap();
        let elapsed = started.elapsed().as_secs_f64();
        let cycles = summary.contributions as f64;
        let server_cpu = (cpu_seconds(server.id()) - server_before) / cycles;
        let issuer_cpu = (cpu_seconds(issuer.id()) - issuer_before) / cycles;
        per_cycle.push((cycles / elapsed, server_cpu));
        println!(
            "{label}: {cycles} cycles in {elapsed:.2} s ({:.0}/s on the shared cores), failures {}; server CPU {:.3} ms a cycle; issuer CPU {:.3} ms a cycle",
            cycles / elapsed,
            summary.failures.len(),
            server_cpu * 1e3,
            issuer_cpu * 1e3
        );
    }
    let (token_rate, token_cpu) = per_cycle[4];
    let (matched_rate, matched_cpu) = per_cycle[..4]
        .iter()
        .copied()
        .min_by(|a, b| {
            (a.0 - token_rate)
                .abs()
                .total_cmp(&(b.0 - token_rate).abs())
        })
        .unwrap();
    println!(
        "the server's CPU per cycle with device tokens against without, at a matched rate ({token_rate:.0}/s against {matched_rate:.0}/s): {:.3} ms against {:.3} ms: capacity with tokens {:.2} of it without",
        token_cpu * 1e3,
        matched_cpu * 1e3,
        matched_cpu / token_cpu
    );
    let _ = server.kill();
    let _ = issuer.kill();
}
