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
            client: confed_protocol::http::client(Duration::from_secs(10)),
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
        // The keys that decide every release come over TLS. (Plain http is accepted only when
        // the discovery document itself came from this machine: a test issuer. The appraisal
        // policy requires an https discovery URL, so production never gets here with http.)
        check_jwks_uri(discovery_url, &jwks_uri)?;
        let jwks = self.get_json(&jwks_uri).await?;
        Jwks::from_json(&jwks.to_string()).map_err(|e| e.to_string())
    }
}

fn check_jwks_uri(discovery_url: &str, jwks_uri: &str) -> Result<(), String> {
    let loopback_http = |url: &str| {
        ["http://127.0.0.1:", "http://[::1]:", "http://localhost:"]
            .iter()
            .any(|prefix| url.starts_with(prefix))
    };
    if jwks_uri.starts_with("https://") || (loopback_http(discovery_url) && loopback_http(jwks_uri))
    {
        Ok(())
    } else {
        Err(format!(
            "{discovery_url} names jwks_uri {jwks_uri:?}, which is not https; refusing to fetch signing keys without TLS"
        ))
    }
}

impl JwksFetcher for HttpJwksFetcher {
    fn fetch<'a>(&'a self, discovery_url: &'a str) -> FetchFuture<'a> {
        Box::pin(self.fetch_keys(discovery_url))
    }
}

#[cfg(test)]
mod tests {
    use super::check_jwks_uri;

    /// `jwks_uri` may be plain http only for a test issuer on this machine.
    #[test]
    fn a_plain_http_jwks_uri_is_refused() {
        let google =
            "https://confidentialcomputing.googleapis.com/.well-known/openid-configuration";
        assert!(check_jwks_uri(google, "https://www.googleapis.com/keys").is_ok());
        let refused = check_jwks_uri(google, "http://www.googleapis.com/keys").unwrap_err();
        assert!(refused.contains("not https"), "{refused}");
        assert!(check_jwks_uri(google, "http://127.0.0.1:9/keys").is_err());
        assert!(check_jwks_uri("http://127.0.0.1:8/d", "http://127.0.0.1:8/keys").is_ok());
        assert!(check_jwks_uri("http://127.0.0.1:8/d", "http://evil.example/keys").is_err());
    }
}
