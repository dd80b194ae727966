//! The issuer's HTTP API (`docs/protocol.md`, "Device tokens"): its directory, attestation
//! challenges, and token requests. JSON bodies; binary values in base64url without padding.

use std::sync::Arc;

use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
pub use confed_protocol::privacy_pass::issuer_api::{
    ChallengeResponse, Directory, TokenKey, TokenRequestBody, TokenResponseBody,
};
use confed_protocol::privacy_pass::{TOKEN_TYPE_BLIND_RSA, TokenRequest};

use crate::error::ApiError;
use crate::{IssueRequest, Issuer, Proof};

/// Largest request body: the largest Android evidence (10 certificates of 8 KiB: about 110 KB
/// in base64url) with 64 token requests of 346 base64url characters, and slack.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

pub const DEV_ATTESTER_WARNING: &str = "DEV ATTESTER: anyone can create device identities, so the per-device token limit bounds nothing; for tests and demos only";

/// The issuer's API with `/metrics`, `/healthz` and `/readyz` beside it.
pub fn router(issuer: Arc<Issuer>) -> Router {
    let ops = ops_router(&issuer);
    api_router(issuer).merge(ops)
}

/// `/metrics`, `/healthz` and `/readyz`: ready while the attester can take evidence (e.g. an
/// Android status list not stale).
pub fn ops_router(issuer: &Arc<Issuer>) -> Router {
    let probed = issuer.clone();
    let readiness: confed_ops::Readiness = Arc::new(move || {
        let why = probed.attester().unavailable(probed.now());
        Box::pin(async move { why.map_or(Ok(()), Err) })
    });
    confed_serving::ops::ops_router("issuer", readiness)
}

/// The issuer's API alone (with `--ops-listen`, the operator routes are served elsewhere).
pub fn api_router(issuer: Arc<Issuer>) -> Router {
    Router::new()
        .route("/v1/directory", get(directory))
        .route("/v1/challenge", post(challenge))
        .route("/v1/token-request", post(token_request))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(issuer)
}

pub fn directory_of(issuer: &Issuer) -> Directory {
    let key = issuer.signer().issuer_key();
    let insecure = issuer.attester().insecure();
    Directory {
        issuer_name: issuer.name().to_string(),
        issuer_request_uri: "/v1/token-request".into(),
        // Every key held (RFC 9578: a directory may list several), the first first.
        token_keys: issuer
            .signers()
            .map(|signer| TokenKey {
                token_type: TOKEN_TYPE_BLIND_RSA,
                token_key: URL_SAFE_NO_PAD.encode(signer.spki()),
            })
            .collect(),
        token_key_id: confed_protocol::hex::encode(key.token_key_id),
        tokens_per_window: issuer.tokens_per_window(),
        window_seconds: issuer.window_seconds(),
        attester: issuer.attester().format().into(),
        attesters: issuer
            .attester()
            .formats()
            .into_iter()
            .map(String::from)
            .collect(),
        warning: insecure.then(|| DEV_ATTESTER_WARNING.to_string()),
    }
}

async fn directory(State(issuer): State<Arc<Issuer>>) -> Json<Directory> {
    Json(directory_of(&issuer))
}

async fn challenge(State(issuer): State<Arc<Issuer>>) -> Response {
    match issuer.challenge() {
        Ok((challenge, expires_at)) => Json(ChallengeResponse {
            challenge: URL_SAFE_NO_PAD.encode(challenge),
            expires_at,
        })
        .into_response(),
        Err(error) => ApiError::from(error).into_response_at(issuer.now()),
    }
}

fn parse(body: TokenRequestBody) -> Result<IssueRequest, ApiError> {
    let base64 = |text: &str, field: &str| {
        URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| ApiError::bad_request(format!("{field} is not base64url (no padding)")))
    };
    let proof = match (body.challenge, body.evidence, body.credential) {
        (Some(challenge), Some(evidence), None) => Proof::Attested {
            challenge: base64(&challenge, "challenge")?,
            evidence,
        },
        (None, None, Some(credential)) => Proof::Credential(base64(&credential, "credential")?),
        _ => {
            return Err(ApiError::bad_request(
                "send either `challenge` and `evidence` (attest: POST /v1/challenge first) or the `credential` an earlier answer of this window gave",
            ));
        }
    };
    let token_requests = body
        .token_requests
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| {
                ApiError::bad_request(format!("token_requests[{i}] is not base64url (no padding)"))
            })?;
            TokenRequest::decode(&bytes)
                .map_err(|e| ApiError::bad_request(format!("token_requests[{i}]: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(IssueRequest {
        proof,
        token_requests,
    })
}

async fn token_request(
    State(issuer): State<Arc<Issuer>>,
    body: Result<Json<TokenRequestBody>, JsonRejection>,
) -> Response {
    let now = issuer.now();
    let request = match body.map_err(ApiError::from).and_then(|Json(b)| parse(b)) {
        Ok(request) => request,
        Err(error) => return error.into_response_at(now),
    };
    let worker = issuer.clone();
    // The grant is synced to disk and RSA signing takes milliseconds: off the async workers.
    let outcome = tokio::task::spawn_blocking(move || worker.issue(&request)).await;
    match outcome {
        Ok(Ok(issued)) => Json(TokenResponseBody {
            token_responses: issued
                .token_responses
                .iter()
                .map(|r| URL_SAFE_NO_PAD.encode(r.blind_sig))
                .collect(),
            remaining: issued.remaining,
            window_ends_at: issued.window_ends_at,
            credential: URL_SAFE_NO_PAD.encode(&issued.credential),
        })
        .into_response(),
        Ok(Err(error)) => {
            metrics::counter!("confed_issuer_refusals_total").increment(1);
            ApiError::from(error).into_response_at(issuer.now())
        }
        Err(join) => ApiError::from(crate::IssueError::Signing(join.to_string()))
            .into_response_at(issuer.now()),
    }
}
