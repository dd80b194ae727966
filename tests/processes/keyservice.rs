//! The `confed keys` and `confed keyservice` commands as processes (the signed key set, the
//! signed audit log, and a release ledger that survives kill -9), and the HTTPS key fetcher
//! against a local issuer serving a discovery document and a JWKS.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key service processes only; no task database or
//! blob store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::exchange::{Challenge, KeySet, ReleaseRequest, encode_verifying_key};
use confed_attestation::keys::JwksFetcher;
use confed_attestation::release::{ReleaseCommitment, key_binding};
use confed_attestation::{Attester, DevAttester, TokenRequest};
use confed_protocol::policy::TaskPolicy;
use tokio::process::Child;

const BOUND: Duration = Duration::from_secs(60);

use crate::common::serving;
use serving::{confed, serving};

#[tokio::test]
async fn ceremony_then_key_service_serves_a_signed_key_set_and_audit_verify_checks_the_log() {
    let setup = setup().await;
    let (mut child, url) = start(&setup).await;
    let audit_log = setup.dir.path().join("audit.jsonl");
    let set = key_set(&url).await;
    assert_eq!(set.keyservice_id, "ks1");
    let trusted =
        confed_protocol::trust::TrustedKeyService::new("ks1", &set.verifying_key).unwrap();
    assert!(confed_attestation::exchange::verify_key(
        &trusted.verifying_key,
        "ks1",
        &set.keys[0]
    ));
    let head: serde_json::Value = confed_protocol::http::client(BOUND)
        .get(format!("{url}/v1/audit/head"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(head["keyservice_id"], "ks1");
    assert_eq!(head["records"], 0);
    // Its operator's routes: ready (no peers to wait for), and its metrics.
    assert_eq!(get_text(&format!("{url}/readyz")).await.0, 200);
    let (_, metrics) = get_text(&format!("{url}/metrics")).await;
    for line in [
        "confed_build_info{process=\"confed-keyservice\"",
        "confed_keyservice_decisions_total{decision=\"granted\"} 0",
        "confed_keyservice_rolled_back 0",
        "confed_ready{role=\"keyservice\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
    child.kill().await.unwrap();

    let verify = confed()
        .args(["keyservice", "audit", "verify"])
        .arg(&audit_log)
        .args(["--id", "ks1", "--verifying-key", &set.verifying_key])
        .output()
        .await
        .unwrap();
    assert!(
        verify.status.success(),
        "{}",
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(String::from_utf8_lossy(&verify.stdout).contains("0 records"));

    std::fs::write(&audit_log, "{\"seq\":0}\n").unwrap();
    let broken = confed()
        .args(["keyservice", "audit", "verify"])
        .arg(&audit_log)
        .args(["--id", "ks1", "--verifying-key", &set.verifying_key])
        .output()
        .await
        .unwrap();
    assert!(!broken.status.success());
    assert!(String::from_utf8_lossy(&broken.stderr).contains("broken at line 1"));
}

#[tokio::test]
async fn key_service_refuses_to_start_on_bad_input_with_a_reason() {
    let dir = tempfile::tempdir().unwrap();
    let output = confed()
        .args([
            "keyservice",
            "--id",
            "ks1",
            "--share",
            "/nonexistent/share.json",
            "--policy",
        ])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/policies/dev.toml"))
        .arg("--signing-key")
        .arg(dir.path().join("k.pem"))
        .arg("--audit-log")
        .arg(dir.path().join("a.jsonl"))
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.starts_with("error: "), "{stderr}");
}

#[tokio::test]
async fn fetcher_follows_discovery_to_the_key_set() {
    let attester = confed_attestation::DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        std::sync::Arc::new(|| 0),
    );
    let jwks = attester.jwks_json();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let discovery = serde_json::json!({"issuer": "x", "jwks_uri": format!("{base}/keys")});
    let app = axum::Router::new()
        .route(
            "/.well-known/openid-configuration",
            axum::routing::get(move || async move { axum::Json(discovery) }),
        )
        .route(
            "/keys",
            axum::routing::get(move || async move { axum::Json(jwks) }),
        )
        .route(
            "/no-uri",
            axum::routing::get(|| async { axum::Json(serde_json::json!({})) }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let fetcher = confed::keyservice::fetcher::HttpJwksFetcher::new().unwrap();
    let keys = fetcher
        .fetch(&format!("{base}/.well-known/openid-configuration"))
        .await
        .unwrap();
    assert!(keys.get(confed_attestation::dev::DEV_KID).is_some());
    let error = fetcher.fetch(&format!("{base}/no-uri")).await.unwrap_err();
    assert!(error.contains("jwks_uri"), "{error}");
    let error = fetcher.fetch(&format!("{base}/missing")).await.unwrap_err();
    assert!(error.contains("404"), "{error}");
}

struct Setup {
    dir: tempfile::TempDir,
    share: PathBuf,
    key_id: String,
    attester: DevAttester,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ceremony");
    let generated = confed()
        .args([
            "keys",
            "generate",
            "--shares",
            "3",
            "--threshold",
            "2",
            "--out",
        ])
        .arg(&out)
        .output()
        .await
        .unwrap();
    assert!(generated.status.success());
    let keyset: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("keyset.json")).unwrap()).unwrap();
    let key_id = keyset["keys"][0]["key_id"].as_str().unwrap().to_string();
    let share = out.join(format!("share-{key_id}-1.json"));
    let attester = DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64
        }),
    );
    let policy_dir = dir.path().join("policies");
    std::fs::create_dir(&policy_dir).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/policies/dev.toml"),
        policy_dir.join("dev.toml"),
    )
    .unwrap();
    std::fs::write(
        policy_dir.join("dev-attester.jwks.json"),
        attester.jwks_json().to_string(),
    )
    .unwrap();
    Setup {
        dir,
        share,
        key_id,
        attester,
    }
}

