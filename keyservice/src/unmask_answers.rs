//! What a key service remembers of the mask sums it computed (docs/protocol.md, `POST
//! /v1/keys/{key_id}/unmask/sums`).
//!
//! With distributed noise the answer's bytes are the same on every request for an agreed set,
//! but the time its computation takes follows the noise's draws (rejection sampling): a caller
//! free to have it computed again and again could average that timing. So a repeat of a request
//! already answered is served from memory, in no time that depends on the draws, and fresh
//! computations are capped per round. Only computations that succeeded count: a request whose
//! inputs are refused costs the round nothing, so a faulty key service or an outsider cannot
//! spend an honest service's allowance with garbage.

use std::sync::{Mutex, PoisonError};

use axum::body::Bytes;

/// Most fresh computations of one round's sums by one key service in one process: an honest
/// enclave asks once per job attempt, and its repeats are served from memory while they stay.
pub(crate) const MAX_SUMS_PER_ROUND: u32 = 8;
/// Rounds whose computations are counted, most recent last (the oldest forgotten beyond this).
const COUNTED_ROUNDS: usize = 4096;
/// Answers kept for repeats, most recent last, and the largest kept (a 1 MB model's answer is
/// 1 to 30 MB).
const KEPT_ANSWERS: usize = 4;
const MAX_KEPT_BYTES: usize = 64 * 1024 * 1024;

/// One request's identity: the key service (its verifying key: several run in one process, and
/// tests reuse ids), the round, the agreed set, the vector's length and the inputs sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AnswerKey {
    pub service: Vec<u8>,
    pub task_id: String,
    pub round: u64,
    pub included_sha256: String,
    pub values: u64,
    /// SHA-256 of the request's inputs (refs, keys, tokens and sealed seeds, as sent).
    pub inputs_sha256: [u8; 32],
}

/// A key service's round: (verifying key, task, round).
type RoundKey = (Vec<u8>, String, u64);

impl AnswerKey {
    fn round_key(&self) -> RoundKey {
        (self.service.clone(), self.task_id.clone(), self.round)
    }
}

struct Answers {
    counted: Vec<(RoundKey, u32)>,
    kept: Vec<(AnswerKey, Bytes)>,
}

static ANSWERS: Mutex<Answers> = Mutex::new(Answers {
    counted: Vec::new(),
    kept: Vec::new(),
});

fn answers() -> std::sync::MutexGuard<'static, Answers> {
    // Nothing here is left half-written by a panic: a poisoned lock is still consistent.
    ANSWERS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The answer already given to this exact request, if it is still kept.
pub(crate) fn kept(key: &AnswerKey) -> Option<Bytes> {
    answers()
        .kept
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, body)| body.clone())
}

/// Whether one more fresh computation of `key`'s round is allowed; the reason if not.
pub(crate) fn may_compute(key: &AnswerKey) -> Result<(), String> {
    let round = key.round_key();
    let done = answers()
        .counted
        .iter()
        .find(|(k, _)| *k == round)
        .map_or(0, |(_, n)| *n);
    if done >= MAX_SUMS_PER_ROUND {
        return Err(format!(
            "this key service has computed round {} of task {}'s mask sums {MAX_SUMS_PER_ROUND} times, the most it will; a repeat of an answered request is served while it is kept",
            key.round, key.task_id
        ));
    }
    Ok(())
}

/// Records a successful computation of `key` and keeps its answer for repeats.
pub(crate) fn computed(key: AnswerKey, body: Bytes) {
    let mut answers = answers();
    let round = key.round_key();
    match answers.counted.iter_mut().find(|(k, _)| *k == round) {
        Some((_, done)) => *done += 1,
        None => {
            if answers.counted.len() >= COUNTED_ROUNDS {
                answers.counted.remove(0);
            }
            answers.counted.push((round, 1));
        }
    }
    if body.len() <= MAX_KEPT_BYTES {
        answers.kept.retain(|(k, _)| *k != key);
        if answers.kept.len() >= KEPT_ANSWERS {
            answers.kept.remove(0);
        }
        answers.kept.push((key, body));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(service: u8, round: u64, inputs: u8) -> AnswerKey {
        AnswerKey {
            service: vec![service; 65],
            task_id: "task-count".into(),
            round,
            included_sha256: "ab".repeat(32),
            values: 10,
            inputs_sha256: [inputs; 32],
        }
    }

    #[test]
    fn a_rounds_sums_are_computed_at_most_eight_times_and_repeats_are_served_from_memory() {
        let first = key(201, 3, 1);
        assert_eq!(kept(&first), None);
        for n in 0..MAX_SUMS_PER_ROUND {
            may_compute(&first).unwrap();
            computed(key(201, 3, n as u8), Bytes::from(vec![n as u8; 8]));
        }
        assert!(
            may_compute(&first)
                .unwrap_err()
                .contains("8 times, the most it will")
        );
        // The last answers are served again, byte for byte; an evicted one is not.
        assert_eq!(kept(&key(201, 3, 7)), Some(Bytes::from(vec![7u8; 8])));
        assert_eq!(kept(&key(201, 3, 0)), None);
        // Another service of the process, or another round, counts apart.
        may_compute(&key(202, 3, 1)).unwrap();
        may_compute(&key(201, 4, 1)).unwrap();
    }
}
