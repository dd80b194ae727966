//! The Google Cloud Storage blob store against a GCS emulator (fake-gcs-server): every operation
//! the backend uses — create-only writes, reads, metadata, signed upload URLs — and a device's
//! round trip through a signed URL and its report. Runs when `CONFED_TEST_GCS_ENDPOINT` names
//! an emulator (`.ci/run` starts one); otherwise says so once and passes.
//!
//! What the emulator cannot serve, and how that path is covered, is in docs/operations.md
//! ("GCS emulator gaps").

use crate::common;

use std::sync::Once;
use std::time::Duration;

use common::direct_upload::{checkin, outsider_upload, report, upload};
use common::gcs::{GCS_ENV, emulator, fresh_bucket};
use common::system::{collect, now_clock, open_task, rounds, start};
use confed::blob::{BlobError, BlobKey, BlobStore, Gcs, PutOutcome};
use confed::clock::Clock;
use serde_json::{Value, json};

fn skip_note() {
    static NOTE: Once = Once::new();
    NOTE.call_once(|| {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOTE: {GCS_ENV} is not set: the GCS blob store cases did not run \
             (deploy/local/gcs-emulator.sh start prints a value for it)"
        );
    });
}

fn http() -> reqwest::Client {
    confed_protocol::http::client(Duration::from_secs(30))
}

fn key(name: &str) -> BlobKey {
    BlobKey::new(format!("tenants/t1/tasks/x/{name}")).unwrap()
}

#[tokio::test]
async fn objects_are_written_once_read_back_whole_and_described_by_metadata() {
    let Some(endpoint) = emulator() else {
        return skip_note();
    };
    let gcs = Gcs::connect(fresh_bucket(&endpoint).await).await.unwrap();
    let store = gcs.store("blobs");
    let bytes = vec![7u8; 300_000]; // larger than one read chunk
    assert_eq!(
        store.put(&key("a.bin"), &bytes).await.unwrap(),
        PutOutcome::Created
    );
    assert_eq!(
        store.put(&key("a.bin"), &bytes).await.unwrap(),
        PutOutcome::AlreadyPresent,
        "the same bytes again: the create-only precondition fails (412), the bytes compare equal"
    );
    assert!(
        matches!(
            store.put(&key("a.bin"), b"different").await,
            Err(BlobError::Conflict(_))
        ),
        "different bytes under an existing name are refused"
    );
    assert_eq!(store.get(&key("a.bin")).await.unwrap(), bytes);
    // Ranges, as the token check of a direct upload reads them; short at the object's end.
    let mut numbered = vec![0u8; 10_000];
    for (i, b) in numbered.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    store.put(&key("r.bin"), &numbered).await.unwrap();
    for (offset, len) in [(0, 4096), (5, 3), (9_990, 100), (10_000, 10)] {
        let end = (offset + len).min(10_000) as usize;
        assert_eq!(
            store.get_range(&key("r.bin"), offset, len).await.unwrap(),
            numbered[offset as usize..end],
            "[{offset}, +{len})"
        );
    }
    assert!(matches!(
        store.get_range(&key("missing.bin"), 0, 10).await,
        Err(BlobError::NotFound(_))
    ));
    assert!(matches!(
        store.get(&key("missing.bin")).await,
        Err(BlobError::NotFound(_))
    ));

    let info = store.stat(&key("a.bin")).await.unwrap().expect("exists");
    assert_eq!(info.size, 300_000);
    assert!(
        info.digest.starts_with("md5:") && info.digest.len() == 4 + 32,
        "{}",
        info.digest
    );
    store.put(&key("b.bin"), b"other").await.unwrap();
    let other = store.stat(&key("b.bin")).await.unwrap().unwrap();
    assert_ne!(other.digest, info.digest);
    assert_eq!(store.stat(&key("missing.bin")).await.unwrap(), None);

    // Parts of the bucket are separate namespaces.
    assert!(matches!(
        gcs.store("contributions").get(&key("a.bin")).await,
        Err(BlobError::NotFound(_))
    ));
}

