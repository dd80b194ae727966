#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! An honest client's exchanges with a key service while 16 clients flood
//! `GET /v1/audit/acknowledgement` (`cargo bench -p confed-keyservice --bench
//! acknowledgement_flood`). The service is the real binary over a log of 200,000 signed
//! records whose last two were lost and the loss acknowledged, the state that used to make
//! every such request scan the whole file. An honest exchange is what an enclave and a peer begin with: a
//! challenge (`POST /v1/keys/{key}/challenge`) and the audit head (`GET /v1/audit/head`). It
//! prints the honest exchanges in the window and their median, alone and under the flood.
//!
//! `CONFED_BENCH_KEYSERVICE_BIN` runs another build of `confed-keyservice` (to measure the code
//! before a change; its checkpoint is then removed, as an older build may not read it, and it
//! verifies the whole log at start); `CONFED_BENCH_SECONDS` sets the window (10).

mod support;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use confed_keyservice::audit::{AuditLog, LostHead};
use confed_keyservice::ledger::Ledger;
use tokio::io::AsyncBufReadExt;

const RECORDS: u64 = 200_000;
const FLOODERS: usize = 16;

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Writes the log: `RECORDS` records, the last 2 lost and the loss acknowledged (a long-lived
/// service restored from a copy a little behind: its acknowledgement at the end of the file, what
/// a scan reads longest to find). Returns the lost head (what peers ask the acknowledgement of).
fn write_log(path: &Path, key: Arc<p256::ecdsa::SigningKey>) -> LostHead {
    let start = now() - RECORDS as i64;
    let lost = {
        let mut ledger = Ledger::default();
        let (mut log, _) =
            AuditLog::open_checkpointed(path, "ks1", key.clone(), &mut ledger).unwrap();
        for n in 0..RECORDS {
            log.append(support::refusal(n, start + n as i64)).unwrap();
            if log.head().records % 1000 == 0 {
                log.checkpoint(&ledger);
            }
        }
        log.signed_head("ks1")
    };
    let text = std::fs::read_to_string(path).unwrap();
    let kept: String = text
        .lines()
        .take(RECORDS as usize - 2)
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, kept).unwrap();
    // The checkpoint is of the lost head: a restore from an older copy has an older one.
    let _ = std::fs::remove_file(confed_keyservice::checkpoint::path_for(path));
    let lost_head = LostHead {
        records: lost.records,
        hash: lost.hash.clone(),
    };
    confed_keyservice::acknowledge::acknowledge_loss(
        path,
        "ks1",
        key,
        lost_head.clone(),
        lost.signature.as_deref().unwrap(),
        "bench: the last two records were lost",
        now(),
    )
    .unwrap();
    lost_head
}

