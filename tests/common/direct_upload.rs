//! A device's steps on a signed-URL (GCS) deployment done by hand, so tests can play an outsider:
//! check in, upload straight to the bucket, report.

use std::time::Duration;

use confed_protocol::envelope::RoundContext;
use confed_protocol::trust::TrustConfig;
use serde_json::{Value, json};

fn http() -> reqwest::Client {
    confed_protocol::http::client(Duration::from_secs(30))
}

/// Checks in to `population` on `url`; the assignment (201).
pub(crate) async fn checkin(url: &str, population: &str) -> Value {
    let response = http()
        .post(format!("{url}/v1/populations/{population}/checkin"))
        .json(&json!({"client_version": "1.0.0"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    response.json().await.unwrap()
}

/// Reports the assignment `completed`.
pub(crate) async fn report(url: &str, assignment: &Value) -> reqwest::Response {
    http()
        .post(format!(
            "{url}{}",
            assignment["report_url"].as_str().unwrap()
        ))
        .json(&json!({"outcome": "completed"}))
        .send()
        .await
        .unwrap()
}

/// PUTs `body` to the assignment's signed upload URL with the headers it requires.
pub(crate) async fn upload(assignment: &Value, body: Vec<u8>) -> reqwest::StatusCode {
    let mut put = http()
        .put(assignment["upload_url"].as_str().unwrap())
        .body(body);
    for (name, value) in assignment["upload_headers"].as_object().unwrap() {
        put = put.header(name, value.as_str().unwrap());
    }
    put.send().await.unwrap().status()
}

/// An outsider with no issuer's token (`token`: none, or forged bytes) checks in, seals a valid
/// update to the round's key, uploads it to the signed URL (which takes it) and reports: the
/// report's status and detail.
pub(crate) async fn outsider_upload(
    url: &str,
    population: &str,
    trust: &TrustConfig,
    context: &RoundContext,
    now_seconds: i64,
    token: Option<Vec<u8>>,
) -> (u16, String) {
    let assignment = checkin(url, population).await;
    let parsed: confed_device::AssignmentResponse =
        serde_json::from_value(assignment.clone()).unwrap();
    let client = confed_device::DeviceClient::new(url, trust).unwrap();
    let key = client.verified_key(&parsed, now_seconds).unwrap();
    let mut envelope = confed_protocol::envelope::seal(
        &key,
        &parsed.encryption.key_id,
        context,
        &parsed.assignment_id,
        &confed::tools::simulate::initial_model(7),
    )
    .unwrap();
    envelope.token = token;
    assert!(upload(&assignment, envelope.to_cbor()).await.is_success());
    let refused = report(url, &assignment).await;
    let status = refused.status().as_u16();
    let detail = refused.text().await.unwrap();
    assert_eq!(
        report(url, &assignment).await.status().as_u16(),
        status,
        "the same report again gets the same answer: {detail}"
    );
    (status, detail)
}
