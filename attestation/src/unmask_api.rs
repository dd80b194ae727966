//! The key services' unmask endpoints' messages (docs/protocol.md, `POST
//! /v1/keys/{key_id}/unmask/agree` and `.../sums`), shared by the key services (which decode
//! them) and the enclave (which sends them). JSON; binary values base64url without padding.
//!
//! - `POST /v1/keys/{key_id}/unmask/agree` with an `AgreeRequest`: the key service signs an
//!   `UnmaskReceipt` for the round's included set, one set per round.
//! - `POST /v1/keys/{key_id}/unmask/sums` with a `SumsRequest`: against receipts of
//!   `agreement(t, n)` key services for the set it agreed to, and a verified device token over
//!   each input's seeds, the key service answers its groups' mask sums as
//!   `application/octet-stream`: for each of its groups in group order, `values` little-endian
//!   u64.
//! - `POST /v1/keys/{key_id}/unmask/prepare` with a `PrepareRequest`, while the round collects:
//!   the key service checks and opens the uploaded inputs' seeds and adds their streams ahead,
//!   so that the sums request, later, only corrects for the inputs the agreed set leaves out or
//!   adds (docs/secure-aggregation.md, "Prepared sums"). Its inputs are the sums request's
//!   (`MaskedInput`, this service's item of the seeds and every item's digest). It releases
//!   nothing.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};

use crate::unmask::UnmaskReceipt;

/// Most inputs one round's unmask names (the sums request carries each input's token and
/// seeds: about 1 KB each, within the route's body limit).
pub const MAX_UNMASK_INPUTS: usize = 60_000;

/// Which round and release an unmask request is for, and the task policy that names the
/// masking layout (its SHA-256 must be the one the release ledger pinned).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnmaskRound {
    pub task_id: String,
    pub round: u64,
    /// `ReleaseCommitment::digest` of the round's admitted commitment.
    pub commitment_sha256: String,
    /// The task policy text.
    pub policy: String,
}

/// `POST /v1/keys/{key_id}/unmask/agree`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgreeRequest {
    #[serde(flatten)]
    pub round: UnmaskRound,
    /// The included refs, sorted ascending, each once.
    pub included: Vec<String>,
}

/// One included input as a key service needs it to add its masks: its token, the envelope's
/// encapsulated key, this service's sealed seeds and every service's sealed-seeds digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MaskedInput {
    pub assignment_ref: String,
    /// The envelope's `enc`, base64url.
    pub enc: String,
    /// The envelope's `token`, base64url.
    pub token: String,
    /// This key service's item of the envelope's `seeds` (`enc_j || ct_j`), base64url.
    pub seeds: String,
    /// SHA-256 of every key service's item, service 1 first, lowercase hex (this service's
    /// own is checked against `seeds`).
    pub seeds_digests: Vec<String>,
}

/// `POST /v1/keys/{key_id}/unmask/sums`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SumsRequest {
    #[serde(flatten)]
    pub round: UnmaskRound,
    /// The masked vector's length (the model's values).
    pub values: u64,
    /// Receipts of at least `agreement(t, n)` key services for the included set.
    pub receipts: Vec<UnmaskReceipt>,
    /// Every included input, sorted by ref.
    pub inputs: Vec<MaskedInput>,
}

/// Most inputs one prepare request carries.
pub const MAX_PREPARE_INPUTS: usize = 4_096;
/// Most stream values (inputs x groups x values) one prepare request expands: about a second
/// of one core's AES. A front end sizes its batches to fit (`prepare_batch_inputs`).
pub const MAX_PREPARE_WORK: u64 = 1 << 30;

/// How many inputs a prepare request for vectors of `values` values may carry to a key service
/// in `groups` groups: within `MAX_PREPARE_WORK` and `MAX_PREPARE_INPUTS`, at least one.
pub fn prepare_batch_inputs(values: u64, groups: usize) -> usize {
    let per_input = values.saturating_mul(groups as u64).max(1);
    usize::try_from(MAX_PREPARE_WORK / per_input)
        .unwrap_or(usize::MAX)
        .clamp(1, MAX_PREPARE_INPUTS)
}

