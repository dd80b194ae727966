//! End to end over processes: `confed serve` with two key services, a task with a model, and
//! `confed devices simulate` running a few dozen devices that train, seal and upload through one
//! round's collection. The round must reach its goal with that many stored contributions, and each
//! stored contribution must open, with the key the shares reconstruct, as an update of the model's
//! shape bound to its assignment.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): `confed serve` with its own data directory
//! (SQLite); the simulator is the same on either engine.

use crate::common::{self, serving};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use confed::clock::{ManualClock, Millis};
use confed::keys::ShareFile;
use confed::keys::ceremony::{CeremonyOptions, generate};
use confed::keyservice::{KeyService, KeyServiceParts, routes};
use confed_attestation::{AppraisalPolicy, KeySource};
use confed_enclave::envelope::{self, Envelope};
use serde_json::{Value, json};

use tokio::process::Command;

const BOUND: Duration = Duration::from_secs(120);
const DEVICES: usize = 30;
const GOAL: usize = 24;

async fn key_services(dir: &Path) -> (Vec<String>, confed_protocol::hpke::PrivateKey) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let outcome = generate(&CeremonyOptions {
        shares: 2,
        threshold: 2,
        out_dir: dir.join("ceremony"),
        not_before: now - 60,
        not_after: now + 86_400,
    })
    .unwrap();
    let held: Vec<_> = outcome
        .share_files
        .iter()
        .map(|p| ShareFile::load(p).unwrap())
        .collect();
    let secret = confed_protocol::shares::combine(2, &[&held[0].share, &held[1].share]).unwrap();
    let private = confed_protocol::hpke::PrivateKey::from_bytes(&secret).unwrap();
    let attester = confed_attestation::DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(|| 0),
    );
    let mut urls = Vec::new();
    for (i, path) in outcome.share_files.iter().enumerate() {
        let service = KeyService::new(KeyServiceParts {
            id: format!("ks{}", i + 1),
            audience: format!("confed-keyservice/ks{}", i + 1),
            signing_key: confed_attestation::exchange::generate_signing_key(),
            shares: vec![ShareFile::load(path).unwrap()],
            policy: AppraisalPolicy::load(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/dev.toml"),
            )
            .unwrap(),
            key_source: KeySource::fixed(attester.jwks()),
            audit_log: dir.join(format!("audit-{i}.jsonl")),
            clock: Arc::new(ManualClock::starting_at(Millis(now * 1000))),
        })
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        urls.push(format!("http://{}", listener.local_addr().unwrap()));
        tokio::spawn(async move {
            axum::serve(listener, routes::router(service))
                .await
                .unwrap()
        });
    }
    (urls, private)
}

