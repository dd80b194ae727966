//! Mask sums prepared while a round collects (docs/secure-aggregation.md, "Prepared sums";
//! docs/protocol.md, `POST /v1/keys/{key_id}/unmask/prepare`).
//!
//! A key service's part of a masked round is to expand one stream per input and group. Done
//! when the round closes, that work lies between the enclave's open and the release. But the
//! front end has every uploaded envelope's `enc`, token and sealed seeds as they arrive, so it
//! hands them to the key services in batches while the round collects: each checks them as a
//! sums request would (the token over the seeds, the seeds open under the policy) and adds
//! their streams to a running sum for the round (`unmask_prepared.rs`). The sums request, later,
//! opens and adds only the agreed inputs it was not given, and subtracts the ones it was given
//! that the agreed set leaves out: the same bytes as computing from nothing, for a few inputs'
//! work.
//!
//! Nothing here releases anything: the answer counts inputs. Batches run one at a time per
//! service, beside (not before) sums requests, each within `MAX_PREPARE_WORK` stream values; a
//! sums request waits only for a batch of its own round under way.

use std::collections::HashSet;

use axum::Json;
use axum::extract::State;
use confed_attestation::unmask_api::{
    MAX_PREPARE_INPUTS, MAX_PREPARE_WORK, MAX_UNMASK_INPUTS, MaskedInput, PrepareAnswer,
    PrepareRequest,
};
use confed_protocol::masking::MaskSums;

use super::KeyService;
use super::unmask::{check_policy, checked_values, held, own_masking_key};
use super::unmask_prepared::{Cell, PreparedInput, PreparedRound, RoundKey, input_digest};
use super::unmask_sums::{Opener, sums_threads};
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::{ApiBytes, ApiPath};

/// Most inputs one round holds: the unmask's limit twice over (uploads the set may leave out).
const MAX_PREPARED_INPUTS: usize = 2 * MAX_UNMASK_INPUTS;
/// The body limit of the prepare route: `MAX_PREPARE_INPUTS` inputs of up to about 2.3 KB
/// (1-of-7's 20 groups a service: sealed seeds in base64url, the token, seven digests).
pub(crate) const PREPARE_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// `POST /v1/keys/{key_id}/unmask/prepare`.
pub(crate) async fn prepare(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<PrepareAnswer>, ApiError> {
    let held = held(&service, &key_id)?;
    if service.masking_key.is_none() {
        return Err(super::unmask::no_masking_key());
    }
    let request = PrepareRequest::decode(&body).map_err(ApiError::BadRequest)?;
    if request.inputs.is_empty() || request.inputs.len() > MAX_PREPARE_INPUTS {
        return Err(ApiError::BadRequest(format!(
            "{} inputs; a prepare request carries 1 to {MAX_PREPARE_INPUTS}",
            request.inputs.len()
        )));
    }
    let checked = check_policy(&service, held, &request.task_id, &request.policy)?;
    let masking_key = own_masking_key(&service, &checked)?;
    if checked.policy.device_auth.is_none() {
        return Err(ApiError::BadRequest(
            "a masked task's policy requires device tokens".into(),
        ));
    }
    let layout = checked
        .policy
        .masking
        .as_ref()
        .ok_or_else(|| ApiError::Internal("the checked policy lost its masking line".into()))?
        .layout();
    let groups = layout.groups_of(checked.number).len();
    let values = checked_values(request.values, groups)?;
    refuse_once_agreed(&service, &request.task_id, request.round)?;
    let key = RoundKey {
        key_id,
        task_id: request.task_id.clone(),
        round: request.round,
        policy_sha256: checked.policy.sha256_hex(),
        values,
    };
    // One batch at a time per service, on a queue of its own: a sums request never waits for
    // another round's batch.
    let permit = service
        .preparing
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ApiError::Internal(format!("the prepare queue closed: {e}")))?;
    let prepared = service.prepared.clone();
    let (cell, limit) = {
        let mut rounds = lock(&prepared)?;
        (rounds.cell(&key, groups * values * 8), rounds.limit())
    };
    // A sums request takes the round's cell only after the agreement: if there is none yet, it
    // will find this cell; if there is, nothing more is added.
    if let Err(agreed) = refuse_once_agreed(&service, &request.task_id, request.round) {
        if cell
            .try_lock()
            .is_ok_and(|held| matches!(*held, Cell::Open(None)))
        {
            lock(&prepared)?.settle(&key, &cell, 0);
        }
        return Err(agreed);
    }
    let mut guard = cell.clone().lock_owned().await;
    // Taken by the round's sums while this batch waited for the round's lock.
    let Cell::Open(held) = std::mem::replace(&mut *guard, Cell::Open(None)) else {
        *guard = Cell::Taken;
        return Err(ApiError::Conflict(format!(
            "round {} of task {} has its mask sums under way here: nothing more to prepare",
            request.round, request.task_id
        )));
    };
    let inputs = request.inputs;
    let outcome = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = permit;
        // The round is out of its cell while it is worked on (a failure, or a panic, leaves the
        // cell empty, never half-added), put back when done, and its size recorded here, in the
        // task that finishes whether or not the caller waits.
        let outcome = fill(held, &checked, &masking_key, &key, &inputs, limit);
        let (answer, bytes) = match outcome {
            Ok((round, answer)) => {
                let bytes = if round.inputs.is_empty() {
                    0
                } else {
                    round.bytes()
                };
                if bytes > 0 {
                    *guard = Cell::Open(Some(round));
                }
                (Ok(answer), bytes)
            }
            Err(error) => (Err(error), 0),
        };
        if let Ok(mut rounds) = prepared.lock() {
            rounds.settle(&key, &cell, bytes);
        }
        answer
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the preparation did not finish: {e}")))?;
    let answer = outcome?;
    metrics::counter!("confed_keyservice_mask_inputs_prepared_total").increment(answer.prepared);
    Ok(Json(answer))
}

