//! Fetches an issuer's token-signing keys over HTTPS: the OpenID discovery document, then its
//! `jwks_uri`. Used by key services whose policy names a `discovery_url` (Google's issuer).

use std::time::Duration;

use confed_attestation::jwk::Jwks;
use confed_attestation::keys::{FetchFuture, JwksFetcher};

/// Discovery documents and key sets are small; refuse anything larger.
const MAX_DOCUMENT_BYTES: usize = 256 * 1024;

#[derive(Debug, Clone)]
pub struct HttpJwksFetcher {
    client: reqwest::Client,
}

impl HttpJwksFetcher {
    pub fn new() -> Result<Self, String> {
        Ok(Self {
            client: confed_enclave::http::client(Duration::from_secs(10)),
        })
    }

    async fn get_json(&self, url: &str) -> Result<serde_json::Value, String> {
        let response = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("{url} answered {}", response.status()));
        }
        let bytes = response.bytes().await.map_err(|e| e.to_string())?;
        if bytes.len() > MAX_DOCUMENT_BYTES {
            return Err(format!(
                "{url} answered more than {MAX_DOCUMENT_BYTES} bytes"
            ));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("{url} is not JSON: {e}"))
    }

    async fn fetch_keys(&self, discovery_url: &str) -> Result<Jwks, String> {
        let discovery = self.get_json(discovery_url).await?;
        let jwks_uri = discovery
            .get("jwks_uri")
            .and_then(|v| v.as_str())
            .ok_or_else(|| format!("{discovery_url} has no jwks_uri"))?
            .to_string();
        let jwks = self.get_json(&jwks_uri).await?;
        Jwks::from_json(&jwks.to_string()).map_err(|e| e.to_string())
    }
}

impl JwksFetcher for HttpJwksFetcher {
    fn fetch<'a>(&'a self, discovery_url: &'a str) -> FetchFuture<'a> {
        Box::pin(self.fetch_keys(discovery_url))
    }
}
