//! Task assignment's selection policy, the service behind `POST /v1/populations/{p}/checkin`:
//! which of a population's collecting rounds a device may join (its tenant, its version and
//! attributes against each task's constraints), in which order (the least-filled round first,
//! then the earliest deadline: fair between tasks and so between tenants), under which key (the
//! round's, else the newest active one the key services signed), and the one-time capability and
//! upload target it gets. The handler only maps the outcome to HTTP.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::device::{AssignmentResponse, CheckinRequest, RetryWindow, ServedRound};
use thiserror::Error;

use crate::blob::{BlobError, BlobKey, BlobStore};
use crate::clock::{Millis, seconds_of};
use crate::db::device::{Candidate, Capability};
use crate::db::{Db, DbError};
use crate::keys::directory::KeyDirectory;
use crate::registry::{DeviceRegistry, Mismatch, fits};

/// Room above the model's size for the safetensors header of an update and the envelope.
pub const CONTRIBUTION_SLACK_BYTES: usize = 64 * 1024;

#[derive(Debug, Error)]
pub enum CheckinError {
    /// The request is outside the protocol's bounds (400), saying what to send.
    #[error(transparent)]
    Invalid(#[from] confed_protocol::device::InvalidCheckin),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
    #[error("no random bytes for a capability")]
    Random(#[from] crate::auth::AuthError),
}

/// Why nothing was assigned, with the window the device waits before it asks again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// No open task runs in the population.
    NoTask,
    /// Tasks run, but none of the tenant the device pinned.
    TenantMismatch,
    /// The device's attributes fit no task's constraints.
    ConstraintsNotMet,
    /// The device's client version fits no task.
    VersionMismatch,
    /// A fitting round has no key the key services signed (an operator problem).
    NoEncryptionKey,
    /// Every fitting round is full.
    RoundFull,
    /// Every fitting round with room is one the device says it would decline: it served that
    /// round, or one closer than the task's minimum separation (DP-FTRL).
    MinSeparation,
}

impl RetryReason {
    pub const ALL: [RetryReason; 7] = [
        Self::NoTask,
        Self::TenantMismatch,
        Self::ConstraintsNotMet,
        Self::VersionMismatch,
        Self::NoEncryptionKey,
        Self::RoundFull,
        Self::MinSeparation,
    ];

    /// The name devices and metrics see (`docs/protocol.md`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoTask => "no_task",
            Self::TenantMismatch => "tenant_mismatch",
            Self::ConstraintsNotMet => "constraints_not_met",
            Self::VersionMismatch => "version_mismatch",
            Self::NoEncryptionKey => "no_encryption_key",
            Self::RoundFull => "round_full",
            Self::MinSeparation => "min_separation",
        }
    }

    /// How long to wait: long when nothing will change soon (no task, another tenant's
    /// population, an old client), short when a slot or a key may appear any moment.
    pub fn window(self) -> RetryWindow {
        let (min_seconds, max_seconds) = match self {
            Self::NoTask => (300, 600),
            Self::TenantMismatch | Self::VersionMismatch => (3600, 7200),
            // The task must move on by a round or more before this device fits again.
            Self::ConstraintsNotMet | Self::MinSeparation => (600, 1200),
            Self::NoEncryptionKey | Self::RoundFull => (60, 120),
        };
        RetryWindow {
            min_seconds,
            max_seconds,
        }
    }
}

/// What a check-in comes to.
#[derive(Debug)]
pub enum CheckinOutcome {
    Assigned(Box<AssignmentResponse>),
    Retry(RetryReason),
}

impl CheckinOutcome {
    /// The `outcome` label of `confed_checkins_total`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Assigned(_) => "assigned",
            Self::Retry(reason) => reason.as_str(),
        }
    }
}

/// Whether a device that says it served `served` would decline a round of `candidate`: the
/// same round, or (DP-FTRL) one fewer than the task's minimum separation away.
fn would_decline(served: &[ServedRound], candidate: &Candidate) -> bool {
    let separation = u64::from(candidate.spec.privacy.mechanism().min_separation());
    served.iter().any(|s| {
        s.task_id == candidate.task_id && s.round.abs_diff(candidate.round_number) < separation
    })
}

/// The check-in service over the task database, the key directory, the contribution store and
/// the recent-devices registry (`AppState::checkin()` builds one per request).
pub struct Checkin<'a> {
    pub db: &'a Db,
    pub scheduling: crate::scheduling::SchedulingPolicy,
    pub keys: &'a KeyDirectory,
    pub contributions: &'a dyn BlobStore,
    pub registry: &'a DeviceRegistry,
}

