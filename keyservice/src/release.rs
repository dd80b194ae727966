//! `POST /v1/keys/{key_id}/release`: the key service's one security decision, as named steps.
//!
//! 1. `admit`: a key this service holds a share of, an open grant gate, a well-formed request
//!    whose commitment names this key and whose ephemeral key is usable.
//! 2. `consume_nonce`: a nonce this service issued for this key, unused (else refused unaudited).
//! 3. `appraise`: the key's validity, the evidence against the appraisal policy (evidence the
//!    issuer did not sign is refused unaudited), the task policy against the commitment.
//! 4. `seal_share`: only if every check so far passed; a share that cannot be sealed is a refusal.
//! 5. `decide_and_record`: under the audit lock, the gate again and the release ledger, then the
//!    decision appended (and synced) before any answer: a `Verdict`.
//! 6. `grant`: the sealed share with a signed receipt.
//!
//! Refusals name every failed check (`docs/attestation.md`, "Key release").

use axum::Json;
use axum::extract::State;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::exchange::{CheckedRelease, ReleaseRequest, ReleaseResponse};
use confed_attestation::release::{Receipt, key_binding};
use confed_attestation::{Expectations, VerificationReport, appraise, parse_or_refuse, sha256_hex};
use confed_protocol::hpke;
use confed_protocol::policy::TaskPolicy;

use super::KeyService;
use super::audit::{Decision, Record, Verdict};
use super::ledger;
use crate::error::{FailedCheck, KeyServiceApiError as ApiError};
use crate::extract::{ApiBytes, ApiPath};
use crate::keys::{HeldShare, KeyState};

/// The route's handler: the steps in order.
pub(crate) async fn release(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let held = service
        .shares
        .get(&key_id)
        .ok_or_else(|| super::routes::unknown_key(&key_id))?;
    let admitted = admit(&service, &key_id, &body)?;
    let now = service.now_seconds();
    consume_nonce(&service, &admitted.request, &key_id, now)?;
    let mut appraised = appraise_release(&service, &admitted.request, held, &key_id, now).await?;
    let sealed = seal_share(&service, held, &key_id, &admitted, &mut appraised.report);
    match decide_and_record(&service, &key_id, admitted.request, appraised, now).await? {
        Outcome::Refused(failed) => Err(refusal(&service, failed)),
        Outcome::Granted(granted) => {
            let (record, request) = *granted;
            let sealed = sealed.ok_or_else(|| {
                ApiError::Internal("a granted release has no sealed share".into())
            })?;
            Ok(Json(grant(
                &service, held, key_id, &request, &record, sealed, now,
            )))
        }
    }
}

/// A request this service can decide on.
struct Admitted {
    request: CheckedRelease,
    ephemeral: hpke::PublicKey,
}

fn admit(service: &KeyService, key_id: &str, body: &[u8]) -> Result<Admitted, ApiError> {
    // Before anything is consumed or written: a log that may be behind grants nothing.
    service.gate.check()?;
    let request = ReleaseRequest::decode(body).map_err(ApiError::BadRequest)?;
    let ephemeral =
        hpke::PublicKey::from_peer_bytes(&request.ephemeral_public_key).map_err(|e| {
            ApiError::BadRequest(format!(
                "`ephemeral_public_key` is not usable: {e}; send a fresh X25519 public key"
            ))
        })?;
    if request.commitment.key_id != key_id {
        return Err(ApiError::BadRequest(format!(
            "`commitment.key_id` is {:?}, the request is for key {key_id:?}",
            request.commitment.key_id
        )));
    }
    Ok(Admitted { request, ephemeral })
}

/// A nonce this service did not issue (for this key, within the minute), or one already used,
/// is refused before the evidence is appraised and without an audit record: such a request is
/// about no enclave, and recording it would let anyone fill the log (and its disk) at the rate
/// of fsyncs. It is counted instead.
fn consume_nonce(
    service: &KeyService,
    request: &CheckedRelease,
    key_id: &str,
    now: i64,
) -> Result<(), ApiError> {
    let outcome = service
        .nonces
        .lock()
        .map_err(|_| ApiError::Internal("nonce store poisoned".into()))?
        .consume(&request.nonce, key_id, now);
    let Err(problem) = outcome else {
        return Ok(());
    };
    metrics::counter!("confed_keyservice_refused_unaudited_total", "check" => "challenge_nonce")
        .increment(1);
    if problem == super::nonces::NonceProblem::Busy {
        return Err(ApiError::Unavailable(problem.reason().into()));
    }
    Err(ApiError::AttestationRefused {
        detail: format!("the release request is refused: {}", problem.reason()),
        failed_checks: vec![FailedCheck {
            check: "challenge_nonce".into(),
            reason: problem.reason().into(),
        }],
    })
}

