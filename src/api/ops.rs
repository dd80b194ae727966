//! Operational routes: health, the OpenAPI document, Prometheus metrics; the per-request metrics
//! middleware and the problem+json fallback for unknown routes.

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::AppState;
use super::error::ApiError;
use crate::states::{RoundState, TaskState};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The process-wide Prometheus recorder, installed on first use.
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
        }
        // Histograms keep every sample until they are folded into their buckets, which happens
        // on a scrape or on upkeep: unscraped, they grew by ~2 MB a minute under load (found
        // by the soak). Fold them every few seconds whether or not anyone scrapes.
        let upkeep = handle.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(METRICS_UPKEEP);
                    upkeep.run_upkeep();
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "no metrics upkeep thread; histograms drain only on scrapes");
        }
        handle
    })
}

/// The server's Prometheus recorder (its latency buckets), not installed and without upkeep: what
/// `prometheus` installs globally, and what a test can use alone.
pub fn recorder() -> metrics_exporter_prometheus::PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("http_request_duration_seconds".into()),
            LATENCY_BUCKETS,
        )
        .expect("latency buckets are non-empty")
        .build_recorder()
}

/// How often histogram samples are folded into buckets.
const METRICS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(5);

/// Counts requests and records latency per route template, method and status.
pub async fn track_metrics(request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = request.method().to_string();
    let started = Instant::now();
    let response = next.run(request).await;
    let labels = [
        ("route", route),
        ("method", method),
        ("status", response.status().as_u16().to_string()),
    ];
    metrics::counter!("http_requests_total", &labels).increment(1);
    metrics::histogram!("http_request_duration_seconds", &labels)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Liveness: the process serves requests. It does not touch the database, so a database outage
/// does not get healthy replicas restarted (`/readyz` reports it).
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Serving", body = String)))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: the task database answers (within the pool's 2 s on PostgreSQL), and, where the
/// front end fetches key sets from key services, an active device key signed by its threshold of
/// them is known. 503 with `Retry-After` while not: take the replica out of the load balancer,
/// do not restart it.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, description = "Ready: the database answers and devices can be given a key", body = String),
              (status = 503, description = "The database does not answer, or no device key signed by enough key services is known", content_type = "application/problem+json")))]
pub async fn readyz(State(state): State<AppState>) -> Result<&'static str, ApiError> {
    state.db.count_by_state::<TaskState>().await?;
    state
        .keys
        .readiness(state.now().seconds().0)
        .map_err(ApiError::Unavailable)?;
    Ok("ready")
}

/// Prometheus text format: HTTP requests and latency per route and status, tasks and rounds by
/// state, check-ins in the recent-devices window per population.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text exposition format", body = String, content_type = "text/plain")))]
pub async fn metrics_text(State(state): State<AppState>) -> Result<Response, ApiError> {
    for (task_state, count) in state.db.count_by_state::<TaskState>().await? {
        metrics::gauge!("confed_tasks", "state" => task_state.as_str()).set(count as f64);
    }
    for (round_state, count) in state.db.count_by_state::<RoundState>().await? {
        metrics::gauge!("confed_rounds", "state" => round_state.as_str()).set(count as f64);
    }
    // Alert on this: jobs still retried after ALERT_AFTER_FAILURES transient failures.
    metrics::gauge!("confed_aggregation_jobs_failing").set(
        state
            .db
            .failing_jobs(crate::db::jobs::ALERT_AFTER_FAILURES)
            .await? as f64,
    );
    for (population, count) in state.registry.by_population(state.now()) {
        metrics::gauge!("confed_recent_checkins", "population" => population).set(count as f64);
    }
    let body = prometheus().render();
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        body,
    )
        .into_response())
}

pub async fn fallback(request: Request) -> ApiError {
    metrics::counter!("http_requests_total", "route" => "unmatched", "method" => request.method().to_string(), "status" => "404")
        .increment(1);
    ApiError::NotFound(format!(
        "no route {} {}; see /v1/openapi.json for the API",
        request.method(),
        request.uri().path()
    ))
}
