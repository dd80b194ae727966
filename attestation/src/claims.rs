//! The claim structure of a Confidential Space attestation token, for the dev attester and for
//! generating good and bad test tokens. Appraisal reads claims from JSON directly (`appraise.rs`),
//! so a token with unexpected shapes is refused check by check rather than failing to parse.

use serde_json::{Value, json};

/// Claims of a Confidential Space token; every field can be changed to build a bad one.
#[derive(Debug, Clone)]
pub struct TokenClaims {
    pub iss: String,
    pub aud: Value,
    pub iat: i64,
    pub nbf: i64,
    pub exp: i64,
    pub eat_nonce: Vec<String>,
    pub swname: String,
    pub swversion: Vec<String>,
    pub dbgstat: String,
    pub hwmodel: String,
    pub secboot: bool,
    pub support_attributes: Vec<String>,
    pub image_digest: Option<String>,
    pub image_reference: String,
    pub cmd_override: Option<Vec<String>>,
    pub env_override: Option<Value>,
    pub project_id: String,
    pub service_accounts: Vec<String>,
}

impl TokenClaims {
    /// A token like Google issues for a healthy workload, valid for an hour from `now`.
    pub fn confidential_space(issuer: &str, audience: &str, nonces: Vec<String>, now: i64) -> Self {
        Self {
            iss: issuer.to_string(),
            aud: Value::String(audience.to_string()),
            iat: now,
            nbf: now,
            exp: now + 3600,
            eat_nonce: nonces,
            swname: "CONFIDENTIAL_SPACE".into(),
            swversion: vec!["250301".into()],
            dbgstat: "disabled-since-boot".into(),
            hwmodel: "GCP_AMD_SEV".into(),
            secboot: true,
            support_attributes: vec!["LATEST".into(), "STABLE".into(), "USABLE".into()],
            image_digest: None,
            image_reference: "us-docker.pkg.dev/example/confed/confed-enclave@sha256".into(),
            cmd_override: None,
            env_override: None,
            project_id: "confed-example".into(),
            service_accounts: vec!["enclave@confed-example.iam.gserviceaccount.com".into()],
        }
    }

    pub fn to_json(&self) -> Value {
        let mut container = json!({
            "image_reference": self.image_reference,
            "restart_policy": "Never",
        });
        if let Some(digest) = &self.image_digest {
            container["image_digest"] = json!(digest);
        }
        if let Some(cmd) = &self.cmd_override {
            container["cmd_override"] = json!(cmd);
        }
        if let Some(env) = &self.env_override {
            container["env_override"] = env.clone();
        }
        json!({
            "iss": self.iss,
            "aud": self.aud,
            "sub": format!("https://www.googleapis.com/compute/v1/projects/{}/zones/us-central1-a/instances/enclave-0", self.project_id),
            "iat": self.iat,
            "nbf": self.nbf,
            "exp": self.exp,
            "eat_nonce": self.eat_nonce,
            "eat_profile": "https://cloud.google.com/confidential-computing/confidential-space/docs/reference/token-claims",
            "secboot": self.secboot,
            "oemid": 11129,
            "hwmodel": self.hwmodel,
            "swname": self.swname,
            "swversion": self.swversion,
            "dbgstat": self.dbgstat,
            "submods": {
                "confidential_space": {"support_attributes": self.support_attributes},
                "container": container,
                "gce": {"project_id": self.project_id, "zone": "us-central1-a", "instance_name": "enclave-0"},
            },
            "google_service_accounts": self.service_accounts,
        })
    }
}
