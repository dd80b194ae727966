//! Key service routes: the signed key set, challenges, the audit head; share release is
//! `release.rs`.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use confed_attestation::exchange::{
    Challenge, KeySet, SignedPublicKey, encode_verifying_key, sign_key,
};

use super::KeyService;
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::ApiPath;
use crate::keys::KeyState;

/// The key service's API with `/metrics`, `/healthz` and `/readyz` beside it.
pub fn router(service: KeyService) -> axum::Router {
    let ops = ops_router(&service);
    api_router(service).merge(ops)
}

/// `/metrics`, `/healthz` and `/readyz`: ready while the grant gate is open, not while waiting
/// for peers after a start, nor after a rollback (the key set is still served; releases are
/// what it cannot do).
pub fn ops_router(service: &KeyService) -> axum::Router {
    let gate = service.gate.clone();
    let readiness: confed_ops::Readiness = std::sync::Arc::new(move || {
        let ready = gate.check().map_err(|refusal| refusal.to_string());
        Box::pin(async move { ready })
    });
    confed_serving::ops::ops_router("keyservice", readiness)
}

/// The key service's API alone (with `--ops-listen`, the operator routes are served elsewhere
/// and only `/healthz` is added here, for liveness probes).
pub fn api_router(service: KeyService) -> axum::Router {
    axum::Router::new()
        .route("/v1/keys", axum::routing::get(key_set))
        .route(
            "/v1/keys/{key_id}/challenge",
            axum::routing::post(challenge),
        )
        .route(
            "/v1/keys/{key_id}/release",
            axum::routing::post(super::release::release),
        )
        .route(
            "/v1/keys/{key_id}/unmask/agree",
            axum::routing::post(super::unmask::agree).layer(axum::extract::DefaultBodyLimit::max(
                super::unmask::AGREE_BODY_LIMIT,
            )),
        )
        .route(
            "/v1/keys/{key_id}/unmask/sums",
            axum::routing::post(super::unmask::sums).layer(axum::extract::DefaultBodyLimit::max(
                super::unmask::SUMS_BODY_LIMIT,
            )),
        )
        .route(
            "/v1/keys/{key_id}/unmask/prepare",
            axum::routing::post(super::unmask_prepare::prepare).layer(
                axum::extract::DefaultBodyLimit::max(super::unmask_prepare::PREPARE_BODY_LIMIT),
            ),
        )
        .route("/v1/audit/head", axum::routing::get(audit_head))
        .route(
            "/v1/audit/witness",
            axum::routing::post(super::witness::accept),
        )
        .route(
            "/v1/audit/witnessed/{keyservice_id}",
            axum::routing::get(super::witness::witnessed),
        )
        .route(
            "/v1/audit/records",
            axum::routing::get(super::witness::records),
        )
        .route(
            "/v1/audit/acknowledgement",
            axum::routing::get(super::witness::acknowledgement),
        )
        .fallback(|| async { ApiError::NotFound("no such route on this key service".into()) })
        // A release request carries the task policy (up to 80 KiB) besides the token.
        .layer(axum::extract::DefaultBodyLimit::max(128 * 1024))
        .with_state(service)
}

/// `GET /v1/keys`: every key this service holds a share of, signed by this service.
async fn key_set(State(service): State<KeyService>) -> Json<KeySet> {
    let now = service.now_seconds();
    let keys = service
        .shares
        .values()
        .map(|held| {
            let key = &held.key;
            let mut entry = SignedPublicKey {
                key_id: key.key_id.clone(),
                suite: key.suite.clone(),
                public_key: key.public_key.clone(),
                not_before: key.not_before,
                not_after: key.not_after,
                threshold: key.threshold,
                shares: key.shares,
                state: KeyState::at(key.not_before, key.not_after, now)
                    .as_str()
                    .into(),
                signature: String::new(),
            };
            sign_key(&service.signing_key, &service.id, &mut entry);
            entry
        })
        .collect();
    Json(KeySet {
        keyservice_id: service.id.clone(),
        verifying_key: encode_verifying_key(service.signing_key.verifying_key()),
        keys,
        masking_key: service.masking_key.as_ref().and_then(|private| {
            let public = private.public_key().ok()?;
            Some(confed_protocol::masking_keys::sign_masking_key(
                &service.signing_key,
                &service.id,
                &public,
            ))
        }),
    })
}

/// `GET /v1/audit/head`: the audit log's latest head, signed by this service (keep copies
/// elsewhere: a log truncated or rewritten later no longer ends at a head you hold).
async fn audit_head(
    State(service): State<KeyService>,
) -> Result<Json<super::audit::SignedHead>, ApiError> {
    let guard = service
        .audit
        .lock()
        .map_err(|_| ApiError::Internal("audit log poisoned".into()))?;
    Ok(Json(guard.0.signed_head(&service.id)))
}

/// `POST /v1/keys/{key_id}/challenge`: a fresh single-use nonce for this key.
async fn challenge(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
) -> Result<(StatusCode, Json<Challenge>), ApiError> {
    if !service.shares.contains_key(&key_id) {
        return Err(unknown_key(&key_id));
    }
    let now = service.now_seconds();
    let (nonce, expires_at) = service
        .nonces
        .lock()
        .map_err(|_| ApiError::Internal("nonce store poisoned".into()))?
        .issue(&key_id, now)
        .map_err(|e| ApiError::Internal(format!("no random bytes for a nonce: {e}")))?;
    Ok((
        StatusCode::CREATED,
        Json(Challenge {
            nonce,
            expires_at,
            audience: service.audience.clone(),
        }),
    ))
}

pub(crate) fn unknown_key(key_id: &str) -> ApiError {
    ApiError::NotFound(format!("this key service holds no share of key {key_id:?}"))
}
