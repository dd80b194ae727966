//! Mask sums prepared while a round collects (docs/secure-aggregation.md, "Prepared sums";
//! docs/protocol.md, `POST /v1/keys/{key_id}/unmask/prepare`).
//!
//! A key service's part of a masked round is to expand one stream per input and group. Done
//! when the round closes, that work lies between the enclave's open and the release. But the
//! front end has every uploaded envelope's `enc`, token and sealed seeds as they arrive, so it
//! hands them to the key services in batches while the round collects: each checks them as a
//! sums request would (the token over the seeds, the seeds open under the policy) and adds
//! their streams to a running sum for the round. The sums request, later, opens and adds only
//! the agreed inputs it was not given, and subtracts the ones it was given that the agreed set
//! leaves out: the same bytes as computing from nothing, for a few inputs' work.
//!
//! Nothing here releases anything: the answer counts inputs. The running sums and the opened
//! seeds stay in this process, wiped when dropped; a round prepared under another policy text or
//! length, or evicted, or lost in a restart, is simply computed in full. One round per (key,
//! task, round, policy, values); at most `MAX_PREPARED_BYTES` held, the least recently used
//! round dropped first.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use confed_attestation::unmask_api::{
    MAX_PREPARE_INPUTS, MAX_UNMASK_INPUTS, MaskedInput, PrepareAnswer, PrepareInput, PrepareRequest,
};
use confed_protocol::masking::{MaskSums, SEED_BYTES, Seed};
use sha2::Digest as _;

use super::KeyService;
use super::unmask::{check_policy, checked_values, held, own_masking_key};
use super::unmask_sums::{Opener, in_order_on_threads, sums_threads};
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::{ApiBytes, ApiPath};

/// Most bytes of prepared rounds one service holds (running sums and opened seeds).
pub const MAX_PREPARED_BYTES: usize = 256 * 1024 * 1024;
/// Most inputs one round holds: the unmask's limit twice over (uploads the set may leave out).
const MAX_PREPARED_INPUTS: usize = 2 * MAX_UNMASK_INPUTS;
/// What one held input costs besides its seeds, over-estimated: its ref (64 bytes on the heap),
/// digest, the map's entry at its load factor and the allocator's headers.
const INPUT_OVERHEAD_BYTES: usize = 320;
/// What one held seed costs: its group, the seed, alignment and the vector's rounding.
const HELD_SEED_BYTES: usize = 2 * SEED_BYTES;
/// The body limit of the prepare route: `MAX_PREPARE_INPUTS` inputs of up to about 11 KB
/// (3-of-7's whole sealed seeds, base64url, with the token).
pub(crate) const PREPARE_BODY_LIMIT: usize = 64 * 1024 * 1024;

/// Which preparation a sums request may use: the same key, round, policy and length.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct RoundKey {
    pub(crate) key_id: String,
    pub(crate) task_id: String,
    pub(crate) round: u64,
    /// `TaskPolicy::sha256_hex`, which the seeds' context names.
    pub(crate) policy_sha256: String,
    pub(crate) values: usize,
}

/// One input added ahead: the digest of its bytes as a sums request names it, and its opened
/// seeds (for the noise key, or to subtract it).
pub(crate) struct PreparedInput {
    pub(crate) digest: [u8; 32],
    pub(crate) seeds: Vec<(usize, Seed)>,
}

/// A round's running sums and the inputs in them, by ref.
pub(crate) struct PreparedRound {
    pub(crate) sums: MaskSums,
    pub(crate) inputs: HashMap<String, PreparedInput>,
}

impl PreparedRound {
    fn bytes(&self) -> usize {
        let groups = self.sums.sums.len();
        let values = self.sums.sums.first().map_or(0, |(_, sum)| sum.len());
        groups * values * 8 + self.inputs.len() * (INPUT_OVERHEAD_BYTES + groups * HELD_SEED_BYTES)
    }
}

/// The digest a prepared input is matched by: SHA-256 of the input as the sums request names
/// it (JSON). Equal digests are equal inputs; an input sent with other bytes is computed anew.
pub(crate) fn input_digest(input: &MaskedInput) -> [u8; 32] {
    let bytes = serde_json::to_vec(input).unwrap_or_default();
    sha2::Sha256::digest(bytes).into()
}

/// The rounds a service holds prepared, least recently used first to go.
pub struct PreparedRounds {
    rounds: HashMap<RoundKey, (u64, PreparedRound)>,
    uses: u64,
    /// Most bytes held (`MAX_PREPARED_BYTES`).
    limit: usize,
}

impl Default for PreparedRounds {
    fn default() -> Self {
        Self {
            rounds: HashMap::new(),
            uses: 0,
            limit: MAX_PREPARED_BYTES,
        }
    }
}

