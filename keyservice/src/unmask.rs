//! The unmask endpoints of masked tasks (docs/secure-aggregation.md; docs/protocol.md, `POST
//! /v1/keys/{key_id}/unmask/agree` and `.../sums`): after a round's release commitment is admitted,
//!
//! - `POST /v1/keys/{key_id}/unmask/agree`: this service agrees to unmask one included set of
//!   the round, once (the unmask ledger, in the audit log), and signs a receipt for it;
//! - `POST /v1/keys/{key_id}/unmask/sums`: against receipts of `agreement(t, n)` key services
//!   for the set this service agreed to, and a device token over each input's sealed seeds, it
//!   opens its seeds and answers its groups' mask sums over exactly that set.
//!
//! With distributed noise, each group's sums leave with that group's noise subtracted, drawn from
//! a key only the group's holders can derive.
//!
//! Neither answer needs an attested caller: the receipts and sums are useless without the
//! round's masked sum, which only an enclave holding the round's key can make. What must hold
//! is that one set per round is ever unmasked, whoever asks, and that every seed summed is a
//! genuine device's (the token's nonce binds it).

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use confed_attestation::release::{KeySetShape, TrustedSigner};
use confed_attestation::unmask::{IncludedSet, UnmaskReceipt, check_agreement, included_digest};
use confed_attestation::unmask_api::{AgreeRequest, MAX_UNMASK_INPUTS, SumsRequest, UnmaskRound};
use confed_protocol::policy::TaskPolicy;

use sha2::Digest as _;

use super::KeyService;
use super::audit::Decision;
use super::ledger::{self, Admission};
use super::unmask_answers::{self, AnswerKey};
use super::unmask_prepared::{Cell, RoundKey};
use super::unmask_sums::{Opener, sum_masks};
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::{ApiBytes, ApiPath};
use crate::keys::HeldShare;

/// The body limit of the sums route: `MAX_UNMASK_INPUTS` inputs of up to about 1.9 KB each
/// (3-of-7's sealed seeds, base64url, with the token and seven digests).
pub(crate) const SUMS_BODY_LIMIT: usize = 128 * 1024 * 1024;
/// The body limit of the agreement route: the policy and `MAX_UNMASK_INPUTS` refs.
pub(crate) const AGREE_BODY_LIMIT: usize = 8 * 1024 * 1024;
/// Most bytes of mask sums one answer holds while it is computed (values x (groups x 8 + 4)):
/// a 22 M-value model's in 2-of-3, 2 M values' in 3-of-7.
const MAX_SUMS_BYTES: usize = 256 * 1024 * 1024;

/// What every unmask request is checked against: the round's pinned policy (a masked one naming
/// this service) and its admitted commitment.
pub(crate) struct CheckedRound {
    pub(crate) policy: TaskPolicy,
    /// This service's number in the policy's `masking` line.
    pub(crate) number: u8,
    key_set: KeySetShape,
}

fn check_round(
    service: &KeyService,
    held: &HeldShare,
    round: &UnmaskRound,
) -> Result<CheckedRound, ApiError> {
    let checked = check_policy(service, held, &round.task_id, &round.policy)?;
    let policy_sha256 = confed_protocol::hex::sha256_hex(round.policy.as_bytes());
    let guard = service
        .audit
        .lock()
        .map_err(|_| ApiError::Internal("audit log poisoned".into()))?;
    match guard.1.committed(&round.task_id, round.round) {
        Some((pinned, commitment))
            if pinned == policy_sha256 && commitment == round.commitment_sha256 => {}
        _ => {
            return Err(ApiError::Conflict(format!(
                "round {} of task {} has no admitted release commitment {} under this policy here: unmask after the release",
                round.round, round.task_id, round.commitment_sha256
            )));
        }
    }
    Ok(checked)
}

