//! The issuer's HTTP errors: one status and an RFC 7807 `application/problem+json` body each, with
//! the `urn:confed:problem:*` types of the other services (`docs/api.md`). Internal details are
//! logged with an incident id, never sent.

use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::IssueError;
use crate::attester::FailedCheck;

pub const PROBLEM_JSON: &str = "application/problem+json";

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

/// What a route answers when it fails.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
    failed_checks: Vec<FailedCheck>,
    retry_after: Option<RetryAfter>,
}

/// When a refused client may try again: at a point in time (the end of a spent window) or after
/// a number of seconds (a short outage).
#[derive(Debug, Clone, Copy)]
enum RetryAfter {
    At(confed_protocol::clock::Seconds),
    In(i64),
}

impl ApiError {
    pub fn bad_request(detail: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "bad-request",
            title: "Bad request",
            detail: detail.into(),
            failed_checks: Vec::new(),
            retry_after: None,
        }
    }

    fn internal(cause: &str) -> Self {
        let mut incident = [0u8; 8];
        let incident = match getrandom::fill(&mut incident) {
            Ok(()) => confed_protocol::hex::encode(incident),
            Err(_) => "unnumbered".into(),
        };
        tracing::error!(%incident, %cause, "internal error");
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "internal",
            title: "Internal error",
            detail: format!("the issuer failed; report incident {incident} to its operator"),
            failed_checks: Vec::new(),
            retry_after: None,
        }
    }

    /// The issuer cannot record grants (its disk): nothing was granted; retry later.
    fn unavailable(cause: &str) -> Self {
        tracing::error!(%cause, "cannot record a grant");
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "unavailable",
            title: "Unavailable",
            detail: "the issuer cannot record grants right now; nothing was granted, retry shortly"
                .into(),
            failed_checks: Vec::new(),
            retry_after: Some(RetryAfter::In(5)),
        }
    }
}

impl From<IssueError> for ApiError {
    fn from(error: IssueError) -> Self {
        let detail = error.to_string();
        match error {
            IssueError::BadRequest(_) => Self::bad_request(detail),
            IssueError::Challenge(_) => Self {
                status: StatusCode::FORBIDDEN,
                kind: "challenge-refused",
                title: "Challenge refused",
                detail,
                failed_checks: Vec::new(),
                retry_after: None,
            },
            IssueError::Attestation(failed_checks) => Self {
                status: StatusCode::FORBIDDEN,
                kind: "attestation-refused",
                title: "Attestation refused",
                detail,
                failed_checks,
                retry_after: None,
            },
            IssueError::Credential => Self {
                status: StatusCode::FORBIDDEN,
                kind: "credential-refused",
                title: "Credential refused",
                detail,
                failed_checks: Vec::new(),
                retry_after: None,
            },
            IssueError::Exhausted(exhausted) => Self {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "token-limit-reached",
                title: "Token limit reached",
                detail,
                failed_checks: Vec::new(),
                retry_after: Some(RetryAfter::At(exhausted.window_ends_at)),
            },
            IssueError::Storage(cause) => Self::unavailable(&cause.to_string()),
            IssueError::AttesterStorage(cause) => Self::unavailable(&cause),
            IssueError::AttesterUnavailable(cause) => {
                tracing::error!(%cause, "refusing attestations");
                Self {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    kind: "unavailable",
                    title: "Unavailable",
                    detail,
                    failed_checks: Vec::new(),
                    retry_after: Some(RetryAfter::In(300)),
                }
            }
            IssueError::Signing(cause) => Self::internal(&cause),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        let mut error = Self::bad_request(rejection.body_text());
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            error.status = StatusCode::PAYLOAD_TOO_LARGE;
            error.kind = "payload-too-large";
            error.title = "Payload too large";
        }
        error
    }
}

impl ApiError {
    /// `Retry-After` in seconds from `now`, for a 429 whose window ends at `retry_after`.
    pub fn into_response_at(self, now: confed_protocol::clock::Seconds) -> Response {
        let retry = self.retry_after.map(|after| match after {
            RetryAfter::At(at) => (at.0 - now.0).max(1),
            RetryAfter::In(seconds) => seconds,
        });
        let problem = Problem {
            problem_type: format!("urn:confed:problem:{}", self.kind),
            title: self.title,
            status: self.status.as_u16(),
            detail: self.detail,
            failed_checks: self.failed_checks,
        };
        let mut response = (self.status, axum::Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = retry
            && let Ok(value) = HeaderValue::from_str(&seconds.to_string())
        {
            headers.insert(header::RETRY_AFTER, value);
        }
        response
    }
}
