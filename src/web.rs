//! The whole HTTP surface of one front end: the partner and device API with its OpenAPI document
//! (`api`), the worker API (`api::workers`), the console (`console`), metrics and limits. It sits
//! above both `api` and `console`, which share only `app::AppState`.

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use tower_http::timeout::TimeoutLayer;

use crate::api::{self, ops, workers};
use crate::app::AppState;

/// The complete application: routes, OpenAPI, metrics, limits, timeouts.
pub fn router(state: AppState) -> Router {
    ops::install_metrics();
    let (routes, openapi) = api::routes_and_openapi(&state.limits);
    let openapi = Arc::new(openapi);
    routes
        .merge(workers::router(&state.limits))
        .merge(crate::console::router(state.clone()))
        .route(
            "/v1/openapi.json",
            axum::routing::get(move || {
                let openapi = Arc::clone(&openapi);
                async move { axum::Json(openapi.as_ref().clone()) }
            }),
        )
        .route_layer(axum::middleware::from_fn(ops::track_metrics))
        .fallback(ops::fallback)
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            state.limits.request_timeout,
        ))
        .with_state(state)
}
