//! Calling the issuer's router in process, as the HTTP tests do.

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_issuer::attester::{AttestError, DeviceIdentity};
use confed_issuer::routes::ChallengeResponse;
use http_body_util::BodyExt;
use tower::ServiceExt;

/// Sends `method uri` with a JSON `body`, if any: the status, headers and body bytes.
pub(crate) async fn call(
    app: &axum::Router,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> (StatusCode, HeaderMap, Vec<u8>) {
    let mut request = Request::builder().method(method).uri(uri);
    if body.is_some() {
        request = request.header(header::CONTENT_TYPE, "application/json");
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.unwrap_or_default())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, headers, bytes)
}

/// `POST /v1/token-request` with `body`: the status and body bytes.
pub(crate) async fn token_request(app: &axum::Router, body: String) -> (StatusCode, Vec<u8>) {
    let (status, _, bytes) = call(app, "POST", "/v1/token-request", Some(body)).await;
    (status, bytes)
}

/// A fresh challenge's raw bytes.
pub(crate) async fn challenge(app: &axum::Router) -> Vec<u8> {
    let (status, _, body) = call(app, "POST", "/v1/challenge", None).await;
    assert_eq!(status, StatusCode::OK);
    let response: ChallengeResponse = serde_json::from_slice(&body).unwrap();
    URL_SAFE_NO_PAD.decode(response.challenge).unwrap()
}

/// The names of the checks an attester refused with.
pub(crate) fn refused_checks(result: Result<DeviceIdentity, AttestError>) -> Vec<&'static str> {
    result
        .unwrap_err()
        .checks()
        .iter()
        .map(|f| f.check)
        .collect()
}
