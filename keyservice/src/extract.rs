//! Request extractors whose rejections are the key service's problem+json.

use axum::extract::{FromRequest, FromRequestParts};

use crate::error::KeyServiceApiError;

#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(KeyServiceApiError))]
pub struct ApiPath<T>(pub T);

/// The whole raw body, within the route's body limit.
pub struct ApiBytes(pub axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = KeyServiceApiError;

    async fn from_request(
        request: axum::extract::Request,
        state: &S,
    ) -> Result<Self, KeyServiceApiError> {
        Ok(Self(axum::body::Bytes::from_request(request, state).await?))
    }
}
