//! The `confed keys` and `confed keyservice` commands as processes, and the HTTPS key fetcher
//! against a local issuer serving a discovery document and a JWKS.

use std::process::Stdio;
use std::time::Duration;

use confed_attestation::exchange::KeySet;
use confed_attestation::keys::JwksFetcher;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BOUND: Duration = Duration::from_secs(60);

fn confed() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_confed"));
    command.env("RUST_LOG", "warn").kill_on_drop(true);
    command
}

#[tokio::test]
async fn ceremony_then_key_service_serves_a_signed_key_set_and_audit_verify_checks_the_log() {
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
    assert!(
        generated.status.success(),
        "{}",
        String::from_utf8_lossy(&generated.stderr)
    );
    let share = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .ends_with("-1.json")
        })
        .unwrap();

    // A dev deployment: the dev policy next to the dev attester's key set.
    let attester = confed_attestation::DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        std::sync::Arc::new(|| 0),
    );
    let policy_dir = dir.path().join("policy");
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

    let audit_log = dir.path().join("audit.jsonl");
    let mut child = confed()
        .args([
            "keyservice",
            "--id",
            "ks1",
            "--listen",
            "127.0.0.1:0",
            "--share",
        ])
        .arg(&share)
        .arg("--policy")
        .arg(policy_dir.join("dev.toml"))
        .arg("--signing-key")
        .arg(dir.path().join("ks1-signing.pem"))
        .arg("--audit-log")
        .arg(&audit_log)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(BOUND, async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("key service exited early");
            if let Some(url) = line.strip_prefix("confed: serving on ") {
                return url.to_string();
            }
        }
    })
    .await
    .unwrap();
    let set: KeySet = confed_enclave::http::client(BOUND)
        .get(format!("{url}/v1/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(set.keyservice_id, "ks1");
    let trusted = confed::keys::trust::TrustedKeyService::new("ks1", &set.verifying_key).unwrap();
    assert!(confed_attestation::exchange::verify_key(
        &trusted.verifying_key,
        "ks1",
        &set.keys[0]
    ));
    let head: serde_json::Value = confed_enclave::http::client(BOUND)
        .get(format!("{url}/v1/audit/head"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(head["keyservice_id"], "ks1");
    assert_eq!(head["records"], 0);
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
