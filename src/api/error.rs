//! The API layer's errors, each mapped to one HTTP status and an RFC 7807
//! `application/problem+json` body. Internal details are logged with an id, never sent.

use axum::extract::rejection::{BytesRejection, JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use thiserror::Error;
use utoipa::ToSchema;

use crate::blob::BlobError;
use crate::db::DbError;
use crate::task_spec::InvalidParam;

pub const PROBLEM_JSON: &str = "application/problem+json";

#[derive(Debug, Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("the request has {} invalid field(s)", .0.len())]
    InvalidFields(Vec<InvalidParam>),
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("{0}")]
    NotFound(String),
    /// A route of an API this server runs without (the worker API with no worker token): 404,
    /// but of its own kind, so a client never reads it as "no such object".
    #[error("{0}")]
    ApiOff(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    LeaseLost(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Gone(String),
    /// The server's disk (or database) is full: 507 with `Retry-After`, so devices back off and
    /// operators see the cause rather than `500 internal`.
    #[error("{0}")]
    InsufficientStorage(String),
    #[error("{0}")]
    Unprocessable(String),
    /// The task requires a device token and the upload carries none: 401 with an RFC 9577
    /// `WWW-Authenticate: PrivateToken` challenge for the upload's assignment.
    #[error("{detail}")]
    TokenRequired {
        detail: String,
        www_authenticate: String,
    },
    /// The upload's device token does not authenticate it.
    #[error("{0}")]
    TokenRefused(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// RFC 7807 problem details, with `invalid_params` for validation failures.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// A URN naming the kind of problem, e.g. `urn:confed:problem:invalid-request`.
    #[serde(rename = "type")]
    pub problem_type: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub invalid_params: Vec<InvalidParam>,
}

impl ApiError {
    fn status_and_kind(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad-request", "Bad request"),
            Self::InvalidFields(_) => (
                StatusCode::BAD_REQUEST,
                "invalid-request",
                "Invalid request",
            ),
            Self::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized", "Unauthorized"),
            Self::QuotaExceeded(_) => (StatusCode::FORBIDDEN, "quota-exceeded", "Quota exceeded"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not-found", "Not found"),
            Self::ApiOff(_) => (StatusCode::NOT_FOUND, "api-off", "API off"),
            Self::Conflict(_) => (StatusCode::CONFLICT, "conflict", "Conflict"),
            Self::LeaseLost(_) => (StatusCode::CONFLICT, "lease-lost", "Lease lost"),
            Self::PayloadTooLarge(_) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "Payload too large",
            ),
            Self::UnsupportedMediaType(_) => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "Unsupported media type",
            ),
            Self::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "Unavailable",
            ),
            Self::Gone(_) => (StatusCode::GONE, "gone", "Gone"),
            Self::InsufficientStorage(_) => (
                StatusCode::INSUFFICIENT_STORAGE,
                "insufficient-storage",
                "Insufficient storage",
            ),
            Self::Unprocessable(_) => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "unprocessable",
                "Unprocessable",
            ),
            Self::TokenRequired { .. } => (
                StatusCode::UNAUTHORIZED,
                "token-required",
                "Device token required",
            ),
            Self::TokenRefused(_) => (StatusCode::FORBIDDEN, "token-refused", "Token refused"),
            Self::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.status_and_kind().0
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, title) = self.status_and_kind();
        let detail = match &self {
            Self::Internal(cause) => {
                let incident = uuid::Uuid::new_v4();
                tracing::error!(%incident, %cause, "internal error");
                format!("the server failed; report incident {incident} to the operator")
            }
            Self::InvalidFields(params) => params
                .iter()
                .map(|p| format!("`{}` {}", p.name, p.reason))
                .collect::<Vec<_>>()
                .join("; "),
            other => other.to_string(),
        };
        let problem = Problem {
            problem_type: format!("urn:confed:problem:{kind}"),
            title: title.to_string(),
            status: status.as_u16(),
            detail,
            invalid_params: match &self {
                Self::InvalidFields(params) => params.clone(),
                _ => Vec::new(),
            },
        };
        let mut response = (status, axum::Json(problem)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Self::TokenRequired {
            www_authenticate, ..
        } = &self
        {
            if let Ok(value) = HeaderValue::from_str(www_authenticate) {
                headers.insert(header::WWW_AUTHENTICATE, value);
            }
        } else if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // When to try again (RFC 9110 10.2.3): a full disk takes an operator; a store hiccup less.
        match status {
            StatusCode::INSUFFICIENT_STORAGE => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            }
            _ => {}
        }
        response
    }
}

