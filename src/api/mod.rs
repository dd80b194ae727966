//! The partner-facing HTTP API (JSON, problem+json errors) and operational routes. One handler per
//! route; the router and the OpenAPI document are built from the same declarations so they cannot
//! drift.

pub mod admin;
pub mod devices;
pub mod error;
pub mod evaluations;
pub mod extract;
pub mod model_body;
pub mod models;
pub mod openapi;
pub mod ops;
pub mod populations;
pub mod releases;
pub mod tasks;
pub mod worker_reads;
pub mod workers;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::app::{AppState, Limits};

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
    // A contribution is an update of the model's size (up to twice it, masked) plus the envelope;
    // the per-task limit is checked in the handler.
    let contribution_upload = OpenApiRouter::new()
        .routes(routes!(devices::put_contribution))
        .layer(DefaultBodyLimit::max(crate::checkin::contribution_limit(
            limits.model_bytes as i64,
            true,
        ) as usize));
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