/// A file (a spooled model upload) is stored create-only like `put`, on both stores; what is
/// read back is the file's content; the same again is `AlreadyPresent` (GCS: the same size
/// under a key that names the content's digest), another content a `Conflict`.
#[tokio::test]
async fn a_file_is_streamed_to_the_store_once_and_compared_when_present() {
    let dir = tempfile::tempdir().unwrap();
    let content: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(dir.path().join("model"), &content).unwrap();
    std::fs::write(dir.path().join("other"), b"different").unwrap();
    let file = std::fs::File::open(dir.path().join("model")).unwrap();
    let other = std::fs::File::open(dir.path().join("other")).unwrap();
    let mut stores: Vec<(&str, Box<dyn BlobStore>)> = vec![(
        "local",
        Box::new(confed::blob::LocalBlobStore::open(dir.path().join("blobs")).unwrap()),
    )];
    match emulator() {
        Some(endpoint) => {
            let gcs = Gcs::connect(fresh_bucket(&endpoint).await).await.unwrap();
            stores.push(("gcs", Box::new(gcs.store("blobs"))));
        }
        None => skip_note(),
    }
    for (name, store) in stores {
        let key = key("m.safetensors");
        assert_eq!(
            store.put_file(&key, &file).await.unwrap(),
            PutOutcome::Created,
            "{name}"
        );
        assert_eq!(store.get(&key).await.unwrap(), content, "{name}");
        assert_eq!(
            store.put_file(&key, &file).await.unwrap(),
            PutOutcome::AlreadyPresent,
            "{name}"
        );
        assert!(
            matches!(
                store.put_file(&key, &other).await,
                Err(BlobError::Conflict(_))
            ),
            "{name}"
        );
    }
}