/// Honest exchanges in `window`: how many, and their median in ms.
async fn honest(http: &reqwest::Client, url: &str, key_id: &str, window: Duration) -> (usize, f64) {
    let mut took = Vec::new();
    let started = Instant::now();
    while started.elapsed() < window {
        let exchange = Instant::now();
        let challenge = http
            .post(format!("{url}/v1/keys/{key_id}/challenge"))
            .send()
            .await
            .unwrap();
        assert!(
            challenge.status().is_success(),
            "{}",
            challenge.text().await.unwrap()
        );
        challenge.bytes().await.unwrap();
        let head = http
            .get(format!("{url}/v1/audit/head"))
            .send()
            .await
            .unwrap();
        assert_eq!(head.status(), 200);
        head.bytes().await.unwrap();
        took.push(exchange.elapsed().as_secs_f64() * 1e3);
    }
    took.sort_by(f64::total_cmp);
    (
        took.len(),
        took.get(took.len() / 2).copied().unwrap_or(f64::NAN),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    confed_protocol::http::install_crypto_provider();
    let window = Duration::from_secs(
        std::env::var("CONFED_BENCH_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(10),
    );
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let dir_path = dir.path().to_path_buf();
    let key_file = dir_path.join("ks1-signing.pem");
    let key = Arc::new(confed_keyservice::load_or_create_signing_key(&key_file).unwrap());
    let log = dir_path.join("audit.jsonl");
    let written = Instant::now();
    let lost = tokio::task::spawn_blocking({
        let log = log.clone();
        move || write_log(&log, key)
    })
    .await
    .unwrap();
    println!(
        "log of {} signed records ({:.0} MB), the loss of a head of {} records acknowledged at its end, written in {:.1} s",
        RECORDS - 1,
        std::fs::metadata(&log).unwrap().len() as f64 / 1e6,
        lost.records,
        written.elapsed().as_secs_f64()
    );
    let outcome = confed_keyservice::keys::ceremony::generate(
        &confed_keyservice::keys::ceremony::CeremonyOptions {
            shares: 3,
            threshold: 2,
            out_dir: dir_path.join("ceremony"),
            not_before: now() - 60,
            not_after: now() + 86_400,
        },
    )
    .unwrap();
    let policies = dir_path.join("policies");
    std::fs::create_dir(&policies).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/dev.toml"),
        policies.join("dev.toml"),
    )
    .unwrap();
    let attester = confed_attestation::dev::DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(now),
    );
    std::fs::write(
        policies.join("dev-attester.jwks.json"),
        attester.jwks_json().to_string(),
    )
    .unwrap();

    let (binary, other_build) = match std::env::var_os("CONFED_BENCH_KEYSERVICE_BIN") {
        Some(binary) => (binary.into(), true),
        None => (
            std::path::PathBuf::from(env!("CARGO_BIN_EXE_confed-keyservice")),
            false,
        ),
    };
    if other_build {
        let _ = std::fs::remove_file(confed_keyservice::checkpoint::path_for(&log));
    }
    let starting = Instant::now();
    let mut child = tokio::process::Command::new(&binary)
        .args(["--id", "ks1", "--listen", "127.0.0.1:0", "--share"])
        .arg(&outcome.share_files[0])
        .arg("--policy")
        .arg(policies.join("dev.toml"))
        .arg("--signing-key")
        .arg(&key_file)
        .arg("--audit-log")
        .arg(&log)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the key service exited before serving");
        if let Some(url) = line.strip_prefix("confed: serving on ") {
            break url.to_string();
        }
    };
    println!(
        "{} serving in {:.1} s",
        binary.display(),
        starting.elapsed().as_secs_f64()
    );
    let http = confed_protocol::http::client(Duration::from_secs(60));
    let key_id = outcome.key.key_id.clone();
    let (alone, alone_p50) = honest(&http, &url, &key_id, window).await;
    println!(
        "alone: {alone} honest exchanges in {} s, p50 {alone_p50:.2} ms",
        window.as_secs()
    );

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let query = format!(
        "{url}/v1/audit/acknowledgement?records={}&hash={}",
        lost.records, lost.hash
    );
    let mut flooders = tokio::task::JoinSet::new();
    for _ in 0..FLOODERS {
        let (http, query, stop, answered) =
            (http.clone(), query.clone(), stop.clone(), answered.clone());
        flooders.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let reply = http.get(&query).send().await.unwrap();
                assert_eq!(reply.status(), 200);
                reply.bytes().await.unwrap();
                answered.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let (flooded, flooded_p50) = honest(&http, &url, &key_id, window).await;
    stop.store(true, Ordering::Relaxed);
    while flooders.join_next().await.is_some() {}
    println!(
        "under {FLOODERS} clients flooding the acknowledgement route ({} answers): {flooded} \
         honest exchanges in {} s, p50 {flooded_p50:.2} ms ({:.2} of alone)",
        answered.load(Ordering::Relaxed),
        window.as_secs(),
        flooded as f64 / alone.max(1) as f64
    );
    child.kill().await.ok();
}
