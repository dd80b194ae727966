#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Cost of a device's signed upload URL (one per check-in when blobs are on GCS), signed locally
//! with a service-account key (`--gcs-signing-key-file`; the test-only fixture key here). With
//! the default IAM `signBlob` the cost is a network call instead. Run with
//! `cargo bench --bench upload_urls`; no network is used.

use std::time::{Duration, Instant};

use confed::blob::{BlobKey, BlobStore, Gcs, GcsConfig};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let config = GcsConfig {
        // An emulator endpoint: anonymous credentials, nothing is contacted to sign.
        endpoint: Some("http://127.0.0.1:9".into()),
        signing_key_file: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/gcs-test-signer.json"),
        ),
        ..GcsConfig::parse("gs://confed-bench/confed").unwrap()
    };
    let store = Gcs::connect(config).await.unwrap().store("contributions");
    let keys: Vec<BlobKey> = (0..256)
        .map(|i| {
            BlobKey::new(format!(
                "tenants/t/tasks/x/rounds/1-1/contributions/{:02x}/{i:064x}.cbor",
                i % 256
            ))
            .unwrap()
        })
        .collect();
    // Warm up (the signer is built on first use).
    store
        .direct_upload(&keys[0], Duration::from_secs(600), 1 << 20)
        .await
        .unwrap();
    let count = 3_000;
    let started = Instant::now();
    for i in 0..count {
        let signed = store
            .direct_upload(&keys[i % keys.len()], Duration::from_secs(600), 1 << 20)
            .await
            .unwrap();
        std::hint::black_box(signed);
    }
    let elapsed = started.elapsed();
    println!(
        "signed upload URLs (RSA-2048, local key, one core): {:.0}/s, {:.1} us each",
        count as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / count as f64
    );
}
