//! The contribution upload as a service, beside check-in (`checkin.rs`): the rules of
//! `PUT /v1/assignments/{id}/contribution` without HTTP. The handler reads the request, calls
//! these steps in order and maps their errors; everything that can refuse an upload is decided
//! before a byte of the body is read, and the bytes are durable before the row that refers to
//! them is written.

pub mod device_tokens;
pub mod mask_prepare;

use confed_protocol::device::ReportOutcome;
use confed_protocol::envelope::{Envelope, EnvelopeError};
use confed_protocol::envelope_scan::{self, EnvelopeHeader, HEAD_BYTES, Scan, TAIL_BYTES};
use thiserror::Error;

use crate::blob::{BlobError, BlobKey, BlobStore};
use crate::checkin::contribution_limit;
use crate::clock::Millis;
use crate::db::device::{AssignmentView, Capability, Refusal, Stored, UploadDigests};
use crate::db::{Db, DbError};
use crate::keys::KeyState;
use crate::keys::directory::KeyDirectory;
use crate::states::AssignmentState;

/// How an upload through the server is named for idempotency: `blake3:<hex>`, the BLAKE3 the
/// round's job lists anyway (one hash per upload).
const BLAKE3_PREFIX: &str = "blake3:";

#[derive(Debug, Error)]
pub enum UploadError {
    #[error("{0:?}")]
    Refused(Refusal),
    #[error("the envelope is {size} bytes; this task accepts at most {limit}")]
    TooLarge { size: String, limit: u64 },
    #[error("{0}")]
    Malformed(String),
    #[error("{0}")]
    WrongKey(String),
    /// An object uploaded straight to the blob store that is empty or over the limit.
    #[error("the uploaded contribution is {size} bytes; this task accepts 1 to {limit}")]
    DirectUploadSize { size: u64, limit: u64 },
    /// A direct upload whose envelope's device token does not authenticate it for its
    /// assignment (a task that requires device tokens): refused before it counts.
    #[error(
        "the uploaded contribution does not count: {0}; the task requires a device token for this assignment in the envelope"
    )]
    Unauthenticated(String),
    /// An upload through the server without the device token its task requires; the challenge
    /// is the `WWW-Authenticate` value naming the issuer and key (RFC 9577).
    #[error("{detail}")]
    TokenRequired {
        detail: String,
        www_authenticate: String,
    },
    /// An upload through the server whose token does not authenticate its assignment.
    #[error("{0}")]
    TokenRefused(String),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
}

/// An assignment that may take an upload, and the most bytes it takes.
#[derive(Debug)]
pub struct Admitted {
    pub assignment: AssignmentView,
    pub limit: u64,
}

/// The upload service over the task database, the key directory and the contribution store.
pub struct Uploads<'a> {
    pub db: &'a Db,
    pub keys: &'a KeyDirectory,
    pub contributions: &'a dyn BlobStore,
    /// Hands a masked round's new uploads to the key services ahead (`mask_prepare.rs`).
    pub preparer: &'a mask_prepare::MaskPreparer,
}

