//! `/metrics`, `/healthz` and `/readyz` as axum routes, to merge into a service's router (key
//! services, the token issuer) or to serve alone (a `confed serve` without the API role). The
//! same answers as `confed_ops::serve_ops`, which serves them where there is no axum.

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use confed_ops::Readiness;

/// What `/readyz` asks the prober to wait before asking again.
const NOT_READY_RETRY_SECONDS: u32 = 5;

/// The three operator routes; `readiness` decides `/readyz` (and `confed_ready{role}`).
pub fn ops_router(role: &'static str, readiness: Readiness) -> Router {
    let scraped = readiness.clone();
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let readiness = scraped.clone();
                async move {
                    confed_ops::record_readiness(role, &readiness().await);
                    metrics().await
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let readiness = readiness.clone();
                async move { ready(readiness).await }
            }),
        )
}

/// The process's metrics in Prometheus's text format.
pub async fn metrics() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(confed_ops::listener::METRICS_CONTENT_TYPE),
        )],
        confed_ops::render(),
    )
        .into_response()
}

async fn ready(readiness: Readiness) -> Response {
    match readiness().await {
        Ok(()) => "ready".into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/problem+json"),
                ),
                (
                    header::RETRY_AFTER,
                    HeaderValue::from(NOT_READY_RETRY_SECONDS),
                ),
            ],
            serde_json::json!({
                "type": "about:blank",
                "title": "Service Unavailable",
                "status": 503,
                "detail": why,
            })
            .to_string(),
        )
            .into_response(),
    }
}