/// What every unmask and prepare request is checked against, but the commitment: a masked
/// policy of `task_id` that names this service with its own signing key, noise it would draw,
/// and the key's shape.
pub(crate) fn check_policy(
    service: &KeyService,
    held: &HeldShare,
    task_id: &str,
    policy_text: &str,
) -> Result<CheckedRound, ApiError> {
    service.gate.check()?;
    let policy = TaskPolicy::parse(policy_text).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    if policy.task_id != task_id {
        return Err(ApiError::BadRequest(format!(
            "the policy is task {}'s, the request names task {task_id}",
            policy.task_id
        )));
    }
    let masking = policy.masking.as_ref().ok_or_else(|| {
        ApiError::BadRequest(
            "the task's policy does not mask its updates: nothing to unmask".into(),
        )
    })?;
    let number = masking.number_of(&service.id).ok_or_else(|| {
        ApiError::Forbidden(format!(
            "key service {} is not one of this masked task's key services",
            service.id
        ))
    })?;
    // Its own entry must be its own: the key it signs with, and (for sums) its masking key.
    let own = &masking.services[usize::from(number) - 1];
    if own.verifying_key().ok().as_ref() != Some(service.signing_key.verifying_key()) {
        return Err(ApiError::Forbidden(format!(
            "the policy names key service {} with a verifying key that is not this service's",
            service.id
        )));
    }
    check_noise(&policy, masking)?;
    let key_set = KeySetShape {
        threshold: held.key.threshold,
        shares: held.key.shares,
    };
    if (u16::from(masking.threshold), masking.services.len())
        != (key_set.threshold, usize::from(key_set.shares))
    {
        return Err(ApiError::BadRequest(format!(
            "the policy masks with {} of {} key services; this key is {} of {}",
            masking.threshold,
            masking.services.len(),
            key_set.threshold,
            key_set.shares
        )));
    }
    Ok(CheckedRound {
        policy,
        number,
        key_set,
    })
}

/// This service's masking key, which the checked policy must name as its own.
pub(crate) fn own_masking_key(
    service: &KeyService,
    checked: &CheckedRound,
) -> Result<std::sync::Arc<confed_protocol::hpke::PrivateKey>, ApiError> {
    let masking_key = service.masking_key.clone().ok_or_else(no_masking_key)?;
    let named = checked.policy.masking.as_ref().and_then(|m| {
        m.services[usize::from(checked.number) - 1]
            .public_key()
            .ok()
    });
    if named.is_none() || named != masking_key.public_key().ok() {
        return Err(ApiError::Forbidden(
            "the policy names a masking key for this service that is not its own".into(),
        ));
    }
    Ok(masking_key)
}

pub(crate) fn no_masking_key() -> ApiError {
    ApiError::Unavailable(
        "this key service has no masking key (--masking-key): it cannot open mask seeds".into(),
    )
}

/// The values of a sums (or prepare) request for a service in `groups` groups, within what
/// one computation holds: `values x (groups x 8 + 4)` bytes at most (its sums as u64, plus the
/// threads' buffers of one group at a time, 4 bytes a value in the ring of 2^32).
pub(crate) fn checked_values(values: u64, groups: usize) -> Result<usize, ApiError> {
    let per_value = groups * 8 + 4;
    usize::try_from(values)
        .ok()
        .filter(|&v| v >= 1 && v.saturating_mul(per_value) <= MAX_SUMS_BYTES)
        .ok_or_else(|| {
            ApiError::BadRequest(format!(
                "`values` must be 1 to {} for this service's {groups} groups",
                MAX_SUMS_BYTES / per_value
            ))
        })
}