/// `confed keyservice ...` over the setup's share, policy, signing key and audit log.
fn keyservice_args(setup: &Setup) -> Vec<std::ffi::OsString> {
    let dir = setup.dir.path();
    let mut args: Vec<std::ffi::OsString> = [
        "keyservice",
        "--id",
        "ks1",
        "--listen",
        "127.0.0.1:0",
        "--share",
    ]
    .map(Into::into)
    .to_vec();
    args.push(setup.share.clone().into());
    for (flag, path) in [
        ("--policy", dir.join("policies/dev.toml")),
        ("--signing-key", dir.join("ks1-signing.pem")),
        ("--audit-log", dir.join("audit.jsonl")),
    ] {
        args.push(flag.into());
        args.push(path.into());
    }
    args
}

async fn start(setup: &Setup) -> (Child, String) {
    let mut command = confed();
    command.args(keyservice_args(setup));
    let started = serving(command, BOUND).await;
    (started.child, started.url)
}

/// One release request for round 1 over inputs named `inputs`; returns the HTTP status and body.
async fn release(setup: &Setup, url: &str, inputs: &str) -> (u16, serde_json::Value) {
    let http = confed_protocol::http::client(BOUND);
    let key_id = &setup.key_id;
    let challenge: Challenge = http
        .post(format!("{url}/v1/keys/{key_id}/challenge"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let policy = TaskPolicy::sample("task-1", 3);
    let commitment = ReleaseCommitment {
        task_id: "task-1".into(),
        round: 1,
        key_id: key_id.clone(),
        policy_sha256: policy.sha256_hex(),
        model_sha256: "0".repeat(64),
        inputs_digest: inputs.repeat(64),
    };
    let (_, ephemeral) = confed_protocol::hpke::generate_keypair();
    let signing = confed_attestation::exchange::generate_signing_key();
    let binding = key_binding(
        &ephemeral.0,
        signing.verifying_key().to_sec1_point(false).as_bytes(),
        &commitment.digest(),
    );
    let token = setup
        .attester
        .token(&TokenRequest {
            audience: challenge.audience.clone(),
            nonces: vec![challenge.nonce.clone(), binding],
        })
        .await
        .unwrap();
    let request = ReleaseRequest {
        token,
        ephemeral_public_key: URL_SAFE_NO_PAD.encode(ephemeral.0),
        enclave_signing_key: encode_verifying_key(signing.verifying_key()),
        nonce: challenge.nonce,
        task_id: "task-1".into(),
        round: 1,
        commitment,
        policy: policy.encode(),
    };
    let response = http
        .post(format!("{url}/v1/keys/{key_id}/release"))
        .json(&request)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

async fn key_set(url: &str) -> KeySet {
    confed_protocol::http::client(BOUND)
        .get(format!("{url}/v1/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn audit_verify(dir: &Path, key: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_confed"))
        .args(["keyservice", "audit", "verify"])
        .arg(dir.join("audit.jsonl"))
        .args(["--id", "ks1", "--verifying-key", key])
        .output()
        .unwrap()
}

#[tokio::test]
async fn a_killed_key_service_remembers_the_rounds_it_committed() {
    let setup = setup().await;
    let (mut child, url) = start(&setup).await;
    let key = key_set(&url).await.verifying_key;
    let (status, answer) = release(&setup, &url, "a").await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["receipt"]["signature"].is_string(), "{answer}");
    // kill -9: no shutdown path runs.
    child.kill().await.unwrap();

    let (_child, url) = start(&setup).await;
    let (status, problem) = release(&setup, &url, "b").await;
    assert_eq!(status, 403, "another commitment for the round: {problem}");
    assert_eq!(
        problem["failed_checks"][0]["check"], "release_ledger",
        "{problem}"
    );
    let (status, answer) = release(&setup, &url, "a").await;
    assert_eq!(
        status, 200,
        "the recorded commitment is granted again: {answer}"
    );

    let verified = audit_verify(setup.dir.path(), &key);
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stderr)
    );
    assert!(String::from_utf8_lossy(&verified.stdout).contains("3 records"));
}