/// `POST /v1/keys/{key_id}/unmask/prepare`: inputs uploaded to a masked round that has no
/// agreed set yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareRequest {
    pub task_id: String,
    pub round: u64,
    /// The task policy text (its SHA-256 must be the one the round's unmask requests carry
    /// for the preparation to be used).
    pub policy: String,
    /// The masked vector's length (the model's values).
    pub values: u64,
    /// Uploaded inputs, each as the sums request names it for this key service.
    pub inputs: Vec<MaskedInput>,
}

/// A prepare request's answer: how many inputs were added now, were held already, or were
/// refused (a refused input is simply computed, or refused, by the sums request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrepareAnswer {
    pub prepared: u64,
    pub held: u64,
    pub refused: u64,
}

fn decode<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, String> {
    let mut json = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut json)
        .map_err(|e| format!("not {what}: `{}`: {}", e.path(), e.inner()))
}

impl AgreeRequest {
    pub fn decode(body: &[u8]) -> Result<Self, String> {
        decode(body, "an unmask agreement request")
    }
}

impl PrepareRequest {
    pub fn decode(body: &[u8]) -> Result<Self, String> {
        decode(body, "an unmask prepare request")
    }
}

impl SumsRequest {
    pub fn decode(body: &[u8]) -> Result<Self, String> {
        decode(body, "a mask sums request")
    }
}

/// An input's fields, decoded.
pub struct DecodedInput {
    pub enc: Vec<u8>,
    pub token: Vec<u8>,
    pub seeds: Vec<u8>,
    pub seeds_digests: Vec<[u8; 32]>,
}

impl MaskedInput {
    pub fn decode(&self) -> Result<DecodedInput, String> {
        let field = |name: &str, text: &str| {
            URL_SAFE_NO_PAD
                .decode(text)
                .map_err(|_| format!("input {}: `{name}` is not base64url", self.assignment_ref))
        };
        let seeds_digests = self
            .seeds_digests
            .iter()
            .map(|hex| {
                confed_protocol::hex::parse_digest(hex).ok_or_else(|| {
                    format!(
                        "input {}: a seeds digest is not 64 hex digits",
                        self.assignment_ref
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(DecodedInput {
            enc: field("enc", &self.enc)?,
            token: field("token", &self.token)?,
            seeds: field("seeds", &self.seeds)?,
            seeds_digests,
        })
    }

    /// The input as the enclave sends it to key service `service` (1 to n): the envelope's
    /// fields and `seeds` cut by the layout.
    pub fn of_envelope(
        assignment_ref: &str,
        enc: &[u8],
        token: &[u8],
        items: &[&[u8]],
        service: u8,
    ) -> Self {
        Self {
            assignment_ref: assignment_ref.to_string(),
            enc: URL_SAFE_NO_PAD.encode(enc),
            token: URL_SAFE_NO_PAD.encode(token),
            seeds: URL_SAFE_NO_PAD.encode(items[usize::from(service) - 1]),
            seeds_digests: items
                .iter()
                .map(|item| {
                    confed_protocol::hex::encode(
                        confed_protocol::privacy_pass::context::seeds_digest(item),
                    )
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch stays within a request's work (inputs x groups x values) and input count, and
    /// holds at least one input however large the model.
    #[test]
    fn prepare_batches_fit_a_requests_work() {
        assert_eq!(prepare_batch_inputs(262_144, 1), MAX_PREPARE_INPUTS);
        assert_eq!(prepare_batch_inputs(262_144, 15), 273);
        const { assert!(273 * 15 * 262_144 <= MAX_PREPARE_WORK) };
        assert_eq!(prepare_batch_inputs(u64::MAX, 20), 1);
        assert_eq!(prepare_batch_inputs(0, 0), MAX_PREPARE_INPUTS);
    }
}
