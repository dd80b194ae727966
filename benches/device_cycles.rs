#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Full device cycles (check-in, 16 KB sealed upload, report) against the server with SQLite and
//! local blobs on loopback, driven by the load generator (`confed devices simulate --no-train`).
//! Run with `cargo bench --bench device_cycles`; prints cycles/s and per-call p50/p99. With
//! `CONFED_BENCH_DATABASE_URL=postgres://...` it then runs the saturated load on one and on two
//! API replicas over that PostgreSQL database (`deploy/local/postgres.sh start DIR` gives one) and
//! prints their cycles/s against SQLite's in the same run.
//!
//! What device tokens cost the server is `benches/token_cycles.rs`.

use std::time::Duration;

use base64::Engine as _;
use confed::keys::directory::KeyDirectory;
use confed::tools::simulate::run;
use confed_attestation::exchange::{
    KeySet, SignedPublicKey, encode_verifying_key, generate_signing_key, sign_key,
};
use confed_protocol::trust::{TrustConfig, TrustedEntry};

const CONCURRENCY: usize = 64;
/// `CONCURRENCY` plus what a 100 ms mean wait holds in flight at about 2,500 cycles/s.
const WINDOW_CONCURRENCY: usize = 320;

fn key_directory() -> (KeyDirectory, TrustConfig) {
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let mut sets = Vec::new();
    let mut trusted = Vec::new();
    for id in ["ks1", "ks2"] {
        let signing = generate_signing_key();
        let mut entry = SignedPublicKey {
            key_id: "kbench".into(),
            suite: confed_protocol::hpke::SUITE.into(),
            public_key: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(public.0),
            not_before: now - 60,
            not_after: now + 86_400,
            threshold: 2,
            shares: 2,
            state: "active".into(),
            signature: String::new(),
        };
        sign_key(&signing, id, &mut entry);
        let verifying_key = encode_verifying_key(signing.verifying_key());
        trusted.push(TrustedEntry {
            id: id.into(),
            verifying_key: verifying_key.clone(),
        });
        sets.push(KeySet {
            keyservice_id: id.into(),
            verifying_key,
            keys: vec![entry],
            masking_key: None,
        });
    }
    (
        KeyDirectory::fixed(sets),
        TrustConfig {
            threshold: 2,
            keyservices: trusted,
            shares: None,
            limits: confed_protocol::policy::DeviceLimits::ENCLAVE,
            tenant_id: None,
            token_issuers: Vec::new(),
            require_masking: false,
            require_distributed_noise: false,
        },
    )
}

mod support;

mod cycles;
use cycles::{DEVICES, load, task};

#[tokio::main]
async fn main() {
    let (keys, trust) = key_directory();
    let server = support::start(keys.clone()).await;
    let (base, token) = (server.base.clone(), server.token.clone());
    let http = confed_protocol::http::client(Duration::from_secs(30));
    let spec = |population: &str, window: (u32, u32)| {
        serde_json::json!({
            "population": population, "rounds": 1, "report_goal": 1_000_000, "min_reports": 1,
            "over_selection": 0.0, "round_deadline_seconds": 3600, "assignment_timeout_seconds": 600,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            "upload_window": {"start_ms": window.0, "end_ms": window.1},
        })
    };
    // Devices send at an instant drawn in the task's upload window (docs/privacy.md, "Time"):
    // with a window each device waits, so the same server load needs more devices in flight
    // (Little's law: the mean wait, 100 ms, times the rate). The server's work per cycle is the
    // same; the window-0 task (every device sends at once, zeros: nothing is ready at a 0 ms
    // instant) measures it as before upload windows existed.
    task(&http, &base, token.as_str(), spec("bench", (50, 150))).await;
    task(&http, &base, token.as_str(), spec("bench-at-once", (0, 0))).await;

    // Loads near 1,000 cycles/s (the latency target's rate) and as fast as it goes.
    let runs = [
        ("bench", 124, "about 1,000 cycles/s, window 50-150 ms"),
        ("bench", WINDOW_CONCURRENCY, "saturated, window 50-150 ms"),
        ("bench-at-once", CONCURRENCY, "saturated, window 0 ms"),
    ];
    let mut sqlite_saturated = f64::NAN;
    for (index, (population, concurrency, label)) in runs.into_iter().enumerate() {
        let first = (index * DEVICES) as u64;
        let summary = run(load(&base, population, &trust, first, concurrency))
            .await
            .unwrap();
        println!(
            "device cycles ({label}), {DEVICES} devices, {concurrency} concurrent, 16 KB updates, SQLite synchronous=FULL:"
        );
        summary.print_without_zeroed();
        sqlite_saturated = summary.contributions as f64 / summary.elapsed.as_secs_f64();
    }
    // The same saturated load (window 0 ms) on API replicas over one PostgreSQL database.
    if let Ok(url) = std::env::var("CONFED_BENCH_DATABASE_URL") {
        drop(server);
        for replicas in [1, 2] {
            let rate =
                postgres_cycles(&keys, &trust, &url, replicas, spec("bench-pg", (0, 0))).await;
            println!(
                "PostgreSQL, {replicas} API replica(s), saturated, window 0 ms: {rate:.0} cycles/s, at {:.2} of SQLite's {sqlite_saturated:.0} in this run",
                rate / sqlite_saturated
            );
        }
    }
}

/// Cycles per second of `DEVICES` devices split over `replicas` API replicas on a fresh database
/// of the PostgreSQL server at `url` (a task of `spec` created through the first; `CONCURRENCY` devices in flight
/// in all), each replica's devices driven by a load generator of their own, all at once.
async fn postgres_cycles(
    keys: &KeyDirectory,
    trust: &TrustConfig,
    url: &str,
    replicas: usize,
    mut spec: serde_json::Value,
) -> f64 {
    let (database, name) = support::fresh_database(url).await;
    let servers = support::start_replicas(keys.clone(), &database, replicas).await;
    // A population named after the run (the database is this measurement's own as well).
    let population = format!("bench-pg-{}-{replicas}", std::process::id());
    spec["population"] = serde_json::json!(population);
    let http = confed_protocol::http::client(Duration::from_secs(30));
    task(&http, &servers[0].base, &servers[0].token, spec).await;
    let share = DEVICES / replicas;
    let runs = servers.iter().enumerate().map(|(index, server)| {
        let mut config = load(
            &server.base,
            &population,
            trust,
            (index * share) as u64,
            CONCURRENCY / replicas,
        );
        config.devices = share;
        run(config)
    });
    let summaries = futures_util::future::join_all(runs).await;
    let mut contributions = 0;
    let mut slowest = 0f64;
    for summary in summaries {
        let summary = summary.unwrap();
        summary.print_without_zeroed();
        if let Some(first) = summary.failures.first() {
            println!("first of {} failures: {first}", summary.failures.len());
        }
        contributions += summary.contributions;
        slowest = slowest.max(summary.elapsed.as_secs_f64());
    }
    drop(servers);
    support::drop_database(url, &name).await;
    contributions as f64 / slowest
}