/// The operator's path through a rolled-back log, as commands: `confed keyservice signing-key`
/// prints the verifying key peers pin; `audit acknowledge-loss` is refused while the service
/// runs (its lock) and for a head the service never signed; the start refused on a log behind
/// its checkpoint names the exact command, which then lets it start, with the acknowledgement
/// in the log that `audit verify` accepts.
#[tokio::test]
async fn an_operator_acknowledges_a_rolled_back_log_with_the_command_the_refusal_names() {
    use std::os::unix::fs::PermissionsExt;
    let setup = setup().await;
    let dir = setup.dir.path();
    let signing = dir.join("ks1-signing.pem");
    let printed = confed()
        .args(["keyservice", "signing-key"])
        .arg(&signing)
        .output()
        .await
        .unwrap();
    assert!(printed.status.success());
    let verifying = String::from_utf8(printed.stdout)
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(
        std::fs::metadata(&signing).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let (mut child, url) = start(&setup).await;
    assert_eq!(key_set(&url).await.verifying_key, verifying);
    let log = dir.join("audit.jsonl");
    std::fs::copy(&log, dir.join("before.jsonl")).unwrap();
    let (status, answer) = release(&setup, &url, "a").await;
    assert_eq!(status, 200, "{answer}");
    let acknowledge = |records: &str, hash: &str, signature: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_confed"))
            .args(["keyservice", "audit", "acknowledge-loss"])
            .arg(&log)
            .args(["--id", "ks1", "--signing-key"])
            .arg(&signing)
            .args(["--records", records, "--hash", hash])
            // `=`: a base64url signature may begin with `-`, which clap would take for a flag.
            .arg(format!("--signature={signature}"))
            .args(["--note", "restored from the nightly copy"])
            .output()
            .unwrap()
    };
    let busy = acknowledge("1", &"0".repeat(64), "x");
    assert!(!busy.status.success());
    assert!(
        String::from_utf8_lossy(&busy.stderr).contains("in use by a running key service"),
        "{}",
        String::from_utf8_lossy(&busy.stderr)
    );
    child.kill().await.unwrap();
    child.wait().await.unwrap();

    // The log (not its checkpoint) restored from before the grant: the start is refused.
    std::fs::copy(dir.join("before.jsonl"), &log).unwrap();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_confed"))
        .args(keyservice_args(&setup))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let text = String::from_utf8_lossy(&refused.stderr).to_string();
    let value = |flag: &str| {
        let at = text
            .find(flag)
            .unwrap_or_else(|| panic!("{flag} in {text}"))
            + flag.len()
            + 1;
        text[at..].split([' ', '`']).next().unwrap().to_string()
    };
    let (records, hash, signature) = (value("--records"), value("--hash"), value("--signature"));
    let typo = acknowledge(&records, &"f".repeat(64), &signature);
    assert!(!typo.status.success(), "a head the service never signed");
    let accepted = acknowledge(&records, &hash, &signature);
    assert!(
        accepted.status.success(),
        "{}",
        String::from_utf8_lossy(&accepted.stderr)
    );
    assert!(String::from_utf8_lossy(&accepted.stdout).contains("loss acknowledged"));

    let (_child, url) = start(&setup).await;
    let (status, answer) = release(&setup, &url, "b").await;
    assert_eq!(status, 200, "the ledger forgot the lost round: {answer}");
    let verified = audit_verify(dir, &verifying);
    assert!(
        verified.status.success(),
        "{}",
        String::from_utf8_lossy(&verified.stderr)
    );
}