impl Uploads<'_> {
    /// The assignment `capability` names (404 otherwise).
    pub async fn find(&self, capability: &Capability) -> Result<AssignmentView, UploadError> {
        self.db
            .assignment(capability)
            .await?
            .ok_or(UploadError::Refused(Refusal::UnknownAssignment))
    }

    /// Whether `assignment` takes an upload of `declared` bytes (the Content-Length, if any)
    /// at `now`: within the task's limit and, unless it already holds a contribution (a retry
    /// is answered by `store`), still open. A contribution for a closed round is counted late.
    pub async fn admit(
        &self,
        assignment: AssignmentView,
        declared: Option<u64>,
        masked: bool,
        now: Millis,
    ) -> Result<Admitted, UploadError> {
        let limit = contribution_limit(assignment.model_bytes, masked);
        if let Some(declared) = declared
            && declared > limit
        {
            return Err(UploadError::TooLarge {
                size: declared.to_string(),
                limit,
            });
        }
        if assignment.contribution_digest.is_none()
            && let Some(closed) = closed_for_upload(&assignment, now.0)
        {
            if closed == Refusal::RoundClosed {
                self.count_late(&assignment.id).await;
            }
            return Err(UploadError::Refused(closed));
        }
        Ok(Admitted { assignment, limit })
    }

    /// The envelope in `body`, sealed to the round's key, which is active at `now`.
    pub fn open_envelope(
        &self,
        admitted: &Admitted,
        body: &[u8],
        now: Millis,
    ) -> Result<Envelope, UploadError> {
        let parsed =
            Envelope::from_cbor(body).map_err(|e| UploadError::Malformed(e.to_string()))?;
        let round_key = admitted.assignment.key_id.as_deref().unwrap_or("");
        if parsed.key_id != round_key {
            return Err(UploadError::WrongKey(format!(
                "key id {:?} is not this round's key {round_key:?}; seal to the key in the assignment",
                parsed.key_id
            )));
        }
        match self.keys.key(round_key) {
            Some(key)
                if KeyState::at(key.not_before, key.not_after, now.seconds().0)
                    != KeyState::Pending =>
            {
                Ok(parsed)
            }
            _ => Err(UploadError::WrongKey(format!(
                "key {round_key:?} is unknown or not active"
            ))),
        }
    }

    /// Stores `body` durably and records it against the assignment: `Stored::New` the first
    /// time, `Stored::Again` for the same bytes again; different bytes are refused.
    pub async fn store(
        &self,
        capability: &Capability,
        admitted: &Admitted,
        body: &[u8],
    ) -> Result<Stored, UploadError> {
        let assignment = &admitted.assignment;
        // The one digest of an upload, computed here: the round's job lists it (so the enclave
        // commits to its inputs without a first read, and checks the bytes against it as it
        // opens them), and it makes a repeated upload idempotent.
        let blake3_hex = blake3::hash(body).to_hex();
        let digest = format!("{BLAKE3_PREFIX}{blake3_hex}");
        // An assignment that already holds a contribution stores nothing more: the same bytes
        // again are a retry, others are refused. Appending first would let one capability write
        // the task's limit to disk again and again, even after its round closed.
        if let Some(held) = &assignment.contribution_digest {
            return if same_bytes(held, &digest, body) {
                Ok(Stored::Again)
            } else {
                Err(UploadError::Refused(Refusal::DifferentBytes))
            };
        }
        let key = view_contribution_key(assignment)?;
        // The bytes are durable before the row that refers to them is written.
        let stored = match self.contributions.put_new(key, body).await {
            Ok(stored) => stored,
            Err(BlobError::Conflict(_)) => {
                return Err(UploadError::Refused(Refusal::DifferentBytes));
            }
            Err(other) => return Err(other.into()),
        };
        let recorded = self
            .db
            .record_upload(
                capability,
                UploadDigests {
                    idempotency: &digest,
                    blake3_hex: Some(blake3_hex.as_str()),
                },
                body.len() as i64,
                stored.as_str(),
            )
            .await?
            .map_err(UploadError::Refused)?;
        if recorded == Stored::New {
            metrics::counter!("confed_contributions_total", "outcome" => "stored").increment(1);
        }
        Ok(recorded)
    }

    /// A device that uploaded straight to the blob store reports completion: the object must be
    /// there and within the task's size limit, and is recorded like an upload through the
    /// server (ASSIGNED -> UPLOADED). Nothing is listed; one metadata read.
    pub async fn note_direct_upload(
        &self,
        capability: &Capability,
        assignment: AssignmentView,
        device_auth: Option<&device_tokens::TokenRequirement>,
        now: Millis,
    ) -> Result<(), UploadError> {
        if assignment.contribution_digest.is_some() || assignment.state != AssignmentState::Assigned
        {
            return Ok(()); // already noted, or finished: the report itself says what applies
        }
        if let Some(closed) = closed_for_upload(&assignment, now.0) {
            if closed == Refusal::RoundClosed {
                self.count_late(&assignment.id).await;
            }
            return Err(UploadError::Refused(closed));
        }
        let key = view_contribution_key(&assignment)?;
        let Some(object) = self.contributions.stat(&key).await? else {
            return Err(UploadError::Refused(Refusal::NotUploaded));
        };
        let masked = device_auth.is_some_and(|r| r.masking.is_some());
        let limit = contribution_limit(assignment.model_bytes, masked);
        if object.size > limit || object.size == 0 {
            return Err(UploadError::DirectUploadSize {
                size: object.size,
                limit,
            });
        }
        // Nothing counts before its token is checked, as on the upload through the server. The
        // object is create-only, so what is checked here is what a job will read.
        let mut checked_header = None;
        if let Some(auth) = device_auth {
            let header = self.direct_upload_header(&key, object.size).await?;
            if let Err(refusal) = verify_token(
                auth,
                &assignment,
                header.token.as_deref(),
                &header.encapsulated_key,
                header.seeds.as_deref(),
            ) {
                if let Err(error) = self.contributions.discard(&key).await {
                    tracing::warn!(%error, "could not remove an unauthenticated direct upload");
                }
                return Err(UploadError::Unauthenticated(refusal.to_string()));
            }
            checked_header = Some(header);
        }
        let recorded = self
            .db
            .record_upload(
                capability,
                UploadDigests {
                    idempotency: &object.digest,
                    blake3_hex: None,
                },
                object.size as i64,
                key.as_str(),
            )
            .await?
            .map_err(UploadError::Refused)?;
        if recorded == Stored::New {
            metrics::counter!("confed_contributions_total", "outcome" => "stored_direct")
                .increment(1);
            if let (Some(auth), Some(header)) = (device_auth, &checked_header) {
                self.offer_to_prepare(
                    &assignment,
                    auth,
                    (
                        &header.encapsulated_key,
                        header.token.as_deref(),
                        header.seeds.as_deref(),
                    ),
                );
            }
        }
        Ok(())
    }

    /// A direct upload's envelope fields but its ciphertext, from two bounded reads of the stored
    /// object made at once (`envelope_scan`: its first 4 KiB, and its last 4 KiB, which hold
    /// whatever follows the ciphertext): one round trip to the blob store, not two in a row.
    async fn direct_upload_header(
        &self,
        key: &BlobKey,
        size: u64,
    ) -> Result<EnvelopeHeader, UploadError> {
        let malformed = |e: EnvelopeError| {
            UploadError::Malformed(format!(
                "the uploaded object is not a contribution envelope: {e}"
            ))
        };
        let tail_start = size.saturating_sub(TAIL_BYTES).max(HEAD_BYTES.min(size));
        let (head, tail) = if tail_start >= size {
            // The head holds the whole object.
            (
                self.contributions.get_range(key, 0, size).await?,
                Vec::new(),
            )
        } else {
            tokio::try_join!(
                self.contributions.get_range(key, 0, HEAD_BYTES),
                self.contributions
                    .get_range(key, tail_start, size - tail_start),
            )?
        };
        match envelope_scan::scan(&head, size).map_err(malformed)? {
            Scan::Header(header) => Ok(header),
            Scan::NeedTail { at } => {
                // `scan` asks for a tail of at most TAIL_BYTES, which the read above covers
                // (the bytes between the head and `tail_start` are the ciphertext's).
                let skip = at
                    .checked_sub(tail_start)
                    .and_then(|skip| usize::try_from(skip).ok())
                    .filter(|&skip| skip <= tail.len())
                    .ok_or_else(|| {
                        UploadError::Malformed(
                            "the uploaded object is not a contribution envelope: its fields after the ciphertext are out of place".into(),
                        )
                    })?;
                envelope_scan::scan_with_tail(&head, at, &tail[skip..], size).map_err(malformed)
            }
        }
    }

    /// The body of an admitted upload at `now`, in the order that keeps a refusal free: the
    /// envelope checked (`open_envelope`), its device token if the task requires one (a task
    /// that requires tokens stores nothing unauthenticated), then stored (`store`).
    pub async fn accept(
        &self,
        capability: &Capability,
        admitted: &Admitted,
        body: &[u8],
        device_auth: &device_tokens::DeviceAuthCache,
        now: Millis,
    ) -> Result<Stored, UploadError> {
        let envelope = self.open_envelope(admitted, body, now)?;
        let requirement = device_auth
            .check_upload(self.db, &admitted.assignment, &envelope)
            .await?;
        let stored = self.store(capability, admitted, body).await?;
        if stored == Stored::New
            && let Some(requirement) = requirement
        {
            self.offer_to_prepare(
                &admitted.assignment,
                &requirement,
                (
                    &envelope.encapsulated_key,
                    envelope.token.as_deref(),
                    envelope.seeds.as_deref(),
                ),
            );
        }
        Ok(stored)
    }

    /// A masked round's new upload, handed to the key services ahead of its sums (with its
    /// token and seeds, which its token check found): nothing else is.
    fn offer_to_prepare(
        &self,
        assignment: &AssignmentView,
        requirement: &device_tokens::TokenRequirement,
        (enc, token, seeds): (&[u8], Option<&[u8]>, Option<&[u8]>),
    ) {
        if !self.preparer.is_on() {
            return;
        }
        let (Some(_), Some(token), Some(seeds), Some(key_id), Some(model_version), Ok(round)) = (
            &requirement.masking,
            token,
            seeds,
            &assignment.key_id,
            assignment.model_version,
            u64::try_from(assignment.round_number),
        ) else {
            return;
        };
        self.preparer.offer(mask_prepare::UploadedSeeds {
            tenant_id: assignment.tenant_id.clone(),
            task_id: assignment.task_id.clone(),
            round,
            key_id: key_id.clone(),
            model_version,
            assignment_ref: assignment.id.as_str().to_string(),
            enc: enc.to_vec(),
            token: token.to_vec(),
            seeds: seeds.to_vec(),
        });
    }

    /// A device's report of its assignment's outcome at `now` (`POST .../report`): a
    /// `completed` report of a contribution uploaded straight to the blob store first has the
    /// object checked and noted (`note_direct_upload`, with the task's device-token
    /// requirement); then the report is recorded. A `completed` report refused because the
    /// round closed first is counted as a late contribution.
    pub async fn report(
        &self,
        capability: &Capability,
        outcome: ReportOutcome,
        device_error: Option<&str>,
        device_auth: &device_tokens::DeviceAuthCache,
        now: Millis,
    ) -> Result<AssignmentState, UploadError> {
        if outcome == ReportOutcome::Completed && self.contributions.accepts_direct_uploads() {
            let assignment = self.find(capability).await?;
            let requirement = device_auth.requirement(self.db, &assignment).await?;
            self.note_direct_upload(capability, assignment, requirement.as_deref(), now)
                .await?;
        }
        match self
            .db
            .record_report(capability, outcome, device_error)
            .await?
        {
            Ok(recorded) => Ok(recorded),
            Err(why) => {
                if why == Refusal::RoundClosed && outcome == ReportOutcome::Completed {
                    self.count_late(&capability.reference()).await;
                }
                Err(UploadError::Refused(why))
            }
        }
    }

    /// A contribution that arrived after its round closed: counted (metric, and the round's
    /// funnel through the assignment's row). A failure to record it is logged, never the
    /// device's problem.
    pub async fn count_late(&self, assignment: &crate::db::device::AssignmentRef) {
        match self.db.mark_late(assignment).await {
            Ok(true) => metrics::counter!("confed_contributions_late_total").increment(1),
            Ok(false) => {} // counted the first time
            Err(error) => tracing::warn!(%error, "could not record a late contribution"),
        }
    }
}

