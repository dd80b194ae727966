//! A task's device-authentication requirement as the partner gives it: the token issuer and its
//! token keys, copied from the issuer's directory (`GET /v1/directory`). It goes into the task
//! policy devices bind (`confed_protocol::device_auth`), so neither the operator nor anyone else
//! can drop or swap it after creation.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::device_auth::DeviceAuth;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::problems::Problems;

/// Device tokens every counted contribution must carry (docs/protocol.md, "Device tokens").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceAuthSpec {
    /// The issuer's name, as its directory states it (1-128 of `A-Z a-z 0-9 . _ -`).
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub issuer: String,
    /// 1-4 token keys (base64url DER SubjectPublicKeyInfo, RSASSA-PSS), as the issuer's directory
    /// lists them under `token-keys`.
    pub token_keys: Vec<String>,
}

impl DeviceAuthSpec {
    /// The policy's requirement; `None` (with the problem noted) if it is not one.
    pub(super) fn validate(&self, p: &mut Problems) -> Option<DeviceAuth> {
        let keys: Result<Vec<Vec<u8>>, String> = self
            .token_keys
            .iter()
            .map(|k| {
                URL_SAFE_NO_PAD
                    .decode(k)
                    .map_err(|_| "token_keys: each must be base64url without padding".to_string())
            })
            .collect();
        match keys.and_then(|keys| DeviceAuth::new(&self.issuer, keys)) {
            Ok(auth) => Some(auth),
            Err(why) => {
                p.add("device_auth", why);
                None
            }
        }
    }

    /// The requirement of a stored (already validated) spec.
    pub fn policy(&self) -> Option<DeviceAuth> {
        self.validate(&mut Problems::default())
    }
}