impl From<DbError> for ApiError {
    fn from(error: DbError) -> Self {
        match error {
            DbError::NotFound { entity, id } => Self::NotFound(format!("{entity} {id} not found")),
            e @ (DbError::StateConflict { .. }
            | DbError::IllegalTransition { .. }
            | DbError::AlreadyExists(_)
            | DbError::Conflict(_)
            | DbError::PopulationTaken(_)) => Self::Conflict(e.to_string()),
            e @ DbError::QuotaExceeded { .. } => Self::QuotaExceeded(e.to_string()),
            DbError::ComputeBudget(detail) => Self::InvalidFields(vec![InvalidParam {
                name: "device_seconds_per_round".into(),
                reason: detail,
            }]),
            other if other.note_outage() => {
                if other.is_disk_full() {
                    insufficient_storage()
                } else {
                    Self::Unavailable(
                        "the task database is unavailable; retry after the Retry-After seconds"
                            .into(),
                    )
                }
            }
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<crate::checkin::CheckinError> for ApiError {
    fn from(error: crate::checkin::CheckinError) -> Self {
        use crate::checkin::CheckinError;
        match error {
            CheckinError::Invalid(error) => Self::BadRequest(error.to_string()),
            CheckinError::Db(error) => error.into(),
            CheckinError::Blob(error) => error.into(),
            CheckinError::Random(error) => Self::Internal(error.to_string()),
        }
    }
}

impl From<crate::tasks::TaskError> for ApiError {
    fn from(error: crate::tasks::TaskError) -> Self {
        use crate::tasks::TaskError;
        match error {
            TaskError::InvalidFields(problems) => Self::InvalidFields(problems),
            TaskError::BadPageToken | TaskError::NotAModel(_) => {
                Self::BadRequest(error.to_string())
            }
            TaskError::NotCreated { .. } => Self::Conflict(error.to_string()),
            TaskError::Spool(detail) | TaskError::Validation(detail) => Self::Internal(detail),
            TaskError::Db(error) => error.into(),
            TaskError::Blob(error) => error.into(),
        }
    }
}

impl From<BlobError> for ApiError {
    fn from(error: BlobError) -> Self {
        // A cloud store's hiccup is worth a retry, a full disk a later one; everything else is
        // ours to fix.
        match error {
            BlobError::Remote { .. } if error.note_outage() => {
                Self::Unavailable("the blob store is unavailable; retry shortly".into())
            }
            other if other.note_outage() => insufficient_storage(),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<crate::spool::SpoolError> for ApiError {
    fn from(error: crate::spool::SpoolError) -> Self {
        use crate::spool::SpoolError;
        match error {
            SpoolError::Busy { .. } => Self::Unavailable(error.to_string()),
            SpoolError::TooLarge { .. } => Self::PayloadTooLarge(error.to_string()),
            SpoolError::BrokenOff { .. } => Self::BadRequest(error.to_string()),
            SpoolError::DiskFull { .. } => disk_full(&error),
            SpoolError::Failed { .. } => Self::Internal(error.to_string()),
        }
    }
}

pub(crate) fn disk_full(cause: &dyn std::fmt::Display) -> ApiError {
    crate::blob::note_disk_full(cause);
    insufficient_storage()
}

/// 507, for a full disk already counted and logged.
fn insufficient_storage() -> ApiError {
    ApiError::InsufficientStorage(
        "the server's storage is full; nothing was stored, retry later (Retry-After)".into(),
    )
}

/// Maps a body-reading failure by its status: 413 past the size limit, else 400.
fn body_problem(status: StatusCode, text: String) -> ApiError {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(format!(
            "the request body is larger than this route accepts: {text}"
        )),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => {
            ApiError::UnsupportedMediaType(format!("{text}; send `Content-Type: application/json`"))
        }
        _ => ApiError::BadRequest(text),
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        body_problem(rejection.status(), rejection.body_text())
    }
}

impl From<BytesRejection> for ApiError {
    fn from(rejection: BytesRejection) -> Self {
        body_problem(rejection.status(), rejection.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::BadRequest(rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::BadRequest(rejection.body_text())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_and_retry(error: ApiError) -> (StatusCode, Option<String>) {
        let response = error.into_response();
        let retry = response
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        (response.status(), retry)
    }

    /// A full disk answered `500 internal` on check-in, upload, report and task creation. The
    /// errors here are real: the OS's ENOSPC from /dev/full and SQLite's own SQLITE_FULL.
    #[test]
    fn a_full_disk_answers_507_with_retry_after() {
        use std::io::Write;
        let enospc = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
            .write_all(b"contribution")
            .unwrap_err();
        let blob = BlobError::Io {
            key: "contributions/x".into(),
            source: enospc,
        };
        let expected = (StatusCode::INSUFFICIENT_STORAGE, Some("60".to_string()));
        assert_eq!(status_and_retry(blob.into()), expected);

        let db = rusqlite::Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE t (x BLOB); PRAGMA max_page_count = 3;")
            .unwrap();
        let full = (0..100)
            .find_map(|_| {
                db.execute("INSERT INTO t VALUES (zeroblob(4096))", [])
                    .err()
            })
            .expect("SQLite ran out of pages");
        assert_eq!(status_and_retry(DbError::Sqlite(full).into()), expected);

        let other = BlobError::Io {
            key: "x".into(),
            source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        };
        assert_eq!(
            status_and_retry(other.into()).0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            status_and_retry(ApiError::Unavailable("x".into())),
            (StatusCode::SERVICE_UNAVAILABLE, Some("5".to_string()))
        );
    }

    /// With PostgreSQL down every request waited 30 s and answered 500 without `Retry-After`,
    /// which the device clients do not retry: no connection is a 503 with `Retry-After`.
    #[test]
    fn a_database_that_cannot_be_reached_answers_503_with_retry_after() {
        let expected = (StatusCode::SERVICE_UNAVAILABLE, Some("5".to_string()));
        for error in [
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        ] {
            let shown = error.to_string();
            assert_eq!(
                status_and_retry(DbError::Sqlx(error).into()),
                expected,
                "{shown}"
            );
        }
        assert_eq!(
            status_and_retry(DbError::Sqlx(sqlx::Error::RowNotFound).into()).0,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
}