#[tokio::test]
async fn signed_upload_urls_carry_the_headers_they_require_and_accept_a_put() {
    let Some(endpoint) = emulator() else {
        return skip_note();
    };
    let store = Gcs::connect(fresh_bucket(&endpoint).await)
        .await
        .unwrap()
        .store("contributions");
    let object = key("rounds/1-1/contributions/ab/abcd.cbor");
    let upload = store
        .direct_upload(&object, Duration::from_secs(900), 4096)
        .await
        .unwrap()
        .expect("GCS takes uploads directly");
    assert!(upload.url.starts_with(&endpoint), "{}", upload.url);
    for part in [
        "X-Goog-Algorithm=GOOG4-RSA-SHA256",
        "X-Goog-Expires=900",
        // The size range is signed: GCS refuses an upload without it or outside it.
        "X-Goog-SignedHeaders=content-type%3Bhost%3Bx-goog-content-length-range%3Bx-goog-if-generation-match",
        "X-Goog-Signature=",
        "confed-test-signer%40confed-test.iam.gserviceaccount.com",
        "/contributions/tenants/t1/tasks/x/rounds/1-1/contributions/ab/abcd.cbor?",
    ] {
        assert!(
            upload.url.contains(part),
            "{part} missing in {}",
            upload.url
        );
    }
    assert_eq!(
        upload
            .headers
            .get("x-goog-if-generation-match")
            .map(String::as_str),
        Some("0")
    );
    assert_eq!(
        upload.headers.get("content-type").map(String::as_str),
        Some("application/cbor")
    );
    assert_eq!(
        upload
            .headers
            .get("x-goog-content-length-range")
            .map(String::as_str),
        Some("1,4096")
    );

    let mut put = http().put(&upload.url).body(b"sealed".to_vec());
    for (name, value) in &upload.headers {
        put = put.header(name, value);
    }
    let response = put.send().await.unwrap();
    assert!(response.status().is_success(), "{}", response.status());
    assert_eq!(store.get(&object).await.unwrap(), b"sealed");
    assert_eq!(store.stat(&object).await.unwrap().unwrap().size, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_upload_to_signed_urls_and_the_report_checks_the_object() {
    if emulator().is_none() {
        return skip_note();
    }
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (_token, task) = open_task(&system, "gcs", 50.0).await;

    let first = checkin(&system.url, "gcs").await;
    let upload_url = first["upload_url"].as_str().unwrap();
    assert!(
        upload_url.starts_with(emulator().unwrap().as_str())
            && upload_url.contains("X-Goog-Signature="),
        "the assignment names a signed URL of the bucket: {upload_url}"
    );
    let valid_for: i64 = upload_url
        .split("X-Goog-Expires=")
        .nth(1)
        .and_then(|rest| rest.split('&').next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    let lifetime = first["expires_at"].as_i64().unwrap() - clock.now_millis().0 / 1000;
    assert!(
        valid_for <= lifetime + 1,
        "the URL ({valid_for} s) dies with the assignment ({lifetime} s)"
    );

    let early = report(&system.url, &first).await;
    assert_eq!(early.status(), 409, "a report before the upload is refused");
    assert!(
        early
            .text()
            .await
            .unwrap()
            .contains("upload the contribution")
    );

    assert!(upload(&first, b"ciphertext".to_vec()).await.is_success());
    let done = report(&system.url, &first).await;
    assert_eq!(done.status(), 200);
    let body: Value = done.json().await.unwrap();
    assert_eq!(body["state"], "COMPLETED");
    assert_eq!(
        report(&system.url, &first).await.status(),
        200,
        "a repeated report is idempotent"
    );
    let stored = system.db.completed_contributions(&task, 1).await.unwrap();
    assert_eq!(stored.len(), 1);

    let oversized = checkin(&system.url, "gcs").await;
    let limit = oversized["max_contribution_bytes"].as_u64().unwrap() as usize;
    assert!(upload(&oversized, vec![0; limit + 1]).await.is_success());
    let refused = report(&system.url, &oversized).await;
    assert_eq!(refused.status(), 422);
    assert!(refused.text().await.unwrap().contains("accepts 1 to"));
    system.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_simulated_devices_is_aggregated_from_the_bucket() {
    if emulator().is_none() {
        return skip_note();
    }
    let (system, _dir) = start(now_clock()).await;
    let (token, task) = open_task(&system, "gcs-round", 50.0).await;
    collect(&system, "gcs-round", 1, false).await;
    let outcome = system.worker("w1").run_once().await.unwrap();
    assert!(outcome.is_some(), "the round's job ran");
    let rounds = rounds(&system, &token, &task).await;
    let first = rounds
        .iter()
        .find(|r| r["round"] == 1 || r["round_number"] == 1)
        .expect("round 1");
    assert_eq!(first["state"], "COMPLETED", "{first}");
    system.shutdown().await;
}

#[tokio::test]
async fn a_cached_store_serves_models_from_memory_after_the_first_read() {
    let Some(endpoint) = emulator() else {
        return skip_note();
    };
    let config = fresh_bucket(&endpoint).await;
    let gcs = Gcs::connect(config.clone()).await.unwrap();
    let cached = gcs.cached_store("blobs");
    let model = key("models/0-ab.safetensors");
    cached.put(&model, b"weights").await.unwrap();
    assert_eq!(cached.get(&model).await.unwrap(), b"weights");

    // Remove the object behind the store's back (the emulator's JSON API; confed never deletes):
    // only a read from memory can still answer.
    let object = format!("confed/blobs/{}", model.as_str()).replace('/', "%2F");
    let deleted = http()
        .delete(format!(
            "{endpoint}/storage/v1/b/{}/o/{object}",
            config.bucket
        ))
        .send()
        .await
        .unwrap();
    assert!(deleted.status().is_success(), "{}", deleted.status());
    assert_eq!(cached.get(&model).await.unwrap(), b"weights");
    assert!(matches!(
        gcs.store("blobs").get(&model).await,
        Err(BlobError::NotFound(_))
    ));
}

/// A task that requires device tokens, on GCS: a direct upload counts only once the front end
/// has read its envelope's fields from the object (a bounded read) and verified its token. An
/// outsider's token-less or forged uploads are refused at the report (403) and never counted,
/// the round keeps collecting, and devices with tokens fill it (issue 46).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_upload_without_a_valid_token_never_counts_and_the_round_keeps_collecting() {
    use base64::Engine as _;
    use common::issuer::{ISSUER, issuer, signer};
    if emulator().is_none() {
        return skip_note();
    }
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let issuer_state = tempfile::tempdir().unwrap();
    let issuer_url = issuer(issuer_state.path(), clock.clone()).await;
    let spki = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signer().spki());
    let (_token, task) = common::system::open_task_with(
        &system,
        "gcs-authed",
        50.0,
        json!({"device_auth": {"issuer": ISSUER, "token_keys": [spki]}}),
    )
    .await;
    let context = system.db.round_context(&task, 1).await.unwrap();
    for (case, token) in [
        ("no token", None),
        (
            "a forged token",
            Some(vec![2u8; confed_protocol::privacy_pass::TOKEN_BYTES]),
        ),
    ] {
        let (status, detail) = outsider_upload(
            &system.url,
            "gcs-authed",
            &system.trust,
            &context,
            clock.now_seconds().0,
            token,
        )
        .await;
        assert_eq!(status, 403, "{case}: {detail}");
        assert!(detail.contains("does not count"), "{case}: {detail}");
    }
    assert!(
        system
            .db
            .completed_contributions(&task, 1)
            .await
            .unwrap()
            .is_empty()
    );
    // Devices with tokens fill the round through the bucket.
    let mut trust = system.trust.clone();
    trust.token_issuers.push(
        confed::tools::issuer::trusted_issuer(&issuer_url)
            .await
            .unwrap(),
    );
    common::system::collect_trusting(&system, "gcs-authed", 3, false, common::system::GOAL, trust)
        .await;
    let outcome = system
        .worker("w1")
        .run_once()
        .await
        .unwrap()
        .expect("a job");
    assert_eq!(outcome.included, common::system::GOAL as u64);
    system.shutdown().await;
}