impl Checkin<'_> {
    /// One check-in to `population` at `now`: the request checked against the protocol's bounds
    /// (`CheckinRequest::validate`), an assignment or a retry reason, and the device's public
    /// attributes recorded in the registry with the outcome.
    pub async fn check_in(
        &self,
        population: &str,
        request: CheckinRequest,
        now: Millis,
    ) -> Result<CheckinOutcome, CheckinError> {
        let version = request.validate(population)?;
        let outcome = self.assign(population, &version, &request, now).await?;
        self.registry.record(
            population,
            version,
            request.attributes,
            outcome.label(),
            now,
        );
        metrics::counter!("confed_checkins_total", "outcome" => outcome.label()).increment(1);
        Ok(outcome)
    }

    /// Assigns the device to a round of `population`, or says when to ask again. `version` is
    /// the parsed `client_version`; the request was validated by the caller.
    pub async fn assign(
        &self,
        population: &str,
        version: &[u32],
        request: &CheckinRequest,
        now: Millis,
    ) -> Result<CheckinOutcome, CheckinError> {
        let mut candidates = self.db.checkin_candidates(population).await?;
        if candidates.is_empty() {
            return Ok(CheckinOutcome::Retry(RetryReason::NoTask));
        }
        if let Some(pinned) = &request.tenant_id {
            candidates.retain(|c| &c.tenant_id == pinned);
            if candidates.is_empty() {
                return Ok(CheckinOutcome::Retry(RetryReason::TenantMismatch));
            }
        }
        let mut mismatches = Vec::new();
        let mut fitting: Vec<_> = candidates
            .into_iter()
            .filter(|c| match fits(&c.spec, version, &request.attributes) {
                Ok(()) => true,
                Err(why) => {
                    mismatches.push(why);
                    false
                }
            })
            .collect();
        if fitting.is_empty() {
            return Ok(CheckinOutcome::Retry(
                if mismatches.contains(&Mismatch::Constraints) {
                    RetryReason::ConstraintsNotMet
                } else {
                    RetryReason::VersionMismatch
                },
            ));
        }
        // The deployment's scheduling policy decides which fitting round is tried first.
        self.scheduling.order(&mut fitting);
        let now_seconds = seconds_of(now);
        let mut keyless = false;
        let mut separated = false;
        for candidate in fitting {
            let capacity = candidate.capacity;
            if candidate.live as u64 >= capacity {
                continue;
            }
            if would_decline(&request.served, &candidate) {
                separated = true;
                continue;
            }
            let key = match &candidate.key_id {
                Some(key_id) => self.keys.key(key_id),
                None => self.keys.current_key(now_seconds.0),
            };
            let Some(key) = key else {
                keyless = true;
                continue;
            };
            let capability =
                Capability::new(URL_SAFE_NO_PAD.encode(crate::auth::random_bytes::<32>()?));
            let timeout = Duration::from_secs(u64::from(candidate.spec.assignment_timeout_seconds));
            let expires_at = now.plus(timeout).0.min(candidate.deadline_at);
            let Some(assigned) = self
                .db
                .assign(
                    &candidate.round_id,
                    capacity,
                    &capability,
                    expires_at,
                    &key.key_id,
                )
                .await?
            else {
                continue;
            };
            // The round's key was fixed by an earlier check-in if it differs from the one we offered.
            let key = if assigned.key_id == key.key_id {
                key
            } else {
                match self.keys.key(&assigned.key_id) {
                    Some(key) => key,
                    None => continue,
                }
            };
            let max_contribution_bytes = contribution_limit(
                self.db
                    .model_of_task(&candidate.task_id, candidate.model_version)
                    .await?
                    .size_bytes,
                candidate.spec.masking.is_some(),
            );
            let (upload_url, upload_headers) = self
                .upload_target(
                    &candidate,
                    &capability,
                    Duration::from_millis((assigned.expires_at - now.0).max(1000) as u64),
                    max_contribution_bytes,
                )
                .await?;
            let policy = candidate
                .spec
                .policy(&candidate.task_id, &candidate.tenant_id)
                .encode();
            return Ok(CheckinOutcome::Assigned(Box::new(AssignmentResponse {
                model_url: format!("/v1/assignments/{}/model", capability.as_str()),
                upload_url,
                upload_headers,
                report_url: format!("/v1/assignments/{}/report", capability.as_str()),
                assignment_id: capability,
                task_id: candidate.task_id,
                round: candidate.round_number,
                expires_at: seconds_of(Millis(assigned.expires_at)).0,
                plan: candidate.spec.plan.clone(),
                policy,
                model_version: candidate.model_version,
                encryption: key,
                max_contribution_bytes,
                evaluate: candidate.on_demand_evaluation,
            })));
        }
        Ok(CheckinOutcome::Retry(if keyless {
            RetryReason::NoEncryptionKey
        } else if separated {
            RetryReason::MinSeparation
        } else {
            RetryReason::RoundFull
        }))
    }

    /// Where a device uploads its envelope: a signed URL of the blob store when it takes uploads
    /// directly (valid while the assignment is), else this server's upload route.
    async fn upload_target(
        &self,
        candidate: &Candidate,
        capability: &Capability,
        valid_for: Duration,
        max_bytes: u64,
    ) -> Result<(String, BTreeMap<String, String>), CheckinError> {
        if self.contributions.accepts_direct_uploads() {
            let key = BlobKey::contribution(
                &candidate.tenant_id,
                &candidate.task_id,
                candidate.round_number,
                candidate.attempt,
                &capability.reference(),
            )?;
            if let Some(direct) = self
                .contributions
                .direct_upload(&key, valid_for, max_bytes)
                .await?
            {
                return Ok((direct.url, direct.headers));
            }
        }
        Ok((
            format!("/v1/assignments/{}/contribution", capability.as_str()),
            BTreeMap::from([("content-type".into(), "application/cbor".into())]),
        ))
    }
}

/// Largest envelope accepted for a task whose model has `model_bytes` bytes; a masked task's
/// updates may be u64 on the grid (the ring of 2^64), twice the model's F32 bytes, so it allows
/// twice (in the ring of 2^32 they are the model's size: the limit is then generous, never short).
pub fn contribution_limit(model_bytes: i64, masked: bool) -> u64 {
    let model = model_bytes.max(0) as u64 * if masked { 2 } else { 1 };
    // Chunked sealing adds a 16-byte tag per chunk of at least 1 KiB: at most 1/64 more.
    model + model / 64 + CONTRIBUTION_SLACK_BYTES as u64
}
