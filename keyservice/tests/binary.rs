#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The `confed-keyservice` binary on its own: started from a ceremony's share file and the dev
//! policy, it serves its signed key set, and SIGTERM stops it cleanly.

use std::process::Stdio;
use std::time::Duration;

use confed_keyservice::keys::ceremony::{CeremonyOptions, generate};
use confed_protocol::keyset::{KeySet, decode_verifying_key, verify_key};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BOUND: Duration = Duration::from_secs(60);

#[tokio::test]
async fn the_key_service_binary_serves_its_signed_key_set_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let ceremony = generate(&CeremonyOptions {
        shares: 3,
        threshold: 2,
        out_dir: dir.path().join("ceremony"),
        not_before: now - 60,
        not_after: now + 3600,
    })
    .unwrap();
    let attester = confed_attestation::DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        std::sync::Arc::new(move || now),
    );
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/../policies/dev.toml"),
        dir.path().join("dev.toml"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("dev-attester.jwks.json"),
        attester.jwks_json().to_string(),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_confed-keyservice"))
        .args(["--id", "ks1", "--listen", "127.0.0.1:0", "--share"])
        .arg(&ceremony.share_files[0])
        .arg("--policy")
        .arg(dir.path().join("dev.toml"))
        .arg("--signing-key")
        .arg(dir.path().join("ks1.pem"))
        .arg("--audit-log")
        .arg(dir.path().join("audit.jsonl"))
        .arg("--masking-key")
        .arg(dir.path().join("ks1-masking.key"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = tokio::time::timeout(BOUND, async {
        loop {
            let line = lines.next_line().await.unwrap().expect("exited early");
            if let Some(url) = line.strip_prefix("confed: serving on ") {
                return url.to_string();
            }
        }
    })
    .await
    .expect("the key service did not start");
    let set: KeySet = confed_protocol::http::client(BOUND)
        .get(format!("{url}/v1/keys"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(set.keyservice_id, "ks1");
    assert_eq!(set.keys[0].key_id, ceremony.key.key_id);
    let verifying_key = decode_verifying_key(&set.verifying_key).unwrap();
    assert!(verify_key(&verifying_key, "ks1", &set.keys[0]));
    // The masking key it created at start, published and signed (docs/secure-aggregation.md).
    let masking = set.masking_key.expect("a masking key in the key set");
    assert!(confed_protocol::masking_keys::verify_masking_key(
        &verifying_key,
        "ks1",
        &masking
    ));
    assert!(dir.path().join("ks1-masking.key").exists());
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(BOUND, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status}");
}