/// A key service waiting for its peers after a start answers /readyz with 503 and the reason,
/// and says so in `confed_ready`; /healthz stays 200 (the peers must still reach it).
#[tokio::test]
async fn a_key_service_waiting_for_its_peers_is_alive_but_not_ready() {
    let setup = setup().await;
    let dir = setup.dir.path();
    let peer_key = confed()
        .args(["keyservice", "signing-key"])
        .arg(dir.join("ks2-signing.pem"))
        .output()
        .await
        .unwrap();
    let peer_key = String::from_utf8(peer_key.stdout).unwrap();
    let peers = serde_json::json!({"peers": [
        {"id": "ks2", "url": "http://127.0.0.1:9", "verifying_key": peer_key.trim()}
    ]});
    std::fs::write(dir.join("peers.json"), peers.to_string()).unwrap();
    let mut command = confed();
    command
        .args(keyservice_args(&setup))
        .arg("--peers")
        .arg(dir.join("peers.json"));
    let mut started = serving(command, BOUND).await;
    assert_eq!(get_text(&format!("{}/healthz", started.url)).await.0, 200);
    let ready = confed_protocol::http::client(BOUND)
        .get(format!("{}/readyz", started.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(ready.headers()["retry-after"], "5");
    let problem: serde_json::Value = ready.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("grants nothing until 1 of its peers"),
        "{detail}"
    );
    let (_, metrics) = get_text(&format!("{}/metrics", started.url)).await;
    assert!(
        metrics.contains("confed_ready{role=\"keyservice\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("confed_keyservice_peer_rewinds_seen_total{peer=\"ks2\"} 0"),
        "{metrics}"
    );
    started.child.kill().await.unwrap();
}

/// `--ops-listen` moves /metrics and /readyz off the service's API port (which keeps /healthz).
#[tokio::test]
async fn ops_listen_keeps_the_counts_off_the_api_port() {
    let setup = setup().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = confed();
    command
        .args(keyservice_args(&setup))
        .args(["--ops-listen", &format!("127.0.0.1:{port}")]);
    let mut started = serving(command, BOUND).await;
    let api = &started.url;
    assert_eq!(get_text(&format!("{api}/metrics")).await.0, 404);
    assert_eq!(get_text(&format!("{api}/readyz")).await.0, 404);
    assert_eq!(get_text(&format!("{api}/healthz")).await.0, 200);
    assert_eq!(get_text(&format!("{api}/v1/keys")).await.0, 200);
    let ops = format!("http://127.0.0.1:{port}");
    assert_eq!(get_text(&format!("{ops}/readyz")).await.0, 200);
    let (_, metrics) = get_text(&format!("{ops}/metrics")).await;
    assert!(
        metrics.contains("confed_keyservice_decisions_total"),
        "{metrics}"
    );
    started.child.kill().await.unwrap();
}

/// A GET's status and body text.
async fn get_text(url: &str) -> (u16, String) {
    let reply = confed_protocol::http::client(BOUND)
        .get(url)
        .send()
        .await
        .unwrap();
    (reply.status().as_u16(), reply.text().await.unwrap())
}