impl std::fmt::Debug for PreparedRounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRounds")
            .field("rounds", &self.rounds.len())
            .field("bytes", &self.held_bytes())
            .finish()
    }
}

impl PreparedRounds {
    /// Takes `key`'s round out, and forgets every other preparation of the same key and round
    /// (under another policy or length: no sums request of this round can use them now).
    pub(crate) fn take_round(&mut self, key: &RoundKey) -> Option<PreparedRound> {
        let taken = self.rounds.remove(key).map(|(_, round)| round);
        self.rounds.retain(|other, _| {
            (&other.key_id, &other.task_id, other.round) != (&key.key_id, &key.task_id, key.round)
        });
        taken
    }

    /// Keeps `round` under `key`, dropping the least recently used others while more than the
    /// limit is held (and `round` itself if it alone is more).
    fn put(&mut self, key: RoundKey, round: PreparedRound) {
        if round.bytes() > self.limit {
            tracing::warn!(task = %key.task_id, round = key.round, "a prepared round outgrew what a key service holds: dropped, its sums will be computed in full");
            return;
        }
        self.uses += 1;
        self.rounds.insert(key, (self.uses, round));
        while self.held_bytes() > self.limit {
            let Some(oldest) = self
                .rounds
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(key, _)| key.clone())
            else {
                break;
            };
            tracing::info!(task = %oldest.task_id, round = oldest.round, "a prepared round dropped to make room: its sums will be computed in full");
            self.rounds.remove(&oldest);
        }
    }

    fn held_bytes(&self) -> usize {
        self.rounds.values().map(|(_, round)| round.bytes()).sum()
    }
}

