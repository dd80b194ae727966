//! The front end's check of device tokens at upload (`docs/protocol.md`, "Device tokens"): a task
//! whose policy requires them stores only uploads whose envelope carries a token that verifies
//! for its assignment, so an outsider's flood costs one signature check and no storage. The
//! enclave checks again (it trusts nothing the front end decided); this check only saves work.
//! Nothing is kept: the token stays inside the stored envelope, and no value the issuer knows
//! appears in it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::device_auth::{DeviceAuth, TokenRefusal};
use confed_protocol::privacy_pass::context::encoded_round_challenge;

use super::UploadError;
use crate::db::Db;
use crate::db::device::AssignmentView;
use confed_protocol::envelope::Envelope;

/// Tasks whose requirement is remembered at most (a task's definition never changes, so an entry
/// is never stale; past this the map starts over).
const CACHED_TASKS: usize = 10_000;

/// A task's device-token requirement: the policy's issuer and keys, and a masked task's layout
/// (its tokens' nonces bind the envelope's sealed seeds too: docs/secure-aggregation.md).
#[derive(Debug)]
pub struct TokenRequirement {
    pub auth: DeviceAuth,
    pub masking: Option<confed_protocol::masking::Layout>,
}

/// Each task's device-token requirement, read once from its definition.
#[derive(Debug, Clone, Default)]
pub struct DeviceAuthCache(Arc<Mutex<HashMap<String, Option<Arc<TokenRequirement>>>>>);

impl DeviceAuthCache {
    async fn of(
        &self,
        db: &Db,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Option<Arc<TokenRequirement>>, UploadError> {
        if let Some(known) = self.0.lock().ok().and_then(|m| m.get(task_id).cloned()) {
            return Ok(known);
        }
        let task = db.task(tenant_id, task_id).await?;
        let masking = task
            .spec
            .masking
            .as_deref()
            .and_then(|line| confed_protocol::policy::MaskingPolicy::parse(line).ok())
            .map(|m| m.layout());
        let auth = task
            .spec
            .device_auth
            .as_ref()
            .and_then(|spec| spec.policy())
            .map(|auth| Arc::new(TokenRequirement { auth, masking }));
        if let Ok(mut map) = self.0.lock() {
            if map.len() >= CACHED_TASKS {
                map.clear();
            }
            map.insert(task_id.to_string(), auth.clone());
        }
        Ok(auth)
    }

    /// The device-token requirement of `assignment`'s task, if it has one.
    pub async fn requirement(
        &self,
        db: &Db,
        assignment: &AssignmentView,
    ) -> Result<Option<Arc<TokenRequirement>>, UploadError> {
        self.of(db, &assignment.tenant_id, &assignment.task_id)
            .await
    }

    /// Refuses an upload for `assignment` whose envelope's token does not authenticate it; the
    /// task's requirement, if it has one.
    pub async fn check_upload(
        &self,
        db: &Db,
        assignment: &AssignmentView,
        envelope: &Envelope,
    ) -> Result<Option<Arc<TokenRequirement>>, UploadError> {
        let Some(auth) = self
            .of(db, &assignment.tenant_id, &assignment.task_id)
            .await?
        else {
            return Ok(None);
        };
        let round = u64::try_from(assignment.round_number).unwrap_or(0);
        let outcome = super::verify_token(
            &auth,
            assignment,
            envelope.token.as_deref(),
            &envelope.encapsulated_key,
            envelope.seeds.as_deref(),
        );
        match outcome {
            Ok(()) => Ok(Some(auth)),
            Err(refusal) => Err(match refusal {
                TokenRefusal::Missing(_) => UploadError::TokenRequired {
                    detail: refusal.to_string(),
                    www_authenticate: challenge_header(
                        &auth.auth,
                        &assignment.task_id,
                        round,
                        assignment.id.as_str(),
                    ),
                },
                other => UploadError::TokenRefused(other.to_string()),
            }),
        }
    }
}

/// `PrivateToken challenge="<base64url TokenChallenge>", token-key="<base64url SPKI>"` (RFC 9577,
/// section 2.1) for the assignment, under the policy's first key.
fn challenge_header(auth: &DeviceAuth, task_id: &str, round: u64, assignment_ref: &str) -> String {
    let challenge = encoded_round_challenge(&auth.issuer, task_id, round, assignment_ref)
        .map(|c| URL_SAFE_NO_PAD.encode(c))
        .unwrap_or_default();
    let key = auth
        .token_keys
        .first()
        .map(|k| URL_SAFE_NO_PAD.encode(k))
        .unwrap_or_default();
    format!("PrivateToken challenge=\"{challenge}\", token-key=\"{key}\"")
}
