//! The blob store a test runs on: the data directory by default, or a fresh bucket on a GCS
//! emulator when `CONFED_TEST_GCS_ENDPOINT` names one (fake-gcs-server on plain http at a
//! loopback address; `deploy/local/gcs-emulator.sh start` prints one, `.ci/run` starts it).

use confed::blob::GcsConfig;

pub(crate) const GCS_ENV: &str = "CONFED_TEST_GCS_ENDPOINT";

/// The emulator the tests should use, if any.
pub(crate) fn emulator() -> Option<String> {
    std::env::var(GCS_ENV)
        .ok()
        .filter(|url| url.starts_with("http://"))
}

/// The test-only service account key that signs upload URLs for the emulator.
pub(crate) fn test_signer() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gcs-test-signer.json")
}

/// Creates a uniquely named bucket on the emulator (the JSON API's buckets.insert; in
/// production, buckets come from deploy/gcp's Terraform) and returns a store config for it.
pub(crate) async fn fresh_bucket(endpoint: &str) -> GcsConfig {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bucket = format!("confed-test-{}", uuid::Uuid::new_v4().simple());
    let response = reqwest::Client::new()
        .post(format!("{endpoint}/storage/v1/b"))
        .json(&serde_json::json!({ "name": bucket }))
        .send()
        .await
        .unwrap_or_else(|e| panic!("{GCS_ENV}={endpoint}: cannot reach the emulator: {e}"));
    assert!(
        response.status().is_success(),
        "creating bucket {bucket}: HTTP {}",
        response.status()
    );
    GcsConfig {
        endpoint: Some(endpoint.to_string()),
        signing_key_file: Some(test_signer()),
        ..GcsConfig::parse(&format!("gs://{bucket}/confed")).unwrap()
    }
}

/// A fresh bucket when an emulator is configured, else `None` (local stores).
pub(crate) async fn test_blobs() -> Option<GcsConfig> {
    match emulator() {
        Some(endpoint) => Some(fresh_bucket(&endpoint).await),
        None => None,
    }
}
