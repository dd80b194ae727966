//! Console errors: an HTML page with the API's status and message (the same words a curl user
//! gets in problem+json), or a redirect to the sign-in page.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::html;
use thiserror::Error;

use super::layout;
use crate::api::error::ApiError;
use crate::blob::BlobError;
use crate::db::DbError;

#[derive(Debug, Error)]
pub enum ConsoleError {
    /// No live session: the browser is sent to the sign-in page.
    #[error("sign in to continue")]
    SignedOut,
    /// A form without a valid CSRF token, or sent from another site.
    #[error("{0}")]
    Forbidden(String),
    /// Anything the API would refuse, with the API's status and words.
    #[error(transparent)]
    Api(#[from] ApiError),
}

impl From<DbError> for ConsoleError {
    fn from(error: DbError) -> Self {
        Self::Api(error.into())
    }
}

impl From<crate::spool::SpoolError> for ConsoleError {
    fn from(error: crate::spool::SpoolError) -> Self {
        Self::Api(error.into())
    }
}

impl From<axum::extract::rejection::PathRejection> for ConsoleError {
    fn from(rejection: axum::extract::rejection::PathRejection) -> Self {
        Self::Api(rejection.into())
    }
}

impl From<axum::extract::rejection::QueryRejection> for ConsoleError {
    fn from(rejection: axum::extract::rejection::QueryRejection) -> Self {
        Self::Api(rejection.into())
    }
}

impl From<axum::extract::rejection::FormRejection> for ConsoleError {
    fn from(rejection: axum::extract::rejection::FormRejection) -> Self {
        Self::Api(ApiError::BadRequest(format!(
            "the form could not be read: {rejection}"
        )))
    }
}

impl From<axum::extract::multipart::MultipartRejection> for ConsoleError {
    fn from(rejection: axum::extract::multipart::MultipartRejection) -> Self {
        Self::Api(ApiError::BadRequest(format!(
            "the upload must be a multipart form: {rejection}"
        )))
    }
}

/// A path parameter; a malformed one gets the console's error page.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ConsoleError))]
pub(super) struct ConsolePath<T>(pub T);

/// A query string; a malformed one gets the console's error page.
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ConsoleError))]
pub(super) struct ConsoleQuery<T>(pub T);

/// A urlencoded form; a malformed one gets the console's error page.
#[derive(axum::extract::FromRequest)]
#[from_request(via(axum::extract::Form), rejection(ConsoleError))]
pub(super) struct ConsoleForm<T>(pub T);

impl From<BlobError> for ConsoleError {
    fn from(error: BlobError) -> Self {
        Self::Api(error.into())
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            Self::SignedOut => return Redirect::to("/console/sign-in").into_response(),
            Self::Forbidden(message) => (StatusCode::FORBIDDEN, message),
            Self::Api(ApiError::Internal(cause)) => {
                let incident = uuid::Uuid::new_v4();
                tracing::error!(%incident, %cause, "internal error (console)");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("the server failed; report incident {incident} to the operator"),
                )
            }
            Self::Api(ApiError::InvalidFields(params)) => (
                StatusCode::BAD_REQUEST,
                params
                    .iter()
                    .map(|p| format!("{} {}", p.name, p.reason))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
            Self::Api(other) => (other.status(), other.to_string()),
        };
        let title = status.canonical_reason().unwrap_or("Error");
        let body = html! {
            h1 { (status.as_u16()) " " (title) }
            p role="alert" { (message) }
            p { a href="/console/tasks" { "Back to your tasks" } }
        };
        (
            status,
            Html(layout::page(title, None, None, body).into_string()),
        )
            .into_response()
    }
}
