//! Request extractors whose rejections are problem+json, and the two kinds of caller identity:
//! a tenant (bearer token) and the operator (admin token).

use axum::extract::{FromRequest, FromRequestParts};
use axum::http::header;
use axum::http::request::Parts;

use super::error::ApiError;
use crate::app::AppState;
use crate::db::TenantRecord;

/// JSON body; unknown fields are refused by the target types (`deny_unknown_fields`).
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct ApiJson<T>(pub T);

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct ApiQuery<T>(pub T);

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct ApiPath<T>(pub T);

/// The whole raw body, within the route's body limit.
pub struct ApiBytes(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        Ok(Self(axum::body::Bytes::from_request(request, state).await?))
    }
}

/// Refuses (413) a model upload whose declared `Content-Length` is over the server's model limit
/// before a byte of its body is read: an upload declaring 10 GB was read into memory up to the
/// limit (512 MiB) before. Must come before the body extractor.
pub struct DeclaredModelLength;

impl FromRequestParts<AppState> for DeclaredModelLength {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let limit = state.limits.model_bytes as u64;
        if let Some(declared) = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            && declared > limit
        {
            return Err(ApiError::PayloadTooLarge(format!(
                "the model is {declared} bytes; this server accepts models of at most {limit} bytes"
            )));
        }
        Ok(Self)
    }
}

pub(crate) fn bearer(parts: &Parts) -> Option<&str> {
    let value = parts.headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The tenant whose token authenticated this request.
pub struct Tenant(pub TenantRecord);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let token = bearer(parts).ok_or(ApiError::Unauthorized(
            "send the tenant's API token as `Authorization: Bearer <token>`",
        ))?;
        match state.db.tenant_for_token(token).await? {
            Some(tenant) => Ok(Tenant(tenant)),
            None => Err(ApiError::Unauthorized(
                "the API token is not valid; ask the operator for a tenant token",
            )),
        }
    }
}

/// Proof that the caller holds the operator's admin token.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        let Some(admin) = &state.admin else {
            return Err(ApiError::NotFound(
                "the admin API is off; start the server with CONFED_ADMIN_TOKEN set to enable it"
                    .into(),
            ));
        };
        match bearer(parts) {
            Some(token) if admin.matches(token) => Ok(Admin),
            _ => Err(ApiError::Unauthorized(
                "send the operator's admin token as `Authorization: Bearer <token>`",
            )),
        }
    }
}