/// What the appraisal found, every check recorded.
struct Appraised {
    report: VerificationReport,
    token_sha256: String,
    image_digest: Option<String>,
    policy_rounds: Option<u32>,
    key_scope: Option<u64>,
}

async fn appraise_release(
    service: &KeyService,
    request: &CheckedRelease,
    held: &HeldShare,
    key_id: &str,
    now: i64,
) -> Result<Appraised, ApiError> {
    let mut report = VerificationReport::new();
    report.record("challenge_nonce", Ok(()));
    let key = &held.key;
    report.record(
        "key_state",
        match KeyState::at(key.not_before, key.not_after, now) {
            KeyState::Pending => Err(format!(
                "key {key_id} is not valid before {}",
                key.not_before
            )),
            KeyState::Expired if now >= key.not_after + service.release_grace_seconds => {
                Err(format!(
                    "key {key_id} expired at {} and its release grace has passed",
                    key.not_after
                ))
            }
            _ => Ok(()),
        },
    );
    let key_binding = key_binding(
        &request.ephemeral_public_key,
        &request.enclave_signing_key,
        &request.commitment.digest(),
    );
    let appraisal = match parse_or_refuse(&request.token) {
        Err(refused) => refused,
        Ok(jws) => {
            let signing_key = match service.key_source.key(jws.header.kid.as_deref(), now).await {
                Ok(key) => key,
                Err(reason) => {
                    tracing::warn!(%reason, "cannot load the issuer's keys");
                    None
                }
            };
            let expect = Expectations {
                audience: &service.audience,
                nonce: &request.nonce,
                key_binding: &key_binding,
                now_unix: now,
            };
            appraise(
                &request.token,
                &jws,
                signing_key.as_ref(),
                &service.policy,
                &expect,
            )
        }
    };
    // A token that is not the issuer's (malformed, another algorithm, a signature that does not
    // verify with the policy's keys) is refused here too, unaudited: anyone can fetch a nonce
    // and send junk with it, and recording each would let them fill the log. Only evidence the
    // issuer signed is about an enclave, and only such decisions are written down.
    let unsigned: Vec<FailedCheck> = appraisal
        .report
        .failures()
        .filter(|(check, _)| matches!(*check, "token_format" | "algorithm" | "signature"))
        .map(|(check, reason)| FailedCheck {
            check: check.to_string(),
            reason: reason.to_string(),
        })
        .collect();
    if !unsigned.is_empty() {
        metrics::counter!("confed_keyservice_refused_unaudited_total", "check" => "token_signature")
            .increment(1);
        return Err(ApiError::AttestationRefused {
            detail: format!(
                "the evidence is not signed by the policy's issuer: {}",
                check_names(&unsigned)
            ),
            failed_checks: unsigned,
        });
    }
    report.extend(appraisal.report);
    let policy = check_task_policy(request);
    let policy_rounds = policy.as_ref().map(|p| p.rounds).ok();
    // check_task_policy parsed the mechanism already.
    let key_scope = policy
        .as_ref()
        .ok()
        .and_then(|p| p.mechanism().ok())
        .and_then(|m| m.key_scope(request.round));
    report.record("task_policy", policy.map(|_| ()));
    Ok(Appraised {
        report,
        token_sha256: appraisal.token_sha256,
        image_digest: appraisal.image_digest,
        policy_rounds,
        key_scope,
    })
}

/// The share sealed to the enclave's ephemeral key, only if every check so far passed. It is
/// sealed before the decision is recorded, so the record says what really happened: a share
/// that could not be sealed is a refusal, never a "granted" with a 500.
fn seal_share(
    service: &KeyService,
    held: &HeldShare,
    key_id: &str,
    admitted: &Admitted,
    report: &mut VerificationReport,
) -> Option<(Vec<u8>, Vec<u8>)> {
    if !report.passed() {
        return None;
    }
    let request = &admitted.request;
    let info = hpke::share_release_info(
        &service.id,
        key_id,
        &request.task_id,
        request.round,
        &request.commitment.digest(),
        held.key.threshold,
        held.key.shares,
    );
    match hpke::seal(
        &admitted.ephemeral,
        &info,
        request.nonce.as_bytes(),
        &held.share,
    ) {
        Ok(sealed) => Some(sealed),
        Err(e) => {
            report.record("share_seal", Err(format!("cannot seal the share: {e}")));
            None
        }
    }
}