#[tokio::test]
async fn simulated_devices_fill_a_round_with_stored_contributions_that_open() {
    let dir = tempfile::tempdir().unwrap();
    let (keyservices, private_key) = key_services(dir.path()).await;
    let data = dir.path().join("data");
    let mut serve = serving::confed();
    serve
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data);
    for url in &keyservices {
        serve.args(["--keyservice", url]);
    }
    let serving::Serving {
        child: mut server,
        url,
        demo_token,
        ..
    } = serving::serving(serve, BOUND).await;
    let token = demo_token.unwrap();

    let http = confed_protocol::http::client(BOUND);
    let model = confed::tools::simulate::initial_model(1);
    let task_id = common::open_task_over_http(
        &url,
        &token,
        json!({
            "population": "sim", "rounds": 3, "report_goal": GOAL, "min_reports": GOAL,
            "over_selection": 0.25, "round_deadline_seconds": 3600, "assignment_timeout_seconds": 600,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            "plan": {"epochs": 2, "batch_size": 16, "learning_rate": 0.1},
            "upload_window": common::FAST_UPLOAD_WINDOW.clone(),
        }),
        model.clone(),
    )
    .await;

    let trust = Command::new(env!("CARGO_BIN_EXE_confed"))
        .args(["devices", "trust-config", "--threshold", "2"])
        .args([
            "--max-epsilon",
            "8",
            "--max-delta",
            "1e-5",
            "--min-reports",
            "2",
        ])
        .args(
            keyservices
                .iter()
                .flat_map(|u| ["--keyservice".to_string(), u.clone()]),
        )
        .output()
        .await
        .unwrap();
    assert!(
        trust.status.success(),
        "{}",
        String::from_utf8_lossy(&trust.stderr)
    );
    let trust_file = dir.path().join("trust.json");
    std::fs::write(&trust_file, &trust.stdout).unwrap();

    let simulation = tokio::time::timeout(
        BOUND,
        Command::new(env!("CARGO_BIN_EXE_confed"))
            .args([
                "devices",
                "simulate",
                "--server",
                &url,
                "--population",
                "sim",
            ])
            .args([
                "--devices",
                &DEVICES.to_string(),
                "--concurrency",
                "8",
                "--idle-limit",
                "25",
            ])
            .args(["--max-retry-wait-ms", "100", "--trust"])
            .arg(&trust_file)
            .arg("--state-dir")
            .arg(dir.path().join("devices"))
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&simulation.stdout);
    assert!(
        simulation.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&simulation.stderr)
    );
    assert!(
        stdout.contains(&format!("contributions: {GOAL} ")),
        "{stdout}"
    );
    // Each device kept what it served in its state file, as a real device does across restarts.
    let served: usize = (0..DEVICES)
        .map(|i| dir.path().join(format!("devices/device-{i}.json")))
        .map(confed_device::FileStore::new)
        .map(|store| {
            confed_device::StateStore::load(&store)
                .unwrap()
                .expect("every device wrote its state file")
                .served
                .len()
        })
        .sum();
    // A device that sealed counts the round as served even when its upload came after the goal
    // was reached (410): sealed once is served.
    assert!(
        (GOAL..=DEVICES).contains(&served),
        "{served} served rounds recorded for {GOAL} contributions"
    );

    let rounds: Value = http
        .get(format!("{url}/v1/tasks/{task_id}/rounds"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(rounds["rounds"][0]["state"], "AGGREGATING", "{rounds}");
    assert_eq!(rounds["rounds"][0]["reports_received"], GOAL);

    // Every completed assignment's contribution is on disk and opens only under its own binding.
    server.kill().await.unwrap();
    let db = confed::db::Db::open_sqlite(&data.join("confed.db"))
        .await
        .unwrap();
    let completed = db.completed_contributions(&task_id, 1).await.unwrap();
    assert_eq!(completed.len(), GOAL);
    let store = confed::blob::embedded_contributions(&data).unwrap();
    let schema = confed_worker_api::model::validate_model(&model).unwrap();
    let context = db.round_context(&task_id, 1).await.unwrap();
    let next_round = envelope::RoundContext {
        round: 2,
        ..context.clone()
    };
    for (assignment_ref, blob_key) in &completed {
        let bytes = store
            .get(&confed::blob::BlobKey::new(blob_key.as_str()).unwrap())
            .await
            .expect("stored contribution");
        let sealed = Envelope::from_cbor(&bytes).unwrap();
        let update = envelope::open(&private_key, &sealed, &context, assignment_ref).unwrap();
        assert_eq!(
            confed_worker_api::model::validate_model(&update).unwrap(),
            schema
        );
        assert!(envelope::open(&private_key, &sealed, &next_round, assignment_ref).is_err());
    }
}

/// A trust file that parses (one key service with a fresh key); the runs below fail before
/// any key is fetched.
fn any_trust_file(dir: &Path) -> std::path::PathBuf {
    let signing = confed_attestation::exchange::generate_signing_key();
    let trust = json!({
        "threshold": 1, "shares": 1,
        "keyservices": [{"id": "ks1", "verifying_key":
            confed_attestation::exchange::encode_verifying_key(signing.verifying_key())}],
        "limits": {"max_epsilon": 10.0, "max_delta": 1e-5, "min_reports": 1}
    });
    let path = dir.join("trust.json");
    std::fs::write(&path, trust.to_string()).unwrap();
    path
}

async fn simulate(server: &str, trust: &Path) -> std::process::Output {
    tokio::time::timeout(
        BOUND,
        Command::new(env!("CARGO_BIN_EXE_confed"))
            .args(["devices", "simulate", "--server", server])
            .args(["--population", "sim", "--devices", "2", "--forgetful"])
            .args(["--idle-limit", "2", "--max-retry-wait-ms", "10", "--trust"])
            .arg(trust)
            .output(),
    )
    .await
    .unwrap()
    .unwrap()
}

#[tokio::test]
async fn simulate_refuses_a_server_url_without_a_scheme() {
    let dir = tempfile::tempdir().unwrap();
    let run = simulate("127.0.0.1:8080", &any_trust_file(dir.path())).await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        stderr.contains("\"127.0.0.1:8080\" is not an http:// or https:// URL"),
        "{stderr}"
    );
}

