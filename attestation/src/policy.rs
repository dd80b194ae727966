//! The appraisal policy: a reviewable TOML file per key service operator (`policies/*.toml`),
//! documented in `docs/attestation.md`. Unknown keys are errors, so a typo cannot silently weaken
//! a policy; everything the policy does not allow is denied.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use crate::jws::Algorithm;

#[derive(Debug, Error)]
pub enum PolicyError {
    #[error("cannot read policy {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("policy {path} is invalid: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppraisalPolicy {
    /// A name for logs and audit records.
    pub name: String,
    pub token: TokenPolicy,
    pub platform: PlatformPolicy,
    pub workload: WorkloadPolicy,
}

/// Where tokens come from and how they are signed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenPolicy {
    /// Exact `iss` required.
    pub issuer: String,
    /// The only signature algorithm accepted (`RS256` or `ES256`); the token header never chooses.
    pub algorithm: Algorithm,
    /// Verification keys from a JWKS file (relative paths are relative to the policy file)...
    #[serde(default)]
    pub jwks_file: Option<PathBuf>,
    /// ...or from the issuer's OpenID discovery document (cached; refetched on an unknown `kid`).
    #[serde(default)]
    pub discovery_url: Option<String>,
    /// Tolerance for `nbf`, `exp` and `iat`, at most 300 s.
    pub max_clock_skew_seconds: u32,
    /// Oldest `iat` accepted, relative to the verification time.
    pub max_token_age_seconds: u32,
}

/// What the TEE platform must be.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlatformPolicy {
    /// Required `swname` (`CONFIDENTIAL_SPACE`).
    pub swname: String,
    /// Required `dbgstat` (`disabled-since-boot`).
    pub dbgstat: String,
    /// Accepted `hwmodel` values (e.g. `GCP_AMD_SEV`, `GCP_INTEL_TDX`).
    pub hardware_models: Vec<String>,
    /// Require `secboot == true`.
    pub require_secure_boot: bool,
    /// A value `submods.confidential_space.support_attributes` must contain (e.g. `STABLE`).
    #[serde(default)]
    pub support_attribute: Option<String>,
    /// Lowest accepted `swversion` (every listed version must be at least this).
    pub min_swversion: u64,
}

/// What workload may receive shares.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadPolicy {
    /// Allowed `submods.container.image_digest` values (`sha256:<64 hex>`). Empty allows none.
    pub image_digests: Vec<String>,
    /// If non-empty, `google_service_accounts` must contain one of these.
    #[serde(default)]
    pub service_accounts: Vec<String>,
    /// If non-empty, `submods.gce.project_id` must be one of these.
    #[serde(default)]
    pub project_ids: Vec<String>,
    /// Whether the operator of the VM may override the container's command.
    #[serde(default)]
    pub allow_cmd_override: bool,
    /// Environment variables the operator may override; any other override is refused.
    #[serde(default)]
    pub allowed_env_overrides: Vec<String>,
}

pub const MAX_CLOCK_SKEW_SECONDS: u32 = 300;

impl AppraisalPolicy {
    /// Reads and checks a policy file; a relative `jwks_file` is resolved against its directory.
    pub fn load(path: &Path) -> Result<Self, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut policy = Self::from_toml(&text).map_err(|reason| PolicyError::Invalid {
            path: path.to_path_buf(),
            reason,
        })?;
        if let Some(file) = &policy.token.jwks_file
            && file.is_relative()
        {
            let base = path.parent().unwrap_or(Path::new("."));
            policy.token.jwks_file = Some(base.join(file));
        }
        Ok(policy)
    }

    pub fn from_toml(text: &str) -> Result<Self, String> {
        let policy: Self = toml::from_str(text).map_err(|e| e.to_string())?;
        policy.check()?;
        Ok(policy)
    }

    fn check(&self) -> Result<(), String> {
        let token = &self.token;
        if token.jwks_file.is_some() == token.discovery_url.is_some() {
            return Err("set exactly one of token.jwks_file and token.discovery_url".into());
        }
        if let Some(url) = &token.discovery_url
            && !url.starts_with("https://")
        {
            return Err("token.discovery_url must be https".into());
        }
        if token.max_clock_skew_seconds > MAX_CLOCK_SKEW_SECONDS {
            return Err(format!(
                "token.max_clock_skew_seconds must be at most {MAX_CLOCK_SKEW_SECONDS}"
            ));
        }
        if token.max_token_age_seconds == 0 {
            return Err("token.max_token_age_seconds must be positive".into());
        }
        if token.issuer.is_empty() {
            return Err("token.issuer must not be empty".into());
        }
        if self.platform.hardware_models.is_empty() {
            return Err("platform.hardware_models must list at least one model".into());
        }
        let workload = &self.workload;
        if !workload.image_digests.is_empty()
            && (workload.project_ids.is_empty() || workload.service_accounts.is_empty())
        {
            return Err(
                "a policy that allows an image digest must also list workload.project_ids and workload.service_accounts: the public image started in someone else's project, under their service account, must not obtain shares"
                    .into(),
            );
        }
        for digest in &self.workload.image_digests {
            let hex = digest.strip_prefix("sha256:").unwrap_or("");
            if !confed_protocol::hex::is_digest_hex(hex) {
                return Err(format!(
                    "workload.image_digests entry {digest:?} is not `sha256:` and 64 lowercase hex digits (never a tag)"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        name = "t"
        [token]
        issuer = "https://issuer.example"
        algorithm = "RS256"
        jwks_file = "keys.json"
        max_clock_skew_seconds = 30
        max_token_age_seconds = 600
        [platform]
        swname = "CONFIDENTIAL_SPACE"
        dbgstat = "disabled-since-boot"
        hardware_models = ["GCP_AMD_SEV"]
        require_secure_boot = true
        support_attribute = "STABLE"
        min_swversion = 1
        [workload]
        image_digests = ["sha256:0000000000000000000000000000000000000000000000000000000000000000"]
        project_ids = ["confed-example"]
        service_accounts = ["enclave@confed-example.iam.gserviceaccount.com"]
    "#;

    #[test]
    fn a_complete_policy_loads() {
        let policy = AppraisalPolicy::from_toml(GOOD).unwrap();
        assert_eq!(policy.token.algorithm, Algorithm::RS256);
        assert!(!policy.workload.allow_cmd_override);
    }

    #[test]
    fn dangerous_or_sloppy_policies_are_refused() {
        let cases = [
            ("algorithm = \"RS256\"", "algorithm = \"none\""),
            ("algorithm = \"RS256\"", "algorithm = \"HS256\""),
            ("name = \"t\"", "name = \"t\"\nvalidate_aud = false"),
            (
                "max_clock_skew_seconds = 30",
                "max_clock_skew_seconds = 3000",
            ),
            (
                "jwks_file = \"keys.json\"",
                "discovery_url = \"http://plain.example\"",
            ),
            (
                "jwks_file = \"keys.json\"",
                "jwks_file = \"keys.json\"\ndiscovery_url = \"https://x.example\"",
            ),
            (
                "sha256:0000000000000000000000000000000000000000000000000000000000000000",
                "latest",
            ),
            (
                "hardware_models = [\"GCP_AMD_SEV\"]",
                "hardware_models = []",
            ),
            ("project_ids = [\"confed-example\"]", "project_ids = []"),
            (
                "service_accounts = [\"enclave@confed-example.iam.gserviceaccount.com\"]",
                "",
            ),
        ];
        for (from, to) in cases {
            let text = GOOD.replace(from, to);
            assert!(AppraisalPolicy::from_toml(&text).is_err(), "accepted: {to}");
        }
    }
}
