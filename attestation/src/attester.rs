//! Attesters produce evidence: an attestation token for an audience with nonces. The Confidential
//! Space attester asks the launcher over its unix socket; the dev attester (`dev.rs`) signs tokens
//! itself and protects nothing.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use thiserror::Error;

/// The launcher's token endpoint inside a Confidential Space VM.
pub const LAUNCHER_SOCKET: &str = "/run/container_launcher/teeserver.sock";
/// Confidential Space accepts at most 6 nonces of 10-74 bytes each.
pub const MAX_NONCES: usize = 6;

#[derive(Debug, Error)]
pub enum AttestError {
    #[error("cannot reach the attestation service at {path}")]
    Unreachable {
        path: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("the attestation service refused the token request ({status}): {body}")]
    Refused { status: u16, body: String },
    #[error("invalid token request: {0}")]
    InvalidRequest(String),
}

/// What the enclave asks its attester for.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TokenRequest {
    pub audience: String,
    pub nonces: Vec<String>,
}

impl TokenRequest {
    pub fn check(&self) -> Result<(), AttestError> {
        if self.nonces.is_empty() || self.nonces.len() > MAX_NONCES {
            return Err(AttestError::InvalidRequest(format!(
                "1-{MAX_NONCES} nonces are allowed, got {}",
                self.nonces.len()
            )));
        }
        if let Some(bad) = self.nonces.iter().find(|n| !(10..=74).contains(&n.len())) {
            return Err(AttestError::InvalidRequest(format!(
                "nonce {bad:?} must be 10-74 bytes"
            )));
        }
        Ok(())
    }
}

pub type TokenFuture<'a> = Pin<Box<dyn Future<Output = Result<String, AttestError>> + Send + 'a>>;

pub trait Attester: Send + Sync + std::fmt::Debug {
    fn token<'a>(&'a self, request: &'a TokenRequest) -> TokenFuture<'a>;
}

/// Requests OIDC tokens from the Confidential Space launcher (`POST /v1/token` on a unix socket).
#[derive(Debug, Clone)]
pub struct ConfidentialSpaceAttester {
    socket: PathBuf,
}

impl ConfidentialSpaceAttester {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
        }
    }

    async fn request(&self, request: &TokenRequest) -> Result<String, AttestError> {
        request.check()?;
        let path = self.socket.display().to_string();
        let unreachable =
            |source: Box<dyn std::error::Error + Send + Sync>| AttestError::Unreachable {
                path: path.clone(),
                source,
            };
        let stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|e| unreachable(e.into()))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.into()))?;
        tokio::spawn(connection);
        let body = serde_json::json!({
            "audience": request.audience,
            "token_type": "OIDC",
            "nonces": request.nonces,
        });
        let http_request = hyper::Request::post("/v1/token")
            .header(hyper::header::HOST, "localhost")
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| unreachable(e.into()))?;
        let response = sender
            .send_request(http_request)
            .await
            .map_err(|e| unreachable(e.into()))?;
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(e.into()))?
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes).trim().to_string();
        if status != 200 {
            return Err(AttestError::Refused { status, body: text });
        }
        Ok(text)
    }
}

impl Attester for ConfidentialSpaceAttester {
    fn token<'a>(&'a self, request: &'a TokenRequest) -> TokenFuture<'a> {
        Box::pin(self.request(request))
    }
}