/// Whether a contribution's token (and the envelope key `enc` it must bind, and in a masked task
/// its sealed `seeds`) authenticates it for `assignment`: the one check of both upload paths
/// (through the server, `device_tokens.rs`, and straight to the blob store,
/// `note_direct_upload`); a refusal is counted by reason.
pub fn verify_token(
    requirement: &device_tokens::TokenRequirement,
    assignment: &AssignmentView,
    token: Option<&[u8]>,
    enc: &[u8],
    seeds: Option<&[u8]>,
) -> Result<(), confed_protocol::device_auth::TokenRefusal> {
    let round = u64::try_from(assignment.round_number).unwrap_or(0);
    let nonce = match &requirement.masking {
        Some(layout) => confed_protocol::envelope::masked_nonce_of(layout, enc, seeds)
            .ok_or(confed_protocol::device_auth::TokenRefusal::NotBound),
        None => Ok(confed_protocol::privacy_pass::context::token_nonce(enc)),
    };
    nonce
        .and_then(|nonce| {
            requirement.auth.verify_nonce(
                token,
                &nonce,
                &assignment.task_id,
                round,
                assignment.id.as_str(),
            )
        })
        .inspect_err(|refusal| {
            metrics::counter!("confed_device_tokens_refused_total", "reason" => refusal.label())
                .increment(1);
        })
}