/// A masked policy's distributed noise, checked by the party whose noise it is: per-round
/// Gaussian noise, of at least the variance the policy's budget calibrates (`confed_dp`'s closed
/// form, plus one part in 10^6; the front end writes one part in 10^4 above it). The front ends and the enclave may be the
/// attacker's, so an honest key service refuses to agree to, or sum for, a round whose noise
/// would be too weak (docs/secure-aggregation.md, "Distributed noise").
fn check_noise(
    policy: &TaskPolicy,
    masking: &confed_protocol::masking_keys::MaskingPolicy,
) -> Result<(), ApiError> {
    let Some(variance) = masking.noise_variance else {
        return Ok(());
    };
    let mechanism = policy
        .dp_mechanism()
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    if mechanism.noise != confed_protocol::mechanism::Mechanism::Gaussian {
        return Err(ApiError::Forbidden(
            "distributed noise is per-round Gaussian noise; this policy's mechanism is not".into(),
        ));
    }
    let scale = confed_dp::calibrated_scale(
        &confed_dp::ClosedForm,
        mechanism,
        policy.epsilon,
        policy.delta,
        policy.rounds,
    )
    .map_err(|e| ApiError::Forbidden(format!("the policy's budget calibrates no noise: {e}")))?;
    // One part in 10^6 above the closed form: the enclave's OpenDP calibration, within 10^-9 of
    // it, never asks for more than this service lets through, and the front end writes one part
    // in 10^4 above. Compared as integers; a NaN or overflow refuses.
    let needed = (scale * scale * (1.0 + 1e-6)).ceil();
    let enough = needed.is_finite() && needed < u64::MAX as f64 && variance >= needed as u64;
    if !enough {
        return Err(ApiError::Forbidden(format!(
            "the policy's distributed noise has variance {variance} per group; its budget needs at least {needed:.0}: this key service draws no weaker noise"
        )));
    }
    Ok(())
}

/// Sorted ascending, each once, each a 64-hex ref, at least the policy's `min_reports` and at
/// most `MAX_UNMASK_INPUTS`.
fn check_included<S: AsRef<str>>(refs: &[S], policy: &TaskPolicy) -> Result<(), ApiError> {
    let sorted = refs.windows(2).all(|w| w[0].as_ref() < w[1].as_ref());
    let refs_ok = refs
        .iter()
        .all(|r| confed_protocol::hex::is_digest_hex(r.as_ref()));
    if !(sorted && refs_ok) {
        return Err(ApiError::BadRequest(
            "the included refs must be 64 lowercase hex digits each, sorted ascending, each once"
                .into(),
        ));
    }
    let count = refs.len();
    if count < policy.min_reports as usize || count > MAX_UNMASK_INPUTS {
        return Err(ApiError::BadRequest(format!(
            "{count} included inputs; a masked round unmasks {} to {MAX_UNMASK_INPUTS}",
            policy.min_reports
        )));
    }
    Ok(())
}

pub(crate) fn held<'a>(service: &'a KeyService, key_id: &str) -> Result<&'a HeldShare, ApiError> {
    service
        .shares
        .get(key_id)
        .ok_or_else(|| super::routes::unknown_key(key_id))
}

