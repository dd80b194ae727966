//! The BLT state a round leaves for the next, sealed (docs/protocol.md, "Sealed BLT state").
//!
//! The strategy buffers are linear combinations of past un-noised sums: they leave the enclave
//! only encrypted, under AES-256-GCM with a key only an enclave holding the task's private key can
//! derive (`HMAC-SHA256(private key, "confed/blt-state/v1" 0x00 task 0x00 policy hash 0x00)`).
//! The header is the associated data: which task, policy and round sealed it, over which inputs,
//! and its shape. Round `t` opens only a state sealed by round `t - 1` of its task and policy, and
//! binds the sealed bytes' BLAKE3 into its release commitment (`inputs::bind_blt_state`): the key
//! services' ledger admits one commitment per round, so each round continues exactly one state,
//! the one round `t - 1` released with, and no rolled-back or forked state can be continued.
//!
//! ```text
//! "confed-blt-state/v1\n" || u32 BE header length || header (JSON) || nonce (12) || ciphertext || tag (16)
//! ```
//!
//! The plaintext is every value's strategy buffers (`buffers` i128, little endian) then every
//! value's inverse buffers (`inverse_buffers` f64 bit patterns, little endian). The nonce is
//! synthetic (as in SIV): the first 12 bytes of `BLAKE3-keyed(nonce key, associated data ||
//! plaintext)`, the nonce key `HMAC-SHA256(private key, "confed/blt-state-nonce/v1" 0x00 task 0x00
//! policy hash 0x00)`. A nonce repeats only for the same header and buffers, which sealing then
//! maps to the same bytes: a retried round (whose state is a function of its commitment) seals
//! byte for byte what the first attempt did, so its manifest, which names the state's BLAKE3, is
//! the same too, and the write-once release it staged before a crash can still be committed.

use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroize::Zeroizing;

use super::sealed::{Kind, SealedError};
use crate::dp::blt::BltState;
use crate::hpke::PrivateKey;

const KIND: Kind = Kind {
    magic: b"confed-blt-state/v1\n",
    key_label: b"confed/blt-state/v1",
    nonce_label: b"confed/blt-state-nonce/v1",
    // A header is a few hundred bytes; anything longer is not one.
    max_header: 4096,
};

#[derive(Debug, Error, PartialEq)]
pub enum StateError {
    #[error("the BLT state is malformed: {0}")]
    Malformed(String),
    #[error("the BLT state does not continue this round: {0}")]
    Mismatch(String),
    #[error("the BLT state was not sealed by an enclave of this task (authentication failed)")]
    Unauthentic,
}

/// Who sealed a state, over what, and its shape (public: the associated data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateHeader {
    pub task_id: String,
    pub policy_sha256: String,
    /// The round that left it.
    pub round: u64,
    /// That round's bound inputs digest (its release commitment's).
    pub inputs_digest: String,
    pub values: u64,
    pub buffers: u32,
    pub inverse_buffers: u32,
}

/// What the round about to run expects of the state it continues.
#[derive(Debug, Clone, PartialEq)]
pub struct Continuing<'a> {
    pub task_id: &'a str,
    pub policy_sha256: &'a str,
    /// The round about to run (so the state must be round `round - 1`'s).
    pub round: u64,
    pub values: u64,
    pub buffers: u32,
    pub inverse_buffers: u32,
}

impl StateHeader {
    fn body_len(&self) -> Result<usize, StateError> {
        let per_value = u64::from(self.buffers) * 16 + u64::from(self.inverse_buffers) * 8;
        self.values
            .checked_mul(per_value)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| StateError::Malformed("its shape overflows".into()))
    }

    /// Refuses a state that is not round `expected.round - 1`'s of this task, policy and shape.
    pub fn check_continues(&self, expected: &Continuing<'_>) -> Result<(), StateError> {
        let mismatch = |what: String| Err(StateError::Mismatch(what));
        if self.task_id != expected.task_id || self.policy_sha256 != expected.policy_sha256 {
            return mismatch(format!(
                "it is task {}'s under policy {}, the round task {}'s under policy {}",
                self.task_id, self.policy_sha256, expected.task_id, expected.policy_sha256
            ));
        }
        if self.round.checked_add(1) != Some(expected.round) {
            return mismatch(format!(
                "round {} left it, and round {} continues only round {}'s",
                self.round,
                expected.round,
                expected.round.saturating_sub(1)
            ));
        }
        let shape = (self.values, self.buffers, self.inverse_buffers);
        let wanted = (expected.values, expected.buffers, expected.inverse_buffers);
        if shape != wanted {
            return mismatch(format!(
                "it holds (values, buffers, inverse buffers) {shape:?}, the round needs {wanted:?}"
            ));
        }
        Ok(())
    }
}