/// `POST /v1/keys/{key_id}/unmask/prepare`.
pub(crate) async fn prepare(
    State(service): State<KeyService>,
    ApiPath(key_id): ApiPath<String>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<PrepareAnswer>, ApiError> {
    let held = held(&service, &key_id)?;
    let request = PrepareRequest::decode(&body).map_err(ApiError::BadRequest)?;
    if request.inputs.is_empty() || request.inputs.len() > MAX_PREPARE_INPUTS {
        return Err(ApiError::BadRequest(format!(
            "{} inputs; a prepare request carries 1 to {MAX_PREPARE_INPUTS}",
            request.inputs.len()
        )));
    }
    let checked = check_policy(&service, held, &request.task_id, &request.policy)?;
    let masking_key = own_masking_key(&service, &checked)?;
    let layout = checked
        .policy
        .masking
        .as_ref()
        .expect("check_policy found the masking line")
        .layout();
    let values = checked_values(request.values, layout.groups_of(checked.number).len())?;
    refuse_once_agreed(&service, &request.task_id, request.round)?;
    let key = RoundKey {
        key_id,
        task_id: request.task_id.clone(),
        round: request.round,
        policy_sha256: checked.policy.sha256_hex(),
        values,
    };
    // The same queue as the sums: a sums request waits for a batch under way, and uses it.
    let permit = service
        .summing
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ApiError::Internal(format!("the sums queue closed: {e}")))?;
    // Again with the queue held: a sums request may have taken the round meanwhile.
    refuse_once_agreed(&service, &request.task_id, request.round)?;
    let prepared = service.prepared.clone();
    let inputs = request.inputs;
    let answer = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = permit;
        let opener = Opener::new(
            &checked.policy,
            checked.number,
            &masking_key,
            (&key.task_id, key.round),
            values,
        )?;
        add_inputs(&opener, &prepared, key.clone(), &inputs)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("the preparation did not finish: {e}")))??;
    metrics::counter!("confed_keyservice_mask_inputs_prepared_total").increment(answer.prepared);
    Ok(Json(answer))
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
/// the new ones' streams to `key`'s round.
fn add_inputs(
    opener: &Opener<'_>,
    prepared: &Arc<Mutex<PreparedRounds>>,
    key: RoundKey,
    inputs: &[PrepareInput],
) -> Result<PrepareAnswer, ApiError> {
    let poisoned = || ApiError::Internal("the prepared rounds' lock is poisoned".into());
    let layout = opener.layout().clone();
    let number = opener.number();
    let taken = prepared
        .lock()
        .map_err(|_| poisoned())?
        .rounds
        .remove(&key)
        .map(|(_, round)| round);
    let mut round = match taken {
        Some(round) => round,
        None => PreparedRound {
            sums: MaskSums::new(&layout, number, key.values)
                .map_err(|e| ApiError::Internal(e.to_string()))?,
            inputs: HashMap::new(),
        },
    };
    let mut answer = PrepareAnswer {
        prepared: 0,
        held: 0,
        refused: 0,
    };
    let mut fresh: Vec<(MaskedInput, [u8; 32])> = Vec::new();
    let mut in_batch = HashSet::new();
    for input in inputs {
        let Ok(masked) = input.for_service(&layout, number) else {
            answer.refused += 1;
            continue;
        };
        let digest = input_digest(&masked);
        match round.inputs.get(&masked.assignment_ref) {
            Some(kept) if kept.digest == digest => answer.held += 1,
            // Another envelope for an assignment already held: the sums request decides.
            Some(_) => answer.refused += 1,
            None if !confed_protocol::hex::is_digest_hex(&masked.assignment_ref)
                || !in_batch.insert(masked.assignment_ref.clone())
                || round.inputs.len() + fresh.len() >= MAX_PREPARED_INPUTS =>
            {
                answer.refused += 1
            }
            None => fresh.push((masked, digest)),
        }
    }
    let opened = in_order_on_threads(
        &fresh,
        sums_threads(),
        |(masked, _)| Ok(opener.open(masked)),
    )?;
    let mut streams = Vec::with_capacity(fresh.len());
    for ((masked, digest), opened) in fresh.into_iter().zip(opened) {
        match opened {
            Ok(opened) => {
                streams.push(opened.streams);
                round.inputs.insert(
                    masked.assignment_ref,
                    PreparedInput {
                        digest,
                        seeds: opened.seeds,
                    },
                );
                answer.prepared += 1;
            }
            Err(_) => answer.refused += 1,
        }
    }
    round
        .sums
        .add_many(&streams, layout.ring(), sums_threads())
        .map_err(|e| ApiError::Internal(format!("the prepared mask sums: {e}")))?;
    prepared.lock().map_err(|_| poisoned())?.put(key, round);
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_protocol::masking::Layout;

    fn key(task: &str, round: u64, values: usize) -> RoundKey {
        RoundKey {
            key_id: "k".into(),
            task_id: task.into(),
            round,
            policy_sha256: "p".into(),
            values,
        }
    }

    fn round_of(values: usize, inputs: usize) -> PreparedRound {
        let layout = Layout::new(3, 2).unwrap();
        PreparedRound {
            sums: MaskSums::new(&layout, 1, values).unwrap(),
            inputs: (0..inputs)
                .map(|i| {
                    let input = PreparedInput {
                        digest: [0; 32],
                        seeds: vec![(0, Seed::random())],
                    };
                    (format!("{i:064x}"), input)
                })
                .collect(),
        }
    }

    /// Past the limit the least recently put round goes first; a round larger than the limit
    /// alone is not kept; taking a round forgets the round's other preparations too.
    #[test]
    fn prepared_rounds_keep_within_their_limit_least_recently_used_first() {
        let one = round_of(1_000, 10).bytes();
        let mut rounds = PreparedRounds {
            limit: 2 * one + one / 2,
            ..PreparedRounds::default()
        };
        rounds.put(key("a", 1, 1_000), round_of(1_000, 10));
        rounds.put(key("b", 1, 1_000), round_of(1_000, 10));
        // "a" used again: "b" is now the least recently used.
        let a = rounds.take_round(&key("a", 1, 1_000)).unwrap();
        rounds.put(key("a", 1, 1_000), a);
        rounds.put(key("c", 1, 1_000), round_of(1_000, 10));
        assert!(rounds.held_bytes() <= rounds.limit);
        assert!(
            rounds.take_round(&key("b", 1, 1_000)).is_none(),
            "b was dropped"
        );
        assert_eq!(rounds.rounds.len(), 2);

        rounds.put(key("huge", 1, 100_000), round_of(100_000, 1));
        assert!(rounds.take_round(&key("huge", 1, 100_000)).is_none());
        assert_eq!(rounds.rounds.len(), 2, "the others stay");

        // Another length of round "c": taking one forgets both.
        rounds.put(key("c", 1, 10), round_of(10, 0));
        assert!(rounds.take_round(&key("c", 1, 1_000)).is_some());
        assert!(rounds.take_round(&key("c", 1, 10)).is_none());
        assert_eq!(rounds.rounds.len(), 1);
    }

    /// The estimate counts every value of every group and every held input.
    #[test]
    fn a_prepared_rounds_bytes_grow_with_values_and_inputs() {
        let empty = round_of(0, 0).bytes();
        assert_eq!(empty, 0);
        assert_eq!(round_of(1_000, 0).bytes(), 8_000);
        assert_eq!(
            round_of(1_000, 3).bytes(),
            8_000 + 3 * (INPUT_OVERHEAD_BYTES + HELD_SEED_BYTES)
        );
    }
}