#[tokio::test]
async fn simulate_exits_with_failure_when_the_server_is_down() {
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = simulate(
        &format!("http://127.0.0.1:{port}"),
        &any_trust_file(dir.path()),
    )
    .await;
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{stderr}");
    assert!(
        stderr.contains("device operations failed; the first: device"),
        "{stderr}"
    );
    assert!(stderr.contains("check-in: network"), "{stderr}");
}

/// `confed devices simulate` against a task its devices cannot finish: 4 devices that make one
/// contribution each fill round 1 of a 2-round task, round 2 opens with nobody left for it, and
/// the run exits non-zero naming the round and what the devices did. The same devices run again
/// (they remember round 1) finish round 2 and the task: exit 0.
#[tokio::test]
async fn simulate_exits_non_zero_naming_the_round_when_the_task_did_not_finish() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut serve = serving::confed();
    serve
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data);
    let serving::Serving {
        child: _server,
        url,
        demo_token,
        ..
    } = serving::serving(serve, BOUND).await;
    let token = demo_token.unwrap();
    let http = confed_protocol::http::client(BOUND);
    let task_id = common::open_task_over_http(
        &url,
        &token,
        common::with_fast_window(json!({
            "population": "unfinished", "rounds": 2, "report_goal": 4,
            "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
        })),
        confed::tools::simulate::initial_model(3),
    )
    .await;
    let trust = data.join("embedded").join("trust.json");
    // The first run's settling time is long (it ends as soon as round 2 assigns the probe); the
    // second's, after the task completed, is what it waits in full.
    let run = |settle_ms: &'static str| {
        tokio::time::timeout(
            BOUND,
            Command::new(env!("CARGO_BIN_EXE_confed"))
                .args(["devices", "simulate", "--server", &url])
                .args(["--population", "unfinished", "--devices", "4"])
                .args(["--rounds", "1", "--idle-limit", "10"])
                .args(["--max-retry-wait-ms", "100", "--settle-ms", settle_ms])
                .arg("--state-dir")
                .arg(dir.path().join("devices"))
                .arg("--trust")
                .arg(&trust)
                .output(),
        )
    };
    let first = run("30000").await.unwrap().unwrap();
    let stderr = String::from_utf8_lossy(&first.stderr);
    assert_eq!(first.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "the task did not finish: task {task_id} round 2 still collects contributions, but every simulated device has stopped. 4 of 4 devices made their 1 contribution(s)"
        )),
        "{stderr}"
    );
    assert!(stderr.contains("Run more devices (--devices)"), "{stderr}");

    let second = run("1000").await.unwrap().unwrap();
    assert!(
        second.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&second.stdout),
        String::from_utf8_lossy(&second.stderr)
    );
    let state: Value = http
        .get(format!("{url}/v1/tasks/{task_id}"))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["state"], "COMPLETED", "{state}");
}
