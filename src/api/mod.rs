//! The partner-facing HTTP API (JSON, problem+json errors) and operational routes. One handler per
//! route; the router and the OpenAPI document are built from the same declarations so they cannot
//! drift.

pub mod admin;
pub mod device_tokens;
pub mod devices;
pub mod error;
pub mod evaluations;
pub mod extract;
pub mod integers;
pub mod model_body;
pub mod models;
pub mod openapi;
pub mod ops;
pub mod populations;
pub mod releases;
pub mod spool;
pub mod tasks;
pub mod workers;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use tower_http::timeout::TimeoutLayer;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth::AdminToken;
use crate::blob::BlobStore;
use crate::clock::{Clock, Millis};
use crate::db::Db;
use crate::keys::directory::KeyDirectory;
use crate::registry::DeviceRegistry;

/// Limits applied to every request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest JSON request body.
    pub json_body_bytes: usize,
    /// Largest model upload.
    pub model_bytes: usize,
    /// Longest time a request may take, body upload included.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            json_body_bytes: 256 * 1024,
            model_bytes: 512 * 1024 * 1024,
            request_timeout: Duration::from_secs(120),
        }
    }
}

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    pub db: Db,
    /// Models and aggregates.
    pub blobs: Arc<dyn BlobStore>,
    /// Device contributions (many small write-once objects).
    pub contributions: Arc<dyn BlobStore>,
    pub clock: Arc<dyn Clock>,
    /// `None` turns the admin API off.
    pub admin: Option<AdminToken>,
    pub limits: Limits,
    /// The key services' signed key sets, for assignments.
    pub keys: KeyDirectory,
    /// Recent check-ins (soft state).
    pub registry: Arc<DeviceRegistry>,
    /// `None` turns the worker API (`/internal/v1`) off.
    pub worker_token: Option<AdminToken>,
    /// The partner console's cookie settings.
    pub console: crate::console::ConsoleSettings,
    /// Which fitting task a checking-in device serves first (`confed serve --scheduling`).
    pub scheduling: crate::scheduling::SchedulingPolicy,
    /// How large rounds are cut into partitions for several enclave workers.
    pub partitioning: crate::partitioning::PartitionPolicy,
    /// Each task's device-token requirement, for the upload check (`device_tokens.rs`).
    pub device_auth: device_tokens::DeviceAuthCache,
}

impl AppState {
    pub fn now(&self) -> Millis {
        self.clock.now_millis()
    }

    /// The task service over this state's database, model store and check-in registry.
    pub fn tasks(&self) -> crate::tasks::Tasks<'_> {
        crate::tasks::Tasks {
            db: &self.db,
            blobs: self.blobs.as_ref(),
            registry: &self.registry,
        }
    }

    /// The upload service over this state's database, keys and contribution store.
    pub fn uploads(&self) -> crate::uploads::Uploads<'_> {
        crate::uploads::Uploads {
            db: &self.db,
            keys: &self.keys,
            contributions: self.contributions.as_ref(),
        }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "confed", description = "Task management API of confed, a confidential-computing federated-learning server. Errors are RFC 7807 problem details (application/problem+json)."),
    modifiers(&SecuritySchemes),
    tags(
        (name = "tasks", description = "Partner tasks and rounds"),
        (name = "models", description = "Model versions"),
        (name = "admin", description = "Operator API (needs CONFED_ADMIN_TOKEN)"),
        (name = "devices", description = "Task assignment for devices (no tenant token)"),
        (name = "operations", description = "Health, metrics, this document"),
    )
)]
struct ApiDoc;

struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in ["tenant_token", "admin_token"] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
            );
        }
    }
}

/// The routes and the OpenAPI document describing exactly them.
pub fn routes_and_openapi(limits: &Limits) -> (Router<AppState>, utoipa::openapi::OpenApi) {
    let model_upload = OpenApiRouter::new()
        .routes(routes!(models::put_model))
        .layer(DefaultBodyLimit::max(limits.model_bytes));
    // A contribution is an update of the model's size plus the envelope; the per-task limit is
    // checked in the handler.
    let contribution_upload = OpenApiRouter::new()
        .routes(routes!(devices::put_contribution))
        .layer(DefaultBodyLimit::max(
            crate::checkin::contribution_limit(limits.model_bytes as i64) as usize,
        ));
    let routes = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(tasks::create_task, tasks::list_tasks))
        .routes(routes!(tasks::get_task))
        .routes(routes!(tasks::cancel_task))
        .routes(routes!(tasks::list_rounds))
        .routes(routes!(releases::list_releases))
        .routes(routes!(releases::get_average))
        .routes(routes!(releases::get_manifest))
        .routes(routes!(
            evaluations::list_evaluations,
            evaluations::request_evaluation
        ))
        .routes(routes!(models::get_model))
        .routes(routes!(admin::create_tenant, admin::list_tenants))
        .routes(routes!(populations::list_populations))
        .routes(routes!(populations::register_population))
        .routes(routes!(populations::assign_population))
        .routes(routes!(admin::resume_round))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics_text))
        .routes(routes!(devices::checkin))
        .routes(routes!(devices::get_model))
        .routes(routes!(devices::report))
        .layer(DefaultBodyLimit::max(limits.json_body_bytes))
        .merge(model_upload)
        .merge(contribution_upload);
    let (router, mut document) = routes.split_for_parts();
    openapi::declare_common_responses(&mut document);
    (router, document)
}

/// The complete application: routes, OpenAPI, metrics, limits, timeouts.
pub fn router(state: AppState) -> Router {
    ops::install_metrics();
    let (routes, openapi) = routes_and_openapi(&state.limits);
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
