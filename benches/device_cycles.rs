//! Full device cycles (check-in, 16 KB sealed upload, report) against the server with SQLite and
//! local blobs on loopback, driven by the load generator (`confed devices simulate --no-train`).
//! Run with `cargo bench --bench device_cycles`; prints cycles/s and per-call p50/p99.
//!
//! `CONFED_BENCH_DEVICE_AUTH=1` also runs the saturated load on a task that requires device
//! tokens, with a dev token issuer in this process: every simulated device attests (it serves
//! one round, so it never reuses its window's credential: the worst case), obtains a token
//! (blind RSA, a synced grant), and the front end verifies it; it prints the ratio of the two.

use std::time::Duration;

use base64::Engine as _;
use confed::keys::directory::KeyDirectory;
use confed::tools::simulate::{SimulationConfig, run};
use confed_attestation::exchange::{
    KeySet, SignedPublicKey, encode_verifying_key, generate_signing_key, sign_key,
};
use confed_protocol::trust::{TrustConfig, TrustedEntry};

const DEVICES: usize = 6000;
const CONCURRENCY: usize = 64;

fn key_directory() -> (KeyDirectory, TrustConfig) {
    let (_, public) = confed_enclave::hpke::generate_keypair();
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
            suite: confed_enclave::hpke::SUITE.into(),
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
        });
    }
    (
        KeyDirectory::fixed(sets),
        TrustConfig {
            threshold: 2,
            keyservices: trusted,
            shares: None,
            limits: confed_enclave::policy::DeviceLimits::ENCLAVE,
            tenant_id: None,
            token_issuers: Vec::new(),
        },
    )
}

mod support;

/// A dev token issuer on a local port (fresh key, 10 tokens a device a day).
async fn dev_issuer(state: &std::path::Path) -> confed_protocol::trust::TrustedIssuer {
    let signer = confed_protocol::privacy_pass::issuance::TokenSigner::generate().unwrap();
    let token_key = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signer.spki());
    let issuer = confed_issuer::Issuer::new(
        "bench-issuer".into(),
        signer,
        Box::new(confed_issuer::attester::dev::DevAttester),
        confed_issuer::limiter::Limiter::open(state, 10, 86_400).unwrap(),
        86_400,
        std::sync::Arc::new(confed::clock::SystemClock),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = confed_issuer::routes::router(std::sync::Arc::new(issuer));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    confed_protocol::trust::TrustedIssuer {
        name: "bench-issuer".into(),
        token_keys: vec![token_key],
        url,
    }
}

async fn create_task(
    http: &reqwest::Client,
    base: &str,
    token: &str,
    population: &str,
    issuer: Option<&confed_protocol::trust::TrustedIssuer>,
) {
    let mut spec = serde_json::json!({
        "population": population, "rounds": 1, "report_goal": 1_000_000, "min_reports": 1,
        "over_selection": 0.0, "round_deadline_seconds": 3600, "assignment_timeout_seconds": 600,
        "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
    });
    if let Some(issuer) = issuer {
        spec["device_auth"] =
            serde_json::json!({"issuer": issuer.name, "token_keys": issuer.token_keys});
    }
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
    let task_id = task["id"].as_str().unwrap();
    // 4 x 1023 weights + 4 biases = 4096 floats: a 16 KB update.
    let model = confed::tools::train::Softmax::zeros(4, 1023).to_safetensors();
    let put = http
        .put(format!("{base}/v1/tasks/{task_id}/model"))
        .bearer_auth(token)
        .body(model)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 201);
}

fn load(base: &str, population: &str, concurrency: usize, trust: &TrustConfig) -> SimulationConfig {
    SimulationConfig {
        server: base.to_string(),
        population: population.into(),
        devices: DEVICES,
        first_device: 0,
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
        // A load generator: its devices keep nothing on disk (this measures the server).
        state_dir: None,
    }
}

#[tokio::main]
async fn main() {
    let (keys, trust) = key_directory();
    let server = support::start(keys).await;
    let (base, token) = (server.base.clone(), server.token.clone());
    let http = confed_enclave::http::client(Duration::from_secs(30));
    create_task(&http, &base, token.as_str(), "bench", None).await;

    // Two loads: one near 1,000 cycles/s (the latency target's rate), one as fast as it goes.
    let mut saturated = 0.0;
    for (concurrency, label) in [(24, "about 1,000 cycles/s"), (CONCURRENCY, "saturated")] {
        let started = std::time::Instant::now();
        let summary = run(load(&base, "bench", concurrency, &trust))
            .await
            .unwrap();
        saturated = summary.contributions as f64 / started.elapsed().as_secs_f64();
        println!(
            "device cycles ({label}), {DEVICES} devices, {concurrency} concurrent, 16 KB updates, SQLite synchronous=FULL:"
        );
        summary.print();
    }
    if std::env::var_os("CONFED_BENCH_DEVICE_AUTH").is_none() {
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let issuer = dev_issuer(state.path()).await;
    create_task(&http, &base, token.as_str(), "bench-auth", Some(&issuer)).await;
    let mut with_tokens = trust.clone();
    with_tokens.token_issuers.push(issuer);
    let started = std::time::Instant::now();
    let summary = run(load(&base, "bench-auth", CONCURRENCY, &with_tokens))
        .await
        .unwrap();
    let rate = summary.contributions as f64 / started.elapsed().as_secs_f64();
    println!(
        "device cycles with device tokens (saturated), {DEVICES} devices each attesting once and obtaining one token from an in-process dev issuer, {CONCURRENCY} concurrent:"
    );
    summary.print();
    println!(
        "with tokens: {rate:.0} cycles/s against {saturated:.0} without: {:.2} of it (server, issuer and devices share this machine's cores)",
        rate / saturated
    );
}
