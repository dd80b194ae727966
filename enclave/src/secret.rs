//! The worker token from Google Secret Manager, read with the enclave VM's own service account.
//!
//! Confidential Space puts every `tee-env-*` launch variable into the attestation token, which
//! every key service receives and logs, so a secret must not travel that way. The VM's operator
//! names the secret instead (`CONFED_WORKER_TOKEN_SECRET=projects/P/secrets/S/versions/V`, the
//! only token-related variable the launch policy allows); the enclave asks the GCE metadata
//! server for an access token of the VM's service account and reads the secret over HTTPS.
//! Only that service account may access the secret (deploy/gcp).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::Deserialize;
use thiserror::Error;
use zeroize::Zeroizing;

/// Where the VM's service account's access token comes from (GCE metadata server).
pub const METADATA_TOKEN_URL: &str =
    "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token";
pub const SECRET_MANAGER_URL: &str = "https://secretmanager.googleapis.com/v1";

#[derive(Debug, Error)]
pub enum SecretError {
    #[error(
        "secret name {0:?} must be projects/PROJECT/secrets/SECRET/versions/VERSION (letters, digits, - and _)"
    )]
    BadName(String),
    #[error("the metadata server gave no access token")]
    Metadata(#[source] reqwest::Error),
    #[error("Secret Manager refused or failed")]
    Access(#[source] reqwest::Error),
    #[error("the Secret Manager payload is not base64")]
    Payload(#[source] base64::DecodeError),
    #[error("the secret is empty or not UTF-8")]
    Empty,
}

/// A Secret Manager reader.
pub struct SecretManager {
    http: reqwest::Client,
    metadata_token_url: String,
    api: String,
}

#[derive(Deserialize)]
struct AccessToken {
    access_token: String,
}

#[derive(Deserialize)]
struct Accessed {
    payload: Payload,
}

#[derive(Deserialize)]
struct Payload {
    data: String,
}

fn valid_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('/').collect();
    parts.len() == 6
        && parts[0] == "projects"
        && parts[2] == "secrets"
        && parts[4] == "versions"
        && [parts[1], parts[3], parts[5]].iter().all(|p| {
            (1..=255).contains(&p.len())
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
        })
}

impl SecretManager {
    /// Google's endpoints (what `confed-enclave` uses; there is no flag to change them).
    pub fn google(http: reqwest::Client) -> Self {
        Self::with_endpoints(http, METADATA_TOKEN_URL, SECRET_MANAGER_URL)
    }

    /// Other endpoints of the same protocols (tests run fakes of both).
    pub fn with_endpoints(http: reqwest::Client, metadata_token_url: &str, api: &str) -> Self {
        Self {
            http,
            metadata_token_url: metadata_token_url.to_string(),
            api: api.trim_end_matches('/').to_string(),
        }
    }

    /// The secret version's payload, trimmed.
    pub async fn access(&self, name: &str) -> Result<Zeroizing<String>, SecretError> {
        if !valid_name(name) {
            return Err(SecretError::BadName(name.to_string()));
        }
        let token: AccessToken = self
            .http
            .get(&self.metadata_token_url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| SecretError::Metadata(e.without_url()))?
            .json()
            .await
            .map_err(|e| SecretError::Metadata(e.without_url()))?;
        let token = Zeroizing::new(token.access_token);
        let accessed: Accessed = self
            .http
            .get(format!("{}/{name}:access", self.api))
            .bearer_auth(token.as_str())
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| SecretError::Access(e.without_url()))?
            .json()
            .await
            .map_err(|e| SecretError::Access(e.without_url()))?;
        let bytes = Zeroizing::new(
            STANDARD
                .decode(&accessed.payload.data)
                .map_err(SecretError::Payload)?,
        );
        let text = std::str::from_utf8(&bytes).map_err(|_| SecretError::Empty)?;
        let trimmed = Zeroizing::new(text.trim().to_string());
        if trimmed.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(trimmed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names_are_checked() {
        assert!(valid_name(
            "projects/p-1/secrets/worker_token/versions/latest"
        ));
        assert!(valid_name("projects/123/secrets/s/versions/7"));
        for bad in [
            "projects/p/secrets/s",
            "projects/p/secrets/s/versions/1/extra",
            "projects/../secrets/s/versions/1",
            "projects/p/secrets/s?x=1/versions/1",
            "",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }
}