impl From<SealedError> for StateError {
    fn from(error: SealedError) -> Self {
        match error {
            SealedError::Malformed(why) => Self::Malformed(why),
            SealedError::Unauthentic => Self::Unauthentic,
        }
    }
}

/// The header of a sealed state and the length of the associated data (everything before the
/// nonce), without opening it: what can be checked before the key is asked for.
pub fn read_header(sealed: &[u8]) -> Result<(StateHeader, usize), StateError> {
    let (json, ad_len) = KIND.header(sealed)?;
    let header: StateHeader = serde_json::from_slice(json)
        .map_err(|e| StateError::Malformed(format!("its header is not valid: {e}")))?;
    KIND.check_body_len(sealed, ad_len, header.body_len()?)?;
    Ok((header, ad_len))
}

/// Seals `state` under `header` (the round that leaves it).
pub fn seal(
    private_key: &PrivateKey,
    header: &StateHeader,
    state: &BltState,
) -> Result<Vec<u8>, StateError> {
    let header_json = serde_json::to_vec(header).expect("a header serializes");
    let body_len = header.body_len()?;
    let shape_ok = state.strategy.len() as u64 == header.values * u64::from(header.buffers)
        && state.release.len() as u64 == header.values * u64::from(header.inverse_buffers);
    if !shape_ok {
        return Err(StateError::Malformed(
            "the state does not have its header's shape".into(),
        ));
    }
    // Room for the tag, so sealing in place does not reallocate (and leave a copy unwiped).
    let mut body = Zeroizing::new(Vec::with_capacity(body_len + 16));
    for b in &state.strategy {
        body.extend_from_slice(&b.to_le_bytes());
    }
    for s in &state.release {
        body.extend_from_slice(&s.to_bits().to_le_bytes());
    }
    Ok(KIND.seal(private_key, &context(header), &header_json, body)?)
}

/// Who may open a state: an enclave holding the task's private key, for its task and policy.
fn context(header: &StateHeader) -> [&[u8]; 2] {
    [header.task_id.as_bytes(), header.policy_sha256.as_bytes()]
}

