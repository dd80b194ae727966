//! The key service's HTTP errors, each one status and an RFC 7807 `application/problem+json` body
//! (the same `urn:confed:problem:*` types as the front ends, `docs/api.md`). Internal details are
//! logged with an incident id, never sent.

use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use thiserror::Error;

pub const PROBLEM_JSON: &str = "application/problem+json";

#[derive(Debug, Error)]
pub enum KeyServiceApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{detail}")]
    AttestationRefused {
        detail: String,
        failed_checks: Vec<FailedCheck>,
    },
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    /// The request contradicts what this service recorded (an unmask of another included set).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    Unavailable(String),
    /// A peer witnessed a head this service's audit log does not contain (`rollback.rs`).
    #[error("{0}")]
    RolledBack(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// One failed appraisal check (RFC 7807 extension member `failed_checks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCheck {
    pub check: String,
    pub reason: String,
}

/// The problem document as the key service sends it.
#[derive(Debug, Serialize)]
struct Problem {
    #[serde(rename = "type")]
    problem_type: String,
    title: &'static str,
    status: u16,
    detail: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    failed_checks: Vec<FailedCheck>,
}

impl KeyServiceApiError {
    fn status_and_kind(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad-request", "Bad request"),
            Self::AttestationRefused { .. } => (
                StatusCode::FORBIDDEN,
                "attestation-refused",
                "Attestation refused",
            ),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden", "Forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            Self::Conflict(_) => (StatusCode::CONFLICT, "conflict", "Conflict"),
            Self::PayloadTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "Payload too large",
            ),
            Self::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Unavailable",
            ),
            Self::RolledBack(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "audit-rolled-back",
                "Audit log rolled back",
            ),
            Self::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
            ),
        }
    }
}

impl IntoResponse for KeyServiceApiError {
    fn into_response(self) -> Response {
        let (status, kind, title) = self.status_and_kind();
        let detail = match &self {
            Self::Internal(cause) => {
                let incident = incident_id();
                tracing::error!(%incident, %cause, "internal error");
                format!("the server failed; report incident {incident} to the operator")
            }
            other => other.to_string(),
        };
        let problem = Problem {
            problem_type: format!("urn:confed:problem:{kind}"),
            title,
            status: status.as_u16(),
            detail,
            failed_checks: match self {
                Self::AttestationRefused { failed_checks, .. } => failed_checks,
                _ => Vec::new(),
            },
        };
        let mut response = (status, axum::Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        // A rolled-back service stays closed until its operator acts: no retry hint.
        if status == StatusCode::SERVICE_UNAVAILABLE && kind != "audit-rolled-back" {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        response
    }
}

/// 16 random hex characters naming one logged failure.
fn incident_id() -> String {
    let mut bytes = [0u8; 8];
    match getrandom::fill(&mut bytes) {
        Ok(()) => confed_protocol::hex::encode(bytes),
        Err(_) => "unnumbered".into(),
    }
}

impl From<BytesRejection> for KeyServiceApiError {
    fn from(rejection: BytesRejection) -> Self {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Self::PayloadTooLarge(format!(
                "the request body is larger than this route accepts: {}",
                rejection.body_text()
            )),
            _ => Self::BadRequest(rejection.body_text()),
        }
    }
}

impl From<PathRejection> for KeyServiceApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::BadRequest(rejection.body_text())
    }
}