/// `POST /v1/keys/{key_id}/unmask/agree`.
pub(crate) async fn agree(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<UnmaskReceipt>, ApiError> {
    let held = held(&service, &key_id)?;
    let request = AgreeRequest::decode(&body).map_err(ApiError::BadRequest)?;
    let checked = check_round(&service, held, &request.round)?;
    check_included(&request.included, &checked.policy)?;
    let included_sha256 = included_digest(&request.included);
    let now = service.now_seconds();
    let round = request.round;
    let mut decision = Decision::note(
        now,
        &service.id,
        ledger::UNMASK_AGREED,
        format!(
            "agreed to unmask {} included inputs",
            request.included.len()
        ),
    );
    decision.key_id = key_id.clone();
    decision.task_id = round.task_id.clone();
    decision.round = round.round;
    decision.commitment_sha256 = Some(round.commitment_sha256.clone());
    decision.included_sha256 = Some(included_sha256.clone());
    decision.included = Some(request.included.len() as u64);
    let audit = service.audit.clone();
    let gate = service.gate.clone();
    let head_changed = service.head_changed.clone();
    // The ledger's decision and its durable record are one step under one lock, off the async
    // workers (the append fsyncs).
    let admitted = tokio::task::spawn_blocking(move || -> Result<Result<(), String>, String> {
        let mut guard = audit.lock().map_err(|_| "audit log poisoned".to_string())?;
        let (log, ledger) = &mut *guard;
        if let Err(closed) = gate.check() {
            return Ok(Err(closed.to_string()));
        }
        let task_id = decision.task_id.clone();
        let included = decision.included_sha256.clone().unwrap_or_default();
        let commitment = decision.commitment_sha256.clone().unwrap_or_default();
        match ledger.admit_unmask(&task_id, decision.round, &commitment, &included) {
            Err(why) => Ok(Err(why)),
            Ok(Admission::Repeat) => Ok(Ok(())),
            Ok(Admission::New) => {
                let round = decision.round;
                log.append(decision).map_err(|e| e.to_string())?;
                ledger.record_unmask(&task_id, round, &included);
                head_changed.notify_one();
                Ok(Ok(()))
            }
        }
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the unmask decision did not finish: {e}")))?
    .map_err(ApiError::Internal)?;
    admitted.map_err(ApiError::Conflict)?;
    metrics::counter!("confed_keyservice_unmask_agreed_total").increment(1);
    let set = IncludedSet {
        task_id: &round.task_id,
        round: round.round,
        key_id: &key_id,
        commitment_sha256: &round.commitment_sha256,
        included_sha256: &included_sha256,
        included: request.included.len() as u64,
    };
    let mut receipt = UnmaskReceipt::for_set(&service.id, &set, checked.key_set, now);
    receipt.sign(&service.signing_key);
    Ok(Json(receipt))
}

/// `POST /v1/keys/{key_id}/unmask/sums`.
pub(crate) async fn sums(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
    ApiBytes(body): ApiBytes,
) -> Result<impl IntoResponse, ApiError> {
    let held = held(&service, &key_id)?;
    if service.masking_key.is_none() {
        return Err(no_masking_key());
    }
    let request = SumsRequest::decode(&body).map_err(ApiError::BadRequest)?;
    let checked = check_round(&service, held, &request.round)?;
    let masking_key = own_masking_key(&service, &checked)?;
    let refs: Vec<&str> = request
        .inputs
        .iter()
        .map(|i| i.assignment_ref.as_str())
        .collect();
    check_included(&refs, &checked.policy)?;
    let included_sha256 = included_digest(&refs);
    let round = &request.round;
    // This service's own agreement first: it sums over no set but the one it agreed to.
    let agreed = service
        .audit
        .lock()
        .map_err(|_| ApiError::Internal("audit log poisoned".into()))?
        .1
        .unmask_agreed(&round.task_id, round.round)
        .map(str::to_string);
    if agreed.as_deref() != Some(included_sha256.as_str()) {
        return Err(ApiError::Conflict(format!(
            "this key service agreed to unmask {} for round {} of task {}, not the {} inputs sent: agree first, to the same set",
            agreed.as_deref().unwrap_or("no set"),
            round.round,
            round.task_id,
            refs.len()
        )));
    }
    let masking = checked
        .policy
        .masking
        .as_ref()
        .expect("check_round found the masking line");
    let verifying: Vec<(String, p256::ecdsa::VerifyingKey)> = masking
        .services
        .iter()
        .filter_map(|s| Some((s.keyservice_id.clone(), s.verifying_key().ok()?)))
        .collect();
    let trusted: Vec<TrustedSigner<'_>> = verifying
        .iter()
        .map(|(id, key)| TrustedSigner {
            id,
            verifying_key: key,
        })
        .collect();
    let set = IncludedSet {
        task_id: &round.task_id,
        round: round.round,
        key_id: &key_id,
        commitment_sha256: &round.commitment_sha256,
        included_sha256: &included_sha256,
        included: refs.len() as u64,
    };
    check_agreement(&request.receipts, &set, &trusted, checked.key_set)
        .map_err(|e| ApiError::Forbidden(format!("the unmask agreement does not hold: {e}")))?;
    let groups = masking.layout().groups_of(checked.number).len();
    let ring = masking.ring;
    let values = checked_values(request.values, groups)?;
    // A repeat of a request already answered gets the same bytes from memory; a fresh
    // computation only within the round's allowance (`unmask_answers`).
    let answer_key = AnswerKey {
        service: confed_protocol::keyset::encode_verifying_key(service.signing_key.verifying_key())
            .into_bytes(),
        task_id: round.task_id.clone(),
        round: round.round,
        included_sha256: included_sha256.clone(),
        values: request.values,
        inputs_sha256: sha2::Sha256::digest(
            serde_json::to_vec(&request.inputs)
                .map_err(|e| ApiError::Internal(format!("the inputs do not serialize: {e}")))?,
        )
        .into(),
    };
    if let Some(body) = unmask_answers::kept(&answer_key) {
        return Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body));
    }
    unmask_answers::may_compute(&answer_key).map_err(ApiError::Conflict)?;
    let number = checked.number;
    let policy = checked.policy.clone();
    let inputs = request.inputs;
    let prepared_key = RoundKey {
        key_id: key_id.clone(),
        task_id: round.task_id.clone(),
        round: round.round,
        policy_sha256: policy.sha256_hex(),
        values,
    };
    // The round's preparation, if a batch of it is under way, once that batch is done; held
    // (blocking only batches of this round) until the computation takes it, before the sums
    // queue, so no other round's sums wait on it. A caller that hangs up meanwhile leaves it.
    let prepared = service.prepared.clone();
    let cell = prepared
        .lock()
        .map_err(|_| ApiError::Internal("the prepared rounds' lock is poisoned".into()))?
        .cell_of(&prepared_key);
    let mut cell_guard = match cell {
        Some(cell) => Some(cell.lock_owned().await),
        None => None,
    };
    // Held by the computation itself: a caller that hangs up does not free it while the sums
    // still run.
    let permit = service
        .summing
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ApiError::Internal(format!("the sums queue closed: {e}")))?;
    // Again with the queue held: a request that waited behind the same one, or behind the
    // round's last allowed computation, gets the kept answer or the refusal, not a computation.
    if let Some(body) = unmask_answers::kept(&answer_key) {
        return Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body));
    }
    unmask_answers::may_compute(&answer_key).map_err(ApiError::Conflict)?;
    let inputs_count = inputs.len();
    let started = std::time::Instant::now();
    // Used once, by the round's first computation (a repeat gets the kept answer; a later one
    // computes in full): taken, and the round's preparations forgotten.
    prepared
        .lock()
        .map_err(|_| ApiError::Internal("the prepared rounds' lock is poisoned".into()))?
        .forget_round(&prepared_key);
    let ahead = match cell_guard
        .as_mut()
        .map(|guard| std::mem::replace(&mut **guard, Cell::Taken))
    {
        Some(Cell::Open(round)) => round,
        _ => None,
    };
    drop(cell_guard);
    let summed = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = permit;
        let noise_variance = policy.masking.as_ref().and_then(|m| m.noise_variance);
        let opener = Opener::new(
            &policy,
            number,
            &masking_key,
            (&prepared_key.task_id, prepared_key.round),
            values,
        )?;
        sum_masks(&opener, &inputs, ahead, noise_variance)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the mask sums did not finish: {e}")))??;
    metrics::counter!("confed_keyservice_mask_sums_total").increment(1);
    // Inputs whose streams were added while the round collected, and the rest.
    metrics::counter!("confed_keyservice_mask_sums_inputs_total", "from" => "prepared")
        .increment(summed.prepared as u64);
    metrics::counter!("confed_keyservice_mask_sums_inputs_total", "from" => "request")
        .increment((inputs_count - summed.prepared) as u64);
    tracing::info!(
        keyservice = %service.id,
        task = %round.task_id,
        round = round.round,
        inputs = inputs_count,
        prepared = summed.prepared,
        subtracted = summed.subtracted,
        seconds = started.elapsed().as_secs_f64(),
        "mask sums computed"
    );
    let summed = summed.sums;
    let mut body = Vec::with_capacity(summed.sums.len() * values * ring.bytes());
    for (_, sum) in &summed.sums {
        for value in sum {
            ring.write(*value, &mut body);
        }
    }
    let body = axum::body::Bytes::from(body);
    unmask_answers::computed(answer_key, body.clone());
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body))
}