/// Opens a sealed state that continues into `expected` (its header checked first).
pub fn open(
    private_key: &PrivateKey,
    sealed: &[u8],
    expected: &Continuing<'_>,
) -> Result<BltState, StateError> {
    let (header, ad_len) = read_header(sealed)?;
    header.check_continues(expected)?;
    let plain = KIND.open(private_key, &context(&header), sealed, ad_len)?;
    let strategy_len = header.values as usize * header.buffers as usize;
    let (strategy, release) = plain.split_at(strategy_len * 16);
    Ok(BltState {
        strategy: strategy
            .chunks_exact(16)
            .map(|b| i128::from_le_bytes(b.try_into().expect("16 bytes")))
            .collect(),
        release: release
            .chunks_exact(8)
            .map(|b| f64::from_bits(u64::from_le_bytes(b.try_into().expect("8 bytes"))))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> PrivateKey {
        PrivateKey::from_bytes(&[byte; 32]).unwrap()
    }

    fn header(round: u64) -> StateHeader {
        StateHeader {
            task_id: "t1".into(),
            policy_sha256: "ab".repeat(32),
            round,
            inputs_digest: "cd".repeat(32),
            values: 3,
            buffers: 2,
            inverse_buffers: 2,
        }
    }

    fn next(round: u64) -> Continuing<'static> {
        Continuing {
            task_id: "t1",
            policy_sha256: Box::leak("ab".repeat(32).into_boxed_str()),
            round,
            values: 3,
            buffers: 2,
            inverse_buffers: 2,
        }
    }

    fn state() -> BltState {
        BltState {
            strategy: vec![1, -2, i128::MAX, i128::MIN, 5 << 90, -7],
            release: vec![0.5, -1e300, f64::MIN_POSITIVE, 3.0, -0.0, 1e-12],
        }
    }

    #[test]
    fn a_sealed_state_opens_in_the_next_round_only() {
        let sealed = seal(&key(1), &header(4), &state()).unwrap();
        assert_eq!(open(&key(1), &sealed, &next(5)).unwrap(), state());
        for round in [4, 6, 1] {
            assert!(
                matches!(
                    open(&key(1), &sealed, &next(round)),
                    Err(StateError::Mismatch(_))
                ),
                "round {round}"
            );
        }
        let mut other_task = next(5);
        other_task.task_id = "t2";
        assert!(matches!(
            open(&key(1), &sealed, &other_task),
            Err(StateError::Mismatch(_))
        ));
        let mut other_shape = next(5);
        other_shape.values = 4;
        assert!(matches!(
            open(&key(1), &sealed, &other_shape),
            Err(StateError::Mismatch(_))
        ));
    }

    #[test]
    fn another_key_a_changed_byte_or_a_rewritten_header_fails_authentication() {
        let sealed = seal(&key(1), &header(4), &state()).unwrap();
        assert_eq!(
            open(&key(2), &sealed, &next(5)),
            Err(StateError::Unauthentic)
        );
        let mut flipped = sealed.clone();
        let last = flipped.len() - 20;
        flipped[last] ^= 1;
        assert_eq!(
            open(&key(1), &flipped, &next(5)),
            Err(StateError::Unauthentic)
        );
        // The header says round 5 left it (so round 6 would take it): the AEAD refuses.
        let mut rewritten = sealed.clone();
        let at = rewritten
            .windows(9)
            .position(|w| w == b"\"round\":4")
            .unwrap();
        rewritten[at + 8] = b'5';
        assert_eq!(
            open(&key(1), &rewritten, &next(6)),
            Err(StateError::Unauthentic)
        );
    }

    #[test]
    fn sealing_is_deterministic_so_a_retried_round_seals_the_same_bytes() {
        let once = seal(&key(1), &header(4), &state()).unwrap();
        assert_eq!(seal(&key(1), &header(4), &state()).unwrap(), once);
        // Any other buffers, header or key: another nonce, other bytes.
        let mut other = state();
        other.strategy[0] += 1;
        let nonce = |sealed: &[u8]| {
            let (_, ad_len) = read_header(sealed).unwrap();
            sealed[ad_len..ad_len + ring::aead::NONCE_LEN].to_vec()
        };
        let changed = seal(&key(1), &header(4), &other).unwrap();
        assert_ne!(nonce(&changed), nonce(&once));
        assert_ne!(
            nonce(&seal(&key(1), &header(5), &state()).unwrap()),
            nonce(&once)
        );
        assert_ne!(
            nonce(&seal(&key(2), &header(4), &state()).unwrap()),
            nonce(&once)
        );
    }

    /// A sealed state with `header` (any JSON text) and `body` bytes after it.
    fn framed(header: &str, body: usize) -> Vec<u8> {
        let mut out = KIND.magic.to_vec();
        out.extend_from_slice(&(header.len() as u32).to_be_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend(std::iter::repeat_n(0u8, body));
        out
    }

    #[test]
    fn truncated_or_foreign_bytes_are_malformed_not_a_panic() {
        let sealed = seal(&key(1), &header(1), &state()).unwrap();
        for cut in [
            0,
            5,
            KIND.magic.len() + 2,
            KIND.magic.len() + 30,
            sealed.len() - 1,
        ] {
            assert!(
                matches!(read_header(&sealed[..cut]), Err(StateError::Malformed(_))),
                "cut at {cut}"
            );
        }
        assert!(matches!(
            read_header(b"something else entirely"),
            Err(StateError::Malformed(_))
        ));
        // A header naming a shape whose length overflows, an unknown field, an overlong header.
        let fields = |values: &str, extra: &str| {
            format!(
                r#"{{"task_id":"t1","policy_sha256":"p","round":1,"inputs_digest":"d","values":{values},"buffers":10,"inverse_buffers":10{extra}}}"#
            )
        };
        for (text, body) in [
            (fields(&(u64::MAX / 240).to_string(), ""), 8),
            (fields("2305843009213693951", ""), 20),
            (fields("1", r#","x":1"#), 268),
            (format!("{:<5000}", fields("1", "")), 268),
        ] {
            assert!(
                matches!(
                    read_header(&framed(&text, body)),
                    Err(StateError::Malformed(_))
                ),
                "{text:.80}"
            );
        }
        let mut wrong_shape = header(1);
        wrong_shape.values = 4;
        assert!(matches!(
            seal(&key(1), &wrong_shape, &state()),
            Err(StateError::Malformed(_))
        ));
    }
}
