//! The enclave reads its worker token from Secret Manager with the VM's service account (never
//! from a launch variable, which Confidential Space copies into every attestation token). Fakes
//! of the GCE metadata server and of Secret Manager's `:access` method, on loopback, speak the
//! real protocols.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): the enclave's secret fetch only; no store.

use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use confed_enclave::secret::{SecretError, SecretManager};
use serde_json::{Value, json};

#[derive(Clone, Default)]
struct Fake {
    /// Authorization headers Secret Manager saw.
    seen: Arc<Mutex<Vec<String>>>,
}

async fn token(headers: HeaderMap) -> Result<axum::Json<Value>, StatusCode> {
    // The metadata server answers only requests that carry Metadata-Flavor: Google.
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return Err(StatusCode::FORBIDDEN);
    }
    Ok(axum::Json(
        json!({"access_token": "ya29.sa-token", "expires_in": 3599, "token_type": "Bearer"}),
    ))
}

async fn access(
    State(fake): State<Fake>,
    Path(rest): Path<String>,
    headers: HeaderMap,
) -> Result<axum::Json<Value>, StatusCode> {
    let auth = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    fake.seen.lock().unwrap().push(auth.clone());
    if auth != "Bearer ya29.sa-token" {
        return Err(StatusCode::UNAUTHORIZED);
    }
    match rest.as_str() {
        "worker-token/versions/3:access" => Ok(axum::Json(json!({
            "name": "projects/p/secrets/worker-token/versions/3",
            "payload": {"data": STANDARD.encode("  the-worker-token-0123456789abcdef0123\n"),
                        "dataCrc32c": "0"}
        }))),
        "empty/versions/1:access" => Ok(axum::Json(json!({
            "name": "projects/p/secrets/empty/versions/1",
            "payload": {"data": STANDARD.encode("   ")}
        }))),
        _ => Err(StatusCode::NOT_FOUND),
    }
}

async fn serve() -> (String, Fake) {
    let fake = Fake::default();
    let router = axum::Router::new()
        .route(
            "/computeMetadata/v1/instance/service-accounts/default/token",
            get(token),
        )
        .route("/v1/projects/p/secrets/{*rest}", get(access))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (url, fake)
}

fn manager(url: &str) -> SecretManager {
    SecretManager::with_endpoints(
        confed_protocol::http::client(std::time::Duration::from_secs(10)),
        &format!("{url}/computeMetadata/v1/instance/service-accounts/default/token"),
        &format!("{url}/v1"),
    )
}

#[tokio::test]
async fn the_worker_token_is_read_with_the_vms_service_account() {
    let (url, fake) = serve().await;
    let token = manager(&url)
        .access("projects/p/secrets/worker-token/versions/3")
        .await
        .unwrap();
    assert_eq!(token.as_str(), "the-worker-token-0123456789abcdef0123");
    assert_eq!(*fake.seen.lock().unwrap(), ["Bearer ya29.sa-token"]);
}

#[tokio::test]
async fn missing_empty_and_malformed_secrets_are_clear_errors() {
    let (url, _) = serve().await;
    let m = manager(&url);
    assert!(matches!(
        m.access("projects/p/secrets/absent/versions/1").await,
        Err(SecretError::Access(_))
    ));
    assert!(matches!(
        m.access("projects/p/secrets/empty/versions/1").await,
        Err(SecretError::Empty)
    ));
    assert!(matches!(
        m.access("projects/p/secrets/../versions/1").await,
        Err(SecretError::BadName(_))
    ));
}