/// What was decided, once it is durable.
enum Outcome {
    Granted(Box<(Record, CheckedRelease)>),
    Refused(Vec<FailedCheck>),
}

/// The ledger's decision and its durable record are one step under one lock, off the async
/// workers (the append fsyncs): two requests for one round cannot both be admitted as new.
async fn decide_and_record(
    service: &KeyService,
    key_id: &str,
    request: CheckedRelease,
    appraised: Appraised,
    now: i64,
) -> Result<Outcome, ApiError> {
    let Appraised {
        mut report,
        token_sha256,
        image_digest,
        policy_rounds,
        key_scope,
    } = appraised;
    let commitment_sha256 = request.commitment.digest();
    let decision = Decision {
        at: now,
        keyservice_id: service.id.clone(),
        key_id: key_id.to_string(),
        decision: String::new(),
        reason: String::new(),
        failed_checks: Vec::new(),
        token_sha256,
        image_digest,
        nonce: request.nonce.clone(),
        task_id: request.task_id.clone(),
        round: request.round,
        policy: service.policy.name.clone(),
        commitment_sha256: Some(commitment_sha256.clone()),
        policy_sha256: Some(request.commitment.policy_sha256.clone()),
        policy_rounds,
        enclave_signing_key: Some(URL_SAFE_NO_PAD.encode(&request.enclave_signing_key)),
        key_scope,
        acknowledged_loss: None,
        included_sha256: None,
        included: None,
    };
    let audit = service.audit.clone();
    let refusals = service.refusals.clone();
    let ledger_key_id = key_id.to_string();
    let head_changed = service.head_changed.clone();
    let gate = service.gate.clone();
    let decided = tokio::task::spawn_blocking(move || {
        let mut guard = audit.lock().map_err(|_| "audit log poisoned".to_string())?;
        let (log, ledger) = &mut *guard;
        let entry = ledger::Entry {
            task_id: &request.task_id,
            round: request.round,
            commitment_sha256: &commitment_sha256,
            policy_sha256: &request.commitment.policy_sha256,
            policy_rounds: policy_rounds.unwrap_or(0),
            key_id: &ledger_key_id,
            key_scope,
            at: now,
        };
        if report.passed() {
            // The gate again, under the audit lock: a rollback found while the evidence was
            // appraised closes it before anything is granted.
            if let Err(closed) = gate.check() {
                return Ok(Err(closed));
            }
            report.record("release_ledger", ledger.admit(&entry).map(|_| ()));
        }
        let failed: Vec<FailedCheck> = report
            .failures()
            .map(|(check, reason)| FailedCheck {
                check: check.to_string(),
                reason: reason.to_string(),
            })
            .collect();
        let verdict = if report.passed() {
            Verdict::Granted
        } else {
            Verdict::Refused
        };
        let decision = Decision {
            decision: verdict.as_str().into(),
            reason: match verdict {
                Verdict::Granted => "every check passed".into(),
                Verdict::Refused => check_names(&failed),
            },
            failed_checks: failed.iter().map(|f| f.check.clone()).collect(),
            ..decision
        };
        // Refusals of earlier minutes that were not written one by one: one summary record
        // before this decision.
        let summary = refusals
            .lock()
            .map_err(|_| "refusal budget poisoned".to_string())?
            .take_summary(now);
        if let Some(summary) = summary {
            log.append(summary_decision(&decision, &summary))
                .map_err(|e| e.to_string())?;
            head_changed.notify_one();
        }
        if verdict == Verdict::Refused {
            // A refusal changes no ledger: whether it is written is the budget's call (a ledger
            // refusal always is).
            let admitted = refusals
                .lock()
                .map_err(|_| "refusal budget poisoned".to_string())?
                .admit(&decision.token_sha256, &decision.failed_checks, now);
            if let Err(why) = admitted {
                metrics::counter!("confed_keyservice_refusals_unrecorded_total", "why" => why.as_str())
                    .increment(1);
                return Ok::<_, String>(Ok((None, failed, request)));
            }
        }
        let record = log.append(decision).map_err(|e| e.to_string())?;
        head_changed.notify_one();
        if verdict == Verdict::Granted {
            ledger.record(&entry);
        }
        // After every grant (what a rollback of the log would take away: a restored older log
        // no longer matches this checkpoint and refuses the start) and every so many records.
        if verdict == Verdict::Granted
            || log.head().records % super::checkpoint::CHECKPOINT_EVERY == 0
        {
            log.checkpoint(ledger);
        }
        Ok::<_, String>(Ok((Some(record), failed, request)))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::Internal(format!("audit append failed, nothing released: {e}")))??;
    let (record, failed, request) = decided;
    let Some(record) = record else {
        // A refusal the budget did not write (`refusals.rs`): answered the same.
        metrics::counter!("confed_keyservice_decisions_total", "decision" => Verdict::Refused.as_str())
            .increment(1);
        return Ok(Outcome::Refused(failed));
    };
    let verdict = Verdict::parse(&record.decision.decision);
    tracing::info!(
        keyservice = %service.id, key = %key_id, task = %request.task_id, round = request.round,
        granted = verdict == Some(Verdict::Granted), audit_seq = record.seq,
        audit_head = %record.hash, "release decision"
    );
    metrics::counter!("confed_keyservice_decisions_total", "decision" => record.decision.decision.clone())
        .increment(1);
    Ok(match verdict {
        Some(Verdict::Granted) if failed.is_empty() => {
            Outcome::Granted(Box::new((record, request)))
        }
        _ => Outcome::Refused(failed),
    })
}

fn refusal(service: &KeyService, failed: Vec<FailedCheck>) -> ApiError {
    ApiError::AttestationRefused {
        detail: format!(
            "the evidence or the release does not satisfy policy `{}`: {}",
            service.policy.name,
            check_names(&failed)
        ),
        failed_checks: failed,
    }
}

/// The sealed share and the receipt signed for it.
fn grant(
    service: &KeyService,
    held: &HeldShare,
    key_id: String,
    request: &CheckedRelease,
    record: &Record,
    (encapsulated_key, ciphertext): (Vec<u8>, Vec<u8>),
    now: i64,
) -> ReleaseResponse {
    let mut receipt = Receipt {
        keyservice_id: service.id.clone(),
        key_id: key_id.clone(),
        task_id: request.task_id.clone(),
        round: request.round,
        commitment_sha256: record
            .decision
            .commitment_sha256
            .clone()
            .unwrap_or_default(),
        enclave_signing_key: URL_SAFE_NO_PAD.encode(&request.enclave_signing_key),
        image_digest: receipt_image_digest(record.decision.image_digest.as_deref()),
        policy: service.policy.name.clone(),
        threshold: held.key.threshold,
        shares: held.key.shares,
        at: now,
        signature: String::new(),
    };
    receipt.sign(&service.signing_key);
    ReleaseResponse {
        keyservice_id: service.id.clone(),
        key_id,
        encapsulated_key: URL_SAFE_NO_PAD.encode(encapsulated_key),
        ciphertext: URL_SAFE_NO_PAD.encode(ciphertext),
        receipt,
    }
}

fn check_names(failed: &[FailedCheck]) -> String {
    failed
        .iter()
        .map(|f| f.check.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The task policy the commitment names: parsed strictly, its hash the commitment's, this task's,
/// within the limits any enclave of this project applies.
fn check_task_policy(request: &CheckedRelease) -> Result<TaskPolicy, String> {
    let policy = TaskPolicy::parse(&request.policy).map_err(|e| e.to_string())?;
    if sha256_hex(request.policy.as_bytes()) != request.commitment.policy_sha256 {
        return Err("the policy text does not hash to the commitment's policy_sha256".into());
    }
    if policy.task_id != request.task_id {
        return Err(format!(
            "the policy is task {}'s, the request is for task {}",
            policy.task_id, request.task_id
        ));
    }
    policy.check_enclave_limits().map_err(|e| e.to_string())?;
    Ok(policy)
}

/// The image digest a receipt names: the appraised token's, when it has the expected shape
/// (`sha256:` and 64 hex digits), else `none`.
fn receipt_image_digest(digest: Option<&str>) -> String {
    match digest {
        Some(d)
            if d.len() == 71
                && d.starts_with("sha256:")
                && d[7..].bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            d.to_string()
        }
        _ => "none".into(),
    }
}

/// The record summarizing a minute's refusals that were not written one by one
/// (`refusals::Summary`); `like` lends it the service's id and policy.
fn summary_decision(like: &Decision, summary: &crate::refusals::Summary) -> Decision {
    Decision {
        failed_checks: summary.failed_checks(),
        policy: like.policy.clone(),
        ..Decision::note(
            summary.minute * 60 + 59,
            &like.keyservice_id,
            crate::refusals::SUMMARY_DECISION,
            summary.reason(),
        )
    }
}