/// Whether `body` (whose named digest is `digest`) is the contribution `held` names. Rows stored
/// before the BLAKE3 digest hold a bare lowercase hex SHA-256, computed only for them.
fn same_bytes(held: &str, digest: &str, body: &[u8]) -> bool {
    if held.starts_with(BLAKE3_PREFIX) {
        held == digest
    } else {
        held.eq_ignore_ascii_case(&confed_protocol::hex::sha256_hex(body))
    }
}

fn view_contribution_key(a: &AssignmentView) -> Result<BlobKey, BlobError> {
    BlobKey::contribution(&a.tenant_id, &a.task_id, a.round_number, a.attempt, &a.id)
}

/// The store's rule of a closed assignment (`db::device::closed_at`), and for an upload also
/// any assignment past ASSIGNED: it has stored a contribution or finished.
pub(crate) fn closed_for_upload(a: &AssignmentView, now: i64) -> Option<Refusal> {
    crate::db::device::closed_at(a.round_state, a.expires_at, a.state, Millis(now))
        .or_else(|| (a.state != AssignmentState::Assigned).then_some(Refusal::Finished(a.state)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retried upload is compared by the digest its row holds: `blake3:<hex>` now, a bare
    /// SHA-256 in rows stored before (still answered 200 for the same bytes).
    #[test]
    fn a_repeated_upload_matches_by_blake3_or_by_a_legacy_sha256() {
        let body = b"envelope bytes";
        let digest = format!("{BLAKE3_PREFIX}{}", blake3::hash(body).to_hex());
        assert!(same_bytes(&digest, &digest, body));
        let legacy = confed_protocol::hex::sha256_hex(body);
        assert!(same_bytes(&legacy, &digest, body));
        assert!(same_bytes(&legacy.to_uppercase(), &digest, body));
        let other = b"other bytes";
        let other_digest = format!("{BLAKE3_PREFIX}{}", blake3::hash(other).to_hex());
        assert!(!same_bytes(&digest, &other_digest, other));
        assert!(!same_bytes(&legacy, &other_digest, other));
        assert!(!same_bytes("md5:00", &digest, body));
    }
}
