//! Partner API of masked tasks (`secure_aggregation`): the policy's masking line, the ring it
//! picks, and every refusal with the field and the reason.

use crate::common;

use axum::http::{Method, StatusCode};
use common::{TestApp, task_body};
use serde_json::json;

/// `secure_aggregation`: the task's policy names every key service's signed masking key; without
/// device tokens, or with nothing to take the keys from, it is a 400 on the field saying why.
#[tokio::test]
async fn a_masked_task_names_every_key_services_masking_key_or_is_refused_with_the_reason() {
    use base64::Engine as _;
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let spki =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(common::issuer::signer().spki());
    let auth = json!({"issuer": common::issuer::ISSUER, "token_keys": [spki]});
    let created = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(
                json!({"secure_aggregation": true, "device_auth": auth}),
            )),
        )
        .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let line = created.json()["masking"].as_str().unwrap().to_string();
    // A report goal of 10: the sum fits 31 bits, so the masks live in the ring of 2^32.
    assert!(
        line.starts_with("confed-masking/v1;threshold=2;ring=32;services=ks1:"),
        "{line}"
    );
    assert!(line.contains(",ks2:"), "{line}");

    // A report goal of 10,000 at over-selection 3: a round can assign 40,000 devices, whose
    // clipped updates of 2^16 grid units each can reach 2^31, so the masks live in the ring of
    // 2^64 (the line names no ring).
    let large = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({
                "secure_aggregation": true,
                "device_auth": auth,
                "report_goal": 10_000,
                "over_selection": 3.0,
                "min_reports": 5_000,
            }))),
        )
        .await;
    assert_eq!(
        large.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&large.body)
    );
    let line = large.json()["masking"].as_str().unwrap().to_string();
    assert!(
        line.starts_with("confed-masking/v1;threshold=2;services=ks1:"),
        "{line}"
    );
    // Rounds that can assign 110,000 devices: more than the key services unmask at once.
    let refused = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({
                "secure_aggregation": true,
                "device_auth": auth,
                "report_goal": 10_000,
                "over_selection": 10.0,
                "min_reports": 5_000,
            }))),
        )
        .await;
    let params = refused.problem(StatusCode::BAD_REQUEST)["invalid_params"].to_string();
    assert!(
        params.contains("secure_aggregation") && params.contains("60000"),
        "{params}"
    );

    let refused = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({"secure_aggregation": true}))),
        )
        .await;
    let problem = refused.problem(StatusCode::BAD_REQUEST);
    let params = problem["invalid_params"].to_string();
    assert!(
        params.contains("secure_aggregation") && params.contains("device_auth"),
        "{params}"
    );

    let keyless = TestApp::with_keys(confed::keys::directory::KeyDirectory::fixed(vec![])).await;
    let token = keyless.tenant("acme").await;
    let refused = keyless
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(
                json!({"secure_aggregation": true, "device_auth": auth}),
            )),
        )
        .await;
    let params = refused.problem(StatusCode::BAD_REQUEST)["invalid_params"].to_string();
    assert!(params.contains("start the key services"), "{params}");
}
