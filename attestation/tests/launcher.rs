#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The Confidential Space attester against a fake launcher serving `POST /v1/token` on a unix
//! socket, as the real launcher does at /run/container_launcher/teeserver.sock.

use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use confed_attestation::{AttestError, Attester, ConfidentialSpaceAttester, TokenRequest};
use serde_json::Value;

type Seen = Arc<Mutex<Vec<Value>>>;

async fn fake_launcher(status: StatusCode) -> (tempfile::TempDir, std::path::PathBuf, Seen) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("teeserver.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let seen: Seen = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v1/token",
            axum::routing::post(
                move |State(seen): State<Seen>, Json(body): Json<Value>| async move {
                    seen.lock().unwrap().push(body);
                    (status, "eyJhbGciOiJSUzI1NiJ9.e30.c2ln\n")
                },
            ),
        )
        .with_state(seen.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (dir, socket, seen)
}

fn request() -> TokenRequest {
    TokenRequest {
        audience: "https://ks1.confed.example".into(),
        nonces: vec!["n".repeat(43), "b".repeat(64)],
    }
}

#[tokio::test]
async fn requests_an_oidc_token_with_audience_and_nonces() {
    let (_dir, socket, seen) = fake_launcher(StatusCode::OK).await;
    let token = ConfidentialSpaceAttester::new(&socket)
        .token(&request())
        .await
        .unwrap();
    assert_eq!(token, "eyJhbGciOiJSUzI1NiJ9.e30.c2ln");
    let bodies = seen.lock().unwrap();
    assert_eq!(
        bodies[0],
        serde_json::json!({
            "audience": "https://ks1.confed.example",
            "token_type": "OIDC",
            "nonces": ["n".repeat(43), "b".repeat(64)],
        })
    );
}

#[tokio::test]
async fn launcher_refusal_is_reported_with_its_status() {
    let (_dir, socket, _) = fake_launcher(StatusCode::BAD_REQUEST).await;
    let error = ConfidentialSpaceAttester::new(&socket)
        .token(&request())
        .await
        .unwrap_err();
    assert!(
        matches!(error, AttestError::Refused { status: 400, .. }),
        "{error}"
    );
}

#[tokio::test]
async fn missing_socket_says_where_it_looked() {
    let error = ConfidentialSpaceAttester::new("/nonexistent/teeserver.sock")
        .token(&request())
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("/nonexistent/teeserver.sock"),
        "{error}"
    );
}
