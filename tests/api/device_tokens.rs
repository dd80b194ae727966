//! Device tokens end to end, in one process: a task that requires tokens of a dev issuer, an
//! outsider whose uploads are refused before anything is stored, simulated devices that obtain
//! tokens and fill the round, and a release that counts only authenticated contributions. Then
//! what each side kept: nothing the issuer stored appears at the front end, and nothing of the
//! tokens the front end stored appears at the issuer.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): on GCS devices upload straight to the bucket,
//! which this module's outsider does not; tests/store/gcs_blobs.rs checks tokens on that path.

use crate::common;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::issuer::{ISSUER, issuer, signer};
use common::system::{GOAL, now_clock, open_task_with, start};
use confed::clock::Clock;
use confed::tools::simulate;
use confed_device::{Checkin, DeviceClient, DeviceError};
use confed_protocol::privacy_pass::Token;
use confed_worker_api::manifest::Manifest;
use confed_worker_api::store::JobStore;
use serde_json::json;

fn files_under(dir: &std::path::Path, out: &mut Vec<u8>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else {
            out.extend(std::fs::read(&path).unwrap_or_default());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_devices_with_tokens_fill_a_round_and_the_release_counts_them() {
    let clock = now_clock();
    let (system, dir) = start(clock.clone()).await;
    let issuer_state = tempfile::tempdir().unwrap();
    let issuer_url = issuer(issuer_state.path(), clock.clone()).await;
    let spki = URL_SAFE_NO_PAD.encode(signer().spki());
    let (token, task) = open_task_with(
        &system,
        "authed",
        50.0,
        json!({"device_auth": {"issuer": ISSUER, "token_keys": [spki]}}),
    )
    .await;

    // An outsider: a client that seals without a token. Its upload is refused, nothing stored.
    let outsider = DeviceClient::new(&system.url, &system.trust).unwrap();
    let Checkin::Assigned(assignment) = outsider
        .checkin("authed", "1.0.0", &Default::default())
        .await
        .unwrap()
    else {
        panic!("no assignment")
    };
    assert!(matches!(
        outsider.accepted_policy(&assignment, "authed"),
        Err(DeviceError::UntrustedPolicy(why)) if why.contains("issuer.test")
    ));
    let public_key = outsider
        .verified_key(&assignment, clock.now_seconds().0)
        .unwrap();
    let context = system.db.round_context(&task, 1).await.unwrap();
    let forged = confed_protocol::envelope::seal(
        &public_key,
        &assignment.encryption.key_id,
        &context,
        &assignment.assignment_id,
        &simulate::initial_model(7),
    )
    .unwrap();
    let refused = outsider.upload(&assignment, forged.to_cbor()).await;
    assert!(
        matches!(&refused, Err(DeviceError::Server { status: 401, detail }) if detail.contains("device token")),
        "{refused:?}"
    );
    // A token of the right length that does not verify (here: another token type) is a 403; one
    // of another length makes the envelope malformed, a 400 (docs/protocol.md, "Upload").
    let mut other_type = forged.clone();
    let mut bytes = vec![0u8; confed_protocol::privacy_pass::TOKEN_BYTES];
    bytes[1] = 1;
    other_type.token = Some(bytes);
    let refused = outsider.upload(&assignment, other_type.to_cbor()).await;
    assert!(
        matches!(&refused, Err(DeviceError::Server { status: 403, detail }) if detail.contains("0x0002")),
        "{refused:?}"
    );
    let mut short = forged.clone();
    short.token = Some(vec![0u8; 258]);
    let refused = outsider.upload(&assignment, short.to_cbor()).await;
    assert!(
        matches!(&refused, Err(DeviceError::Server { status: 400, detail }) if detail.contains("354 bytes")),
        "{refused:?}"
    );

    // Devices whose trust lists the issuer obtain tokens and fill the round.
    let mut trust = system.trust.clone();
    trust.token_issuers.push(
        confed::tools::issuer::trusted_issuer(&issuer_url)
            .await
            .unwrap(),
    );
    common::system::collect_trusting(&system, "authed", 3, false, GOAL, trust).await;

    let outcome = system
        .worker("w1")
        .run_once()
        .await
        .unwrap()
        .expect("a job");
    assert_eq!(outcome.included, GOAL as u64);
    let releases = system.db.releases_of_task(&task).await.unwrap();
    let manifest: Manifest = serde_json::from_str(&releases[0].manifest_json).unwrap();
    assert_eq!(manifest.authenticated, Some(GOAL as u64));
    // The partner's console says so next to the round's included count.
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let signed_in = http
        .post(format!("{}/console/sign-in", system.url))
        .header("origin", system.url.as_str())
        .form(&[("token", token.as_str())])
        .send()
        .await
        .unwrap();
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    let page = http
        .get(format!("{}/console/tasks/{task}", system.url))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&format!("{GOAL} with a device token")),
        "{page}"
    );

    // Unlinkability: the issuer's state holds no piece of any stored token, and the front end's
    // state (database and blobs) holds none of the issuer's records.
    let contributions = system.db.completed_contributions(&task, 1).await.unwrap();
    let mut issuer_bytes = Vec::new();
    files_under(issuer_state.path(), &mut issuer_bytes);
    let mut front_end_bytes = Vec::new();
    files_under(&dir.path().join("data"), &mut front_end_bytes);
    for (_, blob_key) in &contributions {
        let stored = system.store.fetch(blob_key).await.unwrap().unwrap();
        let envelope = confed_protocol::envelope::Envelope::from_cbor(&stored).unwrap();
        let token = Token::decode(envelope.token.as_deref().unwrap()).unwrap();
        for piece in [
            &token.nonce[..],
            &token.challenge_digest[..],
            &token.authenticator[..32],
        ] {
            assert!(!issuer_bytes.windows(32).any(|w| w == piece));
        }
    }
    let window_file = std::fs::read_dir(issuer_state.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("window-")
        })
        .unwrap();
    let records = std::fs::read(window_file).unwrap();
    assert_eq!(records.len(), 40 * GOAL);
    for record in records.chunks(40) {
        assert!(!front_end_bytes.windows(32).any(|w| w == &record[..32]));
    }
}
