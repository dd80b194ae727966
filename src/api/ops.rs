//! Operational routes: health, the OpenAPI document, Prometheus metrics; the per-request metrics
//! middleware and the problem+json fallback for unknown routes.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::app::AppState;
use crate::states::{RoundState, TaskState};

/// confed's recorder (its histogram buckets), not installed: what a test can use alone.
pub use confed_ops::metrics::recorder;

/// Installs the process's Prometheus recorder (once) as `confed`, and creates at 0 every series
/// the shipped alert rules watch that the front ends and the scheduler record: an alert on a
/// series that does not exist yet is silently "no data", and CI's check that every metric the
/// rules name is scraped from the local cluster (deploy/monitoring/) would not see a renamed one.
pub fn install_metrics() {
    static ZEROED: std::sync::Once = std::sync::Once::new();
    confed_ops::install(confed_ops::BuildInfo {
        process: "confed",
        version: env!("CARGO_PKG_VERSION"),
    });
    ZEROED.call_once(|| {
        for name in [
            "confed_database_unavailable_total",
            "confed_disk_full_total",
            "confed_blob_store_errors_total",
            "confed_contributions_late_total",
            "confed_rounds_aggregated_total",
            "confed_contributions_included_total",
        ] {
            metrics::counter!(name).absolute(0);
        }
        for reclaimed in ["truncated", "punched", "kept"] {
            metrics::counter!("confed_contribution_log_abandoned_bytes_total", "reclaimed" => reclaimed)
                .absolute(0);
        }
        for reason in ["decryption_failed", "wrong_key"] {
            metrics::counter!("confed_contributions_excluded_total", "reason" => reason).absolute(0);
        }
        for outcome in ["stored", "stored_direct"] {
            metrics::counter!("confed_contributions_total", "outcome" => outcome).absolute(0);
        }
        for outcome in ["aggregating", "retried", "task_failed"] {
            metrics::counter!("confed_round_deadlines_total", "outcome" => outcome).absolute(0);
        }
        for kind in ["transient", "permanent"] {
            metrics::counter!("confed_aggregation_jobs_failed_total", "kind" => kind).absolute(0);
        }
        let outcomes = std::iter::once("assigned").chain(
            crate::checkin::RetryReason::ALL
                .into_iter()
                .map(crate::checkin::RetryReason::as_str),
        );
        for outcome in outcomes {
            metrics::counter!("confed_checkins_total", "outcome" => outcome).absolute(0);
        }
        metrics::gauge!("confed_aggregation_jobs_failing").set(0.0);
    });
}

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
    readiness(&state).await?;
    Ok("ready")
}

/// What `/readyz` checks; `/metrics` records it as `confed_ready`.
async fn readiness(state: &AppState) -> Result<(), ApiError> {
    state.db.count_by_state::<TaskState>().await?;
    keys_ready(state)
}

/// The key half of readiness: an active device key signed by its threshold of key services.
fn keys_ready(state: &AppState) -> Result<(), ApiError> {
    state
        .keys
        .readiness(state.now().seconds().0)
        .map_err(ApiError::Unavailable)
}

/// The gauges read from the task database at each scrape.
async fn database_gauges(state: &AppState) -> Result<(), crate::db::DbError> {
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
    Ok(())
}

/// Prometheus text format: HTTP requests and latency per route and status, tasks and rounds by
/// state, check-ins in the recent-devices window per population, readiness, build info and the
/// process's resources. Answered also while the database is down (its gauges keep their last
/// values, `confed_ready` is 0): a scrape that fails would hide what the alerts need.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text exposition format", body = String, content_type = "text/plain")))]
pub async fn metrics_text(State(state): State<AppState>) -> Response {
    // The gauges' queries are readiness's database check too: the database is asked once (and a
    // database that is down costs one pool timeout, not two).
    let ready = match database_gauges(&state).await {
        Ok(()) => keys_ready(&state),
        Err(error) => {
            tracing::warn!(%error, "metrics: the task database did not answer; its gauges are stale");
            Err(error.into())
        }
    };
    confed_ops::record_readiness("api", &ready.map_err(|e| e.to_string()));
    for (population, count) in state.registry.by_population(state.now()) {
        metrics::gauge!("confed_recent_checkins", "population" => population).set(count as f64);
    }
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(confed_ops::listener::METRICS_CONTENT_TYPE),
        )],
        confed_ops::render(),
    )
        .into_response()
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