/// `inputs` added to the round `held` (made if there is none yet): the round and the answer.
fn fill(
    held: Option<PreparedRound>,
    checked: &super::unmask::CheckedRound,
    masking_key: &confed_protocol::hpke::PrivateKey,
    key: &RoundKey,
    inputs: &[MaskedInput],
    limit: usize,
) -> Result<(PreparedRound, PrepareAnswer), ApiError> {
    let opener = Opener::new(
        &checked.policy,
        checked.number,
        masking_key,
        (&key.task_id, key.round),
        key.values,
    )?;
    let mut round = match held {
        Some(round) => round,
        None => PreparedRound {
            sums: MaskSums::new(opener.layout(), opener.number(), key.values)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
            inputs: Default::default(),
        },
    };
    let answer = add_inputs(&opener, &mut round, inputs, limit)?;
    Ok((round, answer))
}

fn lock(
    prepared: &std::sync::Mutex<super::unmask_prepared::PreparedRounds>,
) -> Result<std::sync::MutexGuard<'_, super::unmask_prepared::PreparedRounds>, ApiError> {
    prepared
        .lock()
        .map_err(|_| ApiError::Internal("the prepared rounds' lock is poisoned".into()))
}

/// A round whose included set this service agreed to takes no more preparation: its sums are
/// computed, or about to be.
fn refuse_once_agreed(service: &KeyService, task_id: &str, round: u64) -> Result<(), ApiError> {
    let agreed = service
        .audit
        .lock()
        .map_err(|_| ApiError::Internal("audit log poisoned".into()))?
        .1
        .unmask_agreed(task_id, round)
        .is_some();
    if agreed {
        return Err(ApiError::Conflict(format!(
            "round {round} of task {task_id} has an agreed included set here: nothing more to prepare"
        )));
    }
    Ok(())
}

/// Checks and opens `inputs` (each on its own: a refused input is counted, not fatal) and adds
/// the new ones' streams to `round`, within `MAX_PREPARE_WORK` stream values (at least one
/// input's), `MAX_PREPARED_INPUTS` and `limit` bytes for the round: inputs past them are
/// refused before anything is opened.
fn add_inputs(
    opener: &Opener<'_>,
    round: &mut PreparedRound,
    inputs: &[MaskedInput],
    limit: usize,
) -> Result<PrepareAnswer, ApiError> {
    let mut answer = PrepareAnswer {
        prepared: 0,
        held: 0,
        refused: 0,
    };
    let groups = round.sums.sums.len();
    let per_input_work = (opener.values() as u64).saturating_mul(groups as u64);
    let most_work = MAX_PREPARE_WORK.max(per_input_work);
    let (mut work, mut bytes) = (0u64, round.bytes());
    let mut fresh: Vec<(&MaskedInput, [u8; 32])> = Vec::new();
    let mut in_batch = HashSet::new();
    for input in inputs {
        let digest = input_digest(input);
        let reference = &input.assignment_ref;
        match round.inputs.get(reference) {
            Some(kept) if kept.digest == digest => answer.held += 1,
            // Another envelope for an assignment already held: the sums request decides.
            Some(_) => answer.refused += 1,
            None if !confed_protocol::hex::is_digest_hex(reference)
                || !in_batch.insert(reference.as_str())
                || round.inputs.len() + fresh.len() >= MAX_PREPARED_INPUTS
                || work + per_input_work > most_work
                || bytes + round.input_bytes() > limit =>
            {
                answer.refused += 1
            }
            None => {
                work += per_input_work;
                bytes += round.input_bytes();
                fresh.push((input, digest));
            }
        }
    }
    let refs: Vec<&MaskedInput> = fresh.iter().map(|(input, _)| *input).collect();
    let opened = opener.open_each(&refs, sums_threads())?;
    let mut streams = Vec::with_capacity(fresh.len());
    let mut added = Vec::with_capacity(fresh.len());
    for ((input, digest), opened) in fresh.into_iter().zip(opened) {
        match opened {
            Ok(opened) => {
                streams.push(opened.streams);
                let held = PreparedInput {
                    digest,
                    seeds: opened.seeds,
                };
                added.push((input.assignment_ref.clone(), held));
            }
            Err(_) => answer.refused += 1,
        }
    }
    round
        .sums
        .add_many(&streams, opener.layout().ring(), sums_threads())
        .map_err(|e| ApiError::Internal(format!("the prepared mask sums: {e}")))?;
    // Only now, with their streams in the sums: a round's inputs are always the ones it adds.
    answer.prepared = added.len() as u64;
    round.inputs.extend(added);
    Ok(answer)
}
