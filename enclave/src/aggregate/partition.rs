//! One round aggregated in partitions (docs/architecture.md, "Partitioned rounds"; the format in
//! docs/protocol.md, "Sealed partition"): the round's committed inputs, sorted by ref as their
//! digest is (`inputs`), are cut into `count` consecutive ranges; a worker holding the round's key
//! (obtained against the round's one commitment) opens, checks, clips and sums one range exactly
//! on the grid and seals that exact state (`seal`); the root opens every range's sealed state,
//! checks that together they are the plan's ranges, each exactly once, and adds them into one
//! aggregator (`merge`), which then noises once and releases (`Aggregator::finish`).
//!
//! The merged aggregator holds exactly what one worker adding every input would: the same
//! integer sums (integer addition does not care about order or grouping), the same outcome per
//! ref, the same counts; so the release, noise keyed by the round's inputs digest as ever, is
//! byte for byte the one-worker release, whatever the partitioning. Nothing in it names the
//! partitioning.
//!
//! What a sealed partition holds is un-noised: it leaves the enclave only in the sealed
//! container (`sealed`), under a key only an enclave holding the task's private key derives.
//! Its length depends on the model (or query, or masking policy) and the range only (an outcome
//! is one byte per input, whatever it is), never on what the devices sent.
//!
//! Training's aggregator, the analytics table (`analytics::partition`) and a masked round's
//! aggregator (`masked::partition`) all seal and merge through `Partial`: the header, its checks,
//! the outcomes and the container are this module's; each kind lays out and absorbs its own
//! exact state.

use std::ops::Range;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroize::Zeroizing;

use super::inputs::{self, Input};
use super::sealed::{Kind, SealedError};
use super::{Aggregator, Binding, Exclusion, Outcome};
use crate::hpke::PrivateKey;

const KIND: Kind = Kind {
    magic: b"confed-partition/v1\n",
    key_label: b"confed/partition/v1",
    nonce_label: b"confed/partition-nonce/v1",
    max_header: 4096,
};

pub use confed_worker_api::store::MAX_PARTITIONS;

/// An outcome byte: included.
pub(crate) const INCLUDED: u8 = 0;

#[derive(Debug, Error, PartialEq)]
pub enum PartitionError {
    #[error("the partition plan is not valid: {0}")]
    Plan(String),
    #[error("a sealed partition is malformed: {0}")]
    Malformed(String),
    #[error("a sealed partition was not sealed by an enclave of this task (authentication failed)")]
    Unauthentic,
    #[error("a sealed partition is not one of this round's plan: {0}")]
    Foreign(String),
    #[error("partition {index} of {count} is sealed twice")]
    Duplicate { index: u32, count: u32 },
    #[error("partitions {missing:?} of {count} are missing")]
    Missing { missing: Vec<u32>, count: u32 },
    #[error("the sealed partition {0} the job lists is not in the store")]
    NotStored(String),
    #[error("the aggregator did not add exactly its partition's inputs: {0}")]
    Incomplete(String),
}

impl From<SealedError> for PartitionError {
    fn from(error: SealedError) -> Self {
        match error {
            SealedError::Malformed(why) => Self::Malformed(why),
            SealedError::Unauthentic => Self::Unauthentic,
        }
    }
}

/// The ranges of `count` partitions over `inputs` inputs sorted by ref: consecutive, covering
/// every input once, their lengths differing by at most one (partition `i` is `[i n / count,
/// (i + 1) n / count)`). A round of no input has one empty partition.
pub fn ranges(inputs: usize, count: u32) -> Result<Vec<Range<usize>>, PartitionError> {
    if count == 0 || count > MAX_PARTITIONS || count as usize > inputs.max(1) {
        return Err(PartitionError::Plan(format!(
            "{count} partitions of {inputs} inputs (at least 1, at most the inputs and {MAX_PARTITIONS})"
        )));
    }
    let count = count as usize;
    Ok((0..count)
        .map(|i| i * inputs / count..(i + 1) * inputs / count)
        .collect())
}

/// Partition `index` of `count`'s range of `inputs` inputs sorted by ref (`ranges`).
pub fn range(inputs: usize, index: u32, count: u32) -> Result<Range<usize>, PartitionError> {
    ranges(inputs, count)?
        .get(index as usize)
        .cloned()
        .ok_or_else(|| PartitionError::Plan(format!("partition {index} of {count}")))
}

/// Which partition of which round a sealed partition is (public: the associated data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionHeader {
    pub task_id: String,
    pub round: u64,
    pub key_id: String,
    pub policy_sha256: String,
    pub model_sha256: String,
    /// The round's bound inputs digest: its release commitment's.
    pub inputs_digest: String,
    /// This partition's index, of `count`.
    pub index: u32,
    pub count: u32,
    /// Its range of the round's inputs sorted by ref, `[first, end)`.
    pub first: u64,
    pub end: u64,
    /// `inputs::inputs_digest` over the range's inputs alone.
    pub range_digest: String,
    /// The model's values.
    pub values: u64,
    /// Whether it holds an evaluation round's metric sums.
    pub evaluation: bool,
    /// Whether it holds the health count (a policy naming `health`). Left out when false, so a
    /// header without it reads as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub health: bool,
    /// An analytics round's table in place of the sum (`values` is then 0). Left out for
    /// training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<TableShape>,
    /// A masked round's partition: the bytes of each input's slot (what the key services need
    /// of it: `masked::slot_bytes`) after its wrapping sum and outcomes. Left out otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masked_slot_bytes: Option<u64>,
}

/// An analytics round's exact table as a sealed partition holds it (docs/protocol.md, "Sealed
/// partition"): fixed by the query and the range's length, never by what devices sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableShape {
    /// A closed domain's keys or the quantile tree's nodes; an open domain's key capacity.
    pub slots: u64,
    /// Bytes a slot: 8 (a count), or for an open domain 1 + `max_key_bytes` + 8.
    pub slot_bytes: u64,
    /// An open domain's table: 9 bytes (the slots used, whether the table filled) come first.
    pub open: bool,
}

impl TableShape {
    /// Bytes before the slots of an open domain's table.
    pub const OPEN_PREAMBLE: u64 = 9;

    fn len(&self) -> Option<u64> {
        let preamble = if self.open { Self::OPEN_PREAMBLE } else { 0 };
        self.slots
            .checked_mul(self.slot_bytes)?
            .checked_add(preamble)
    }
}

/// What a header says of a partition's state, besides whose round and range it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub values: u64,
    pub evaluation: bool,
    pub health: bool,
    pub table: Option<TableShape>,
    pub masked_slot_bytes: Option<u64>,
}

impl PartitionHeader {
    /// The plaintext's length: one outcome byte an input, and for training the sum (8 bytes a
    /// value), the unclipped count (8), the metric sums (24) if evaluating, the health count (8)
    /// if counting; for analytics the table; for a masked round the wrapping sum (8 bytes a
    /// value) and one slot an input.
    fn body_len(&self) -> Result<usize, PartitionError> {
        let malformed = || PartitionError::Malformed("its shape overflows".into());
        let inputs = self.end.checked_sub(self.first).ok_or_else(malformed)?;
        let state = match (&self.table, self.masked_slot_bytes) {
            (Some(table), _) => table.len(),
            (None, Some(slot)) => self
                .values
                .checked_mul(8)
                .and_then(|n| n.checked_add(inputs.checked_mul(slot)?)),
            (None, None) => self
                .values
                .checked_mul(8)
                .and_then(|n| n.checked_add(8 + if self.evaluation { 24 } else { 0 }))
                .and_then(|n| n.checked_add(if self.health { 8 } else { 0 })),
        };
        state
            .and_then(|n| n.checked_add(inputs))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(malformed)
    }

    /// The state's shape the header names.
    fn shape(&self) -> Shape {
        Shape {
            values: self.values,
            evaluation: self.evaluation,
            health: self.health,
            table: self.table,
            masked_slot_bytes: self.masked_slot_bytes,
        }
    }

    fn context(&self) -> [&[u8]; 2] {
        [self.task_id.as_bytes(), self.policy_sha256.as_bytes()]
    }
}

/// A merge in progress (`Aggregator::start_merge`): which of the plan's partitions came in.
#[derive(Debug)]
pub struct Merge {
    count: u32,
    seen: Vec<bool>,
}

impl Merge {
    /// Ends the merge: every partition of the plan must have come in.
    pub fn end(self) -> Result<(), PartitionError> {
        let missing: Vec<u32> = (0..self.count)
            .filter(|i| !self.seen[*i as usize])
            .collect();
        if !missing.is_empty() {
            return Err(PartitionError::Missing {
                missing,
                count: self.count,
            });
        }
        Ok(())
    }
}

/// One partition of a round: the round's inputs, sorted by ref (`inputs::sort_and_digest`), and
/// the plan's partition `index` of `count`.
pub struct Partition<'a> {
    pub inputs: &'a [Input],
    pub index: u32,
    pub count: u32,
}

impl Partition<'_> {
    fn range(&self) -> Result<Range<usize>, PartitionError> {
        ranges(self.inputs.len(), self.count)?
            .get(self.index as usize)
            .cloned()
            .ok_or_else(|| {
                PartitionError::Plan(format!("partition {} of {}", self.index, self.count))
            })
    }

    /// The inputs this partition sums.
    pub fn inputs(&self) -> Result<&[Input], PartitionError> {
        Ok(&self.inputs[self.range()?])
    }

    /// The header a sealed partition of this round and plan must have.
    fn header<A: Partial>(&self, aggregator: &A) -> Result<PartitionHeader, PartitionError> {
        let range = self.range()?;
        let binding = aggregator.binding();
        let shape = aggregator.shape(range.len());
        Ok(PartitionHeader {
            task_id: binding.context.task_id.clone(),
            round: binding.context.round,
            key_id: binding.key_id.clone(),
            policy_sha256: binding.context.policy_sha256.clone(),
            model_sha256: binding.context.model_sha256.clone(),
            inputs_digest: binding.inputs_digest.clone(),
            index: self.index,
            count: self.count,
            first: range.start as u64,
            end: range.end as u64,
            range_digest: inputs::inputs_digest(
                self.inputs[range]
                    .iter()
                    .map(|i| (i.assignment_ref.as_str(), i.digest.as_ref())),
            ),
            values: shape.values,
            evaluation: shape.evaluation,
            health: shape.health,
            table: shape.table,
            masked_slot_bytes: shape.masked_slot_bytes,
        })
    }
}

/// An aggregator whose exact state one partition seals and the root merges: training's
/// `Aggregator`, analytics' table and the masked `MaskedAggregator`. The header, its checks, the outcomes and the container
/// are shared (the provided methods); each kind lays out and adds its own state.
pub trait Partial: Sized + Send + Sync + 'static {
    /// The round this aggregator is bound to.
    fn binding(&self) -> &Binding;

    /// The state's shape for a range of `inputs` contributions.
    fn shape(&self, inputs: usize) -> Shape;

    /// Its included and excluded contributions so far.
    fn outcome(&self) -> &Mutex<Outcome>;

    /// The plaintext of a sealed partition: the exact state with `outcomes` (one byte an
    /// input) in this kind's layout, exactly `shape`'s length.
    fn into_body(
        self,
        outcomes: &[u8],
        shape: &Shape,
    ) -> Result<Zeroizing<Vec<u8>>, PartitionError>;

    /// Adds an opened plaintext's state (its length checked against `shape` already) and
    /// returns its `inputs` outcome bytes.
    fn absorb_state<'p>(
        &self,
        plain: &'p [u8],
        inputs: usize,
        shape: &Shape,
    ) -> Result<&'p [u8], PartitionError>;

    /// Seals the exact state after this aggregator added `partition`'s inputs, every one of
    /// them and nothing else, for the root's `merge`. Consumes the aggregator: its state leaves
    /// only sealed.
    fn seal_partition(
        self,
        private_key: &PrivateKey,
        partition: &Partition<'_>,
    ) -> Result<Vec<u8>, PartitionError> {
        let header = partition.header(&self)?;
        let header_json = serde_json::to_vec(&header).expect("a header serializes");
        let outcome = std::mem::take(&mut *self.outcome().lock().expect("aggregation outcome"));
        let outcomes = outcome_bytes(outcome, partition.inputs()?)?;
        let body = self.into_body(&outcomes, &header.shape())?;
        if body.len() != header.body_len()? {
            return Err(PartitionError::Incomplete(format!(
                "its state is {} bytes, its header says {}",
                body.len(),
                header.body_len()?
            )));
        }
        Ok(KIND.seal(private_key, &header.context(), &header_json, body)?)
    }

    /// The root's step, whole: `start_merge`, `merge_one` for each of `sealed`, `Merge::end`.
    #[cfg(test)]
    fn merge(
        &self,
        private_key: &PrivateKey,
        inputs: &[Input],
        count: u32,
        sealed: &[Vec<u8>],
    ) -> Result<(), PartitionError> {
        let mut merge = self.start_merge(inputs.len(), count)?;
        for bytes in sealed {
            self.merge_one(&mut merge, private_key, inputs, bytes)?;
        }
        merge.end()
    }

    /// Starts the root's merge of the round's plan (`inputs` contributions sorted by ref, cut
    /// into `count`) into this aggregator, which must have added nothing itself. Each partition
    /// then comes in with `merge_one`, one at a time (the root holds one sealed partition in
    /// memory, not all), and `Merge::end` checks none is missing. After any error the
    /// aggregator must be dropped.
    fn start_merge(&self, inputs: usize, count: u32) -> Result<Merge, PartitionError> {
        let outcome = self.outcome().lock().expect("aggregation outcome");
        if !outcome.included.is_empty() || !outcome.excluded.is_empty() {
            return Err(PartitionError::Incomplete(
                "the root merged into an aggregator that had added inputs itself".into(),
            ));
        }
        Ok(Merge {
            count,
            seen: vec![false; ranges(inputs, count)?.len()],
        })
    }

    /// Adds one sealed partition of the merge's plan: refused if it is sealed twice, of another
    /// plan, round, task, policy, model, key, inputs or kind of state, or not sealed by an
    /// enclave of this task.
    fn merge_one(
        &self,
        merge: &mut Merge,
        private_key: &PrivateKey,
        inputs: &[Input],
        bytes: &[u8],
    ) -> Result<(), PartitionError> {
        let count = merge.count;
        let (json, ad_len) = KIND.header(bytes)?;
        let header: PartitionHeader = serde_json::from_slice(json)
            .map_err(|e| PartitionError::Malformed(format!("its header is not valid: {e}")))?;
        KIND.check_body_len(bytes, ad_len, header.body_len()?)?;
        let slot = merge
            .seen
            .get_mut(header.index as usize)
            .filter(|_| header.count == count);
        let Some(slot) = slot else {
            return Err(PartitionError::Foreign(format!(
                "partition {} of {}, the round's plan has {count}",
                header.index, header.count
            )));
        };
        if std::mem::replace(slot, true) {
            return Err(PartitionError::Duplicate {
                index: header.index,
                count,
            });
        }
        let partition = Partition {
            inputs,
            index: header.index,
            count,
        };
        let expected = partition.header(self)?;
        if header != expected {
            return Err(PartitionError::Foreign(foreign(&header, &expected)));
        }
        let plain = KIND.open(private_key, &header.context(), bytes, ad_len)?;
        let range = partition.inputs()?;
        let outcomes = self.absorb_state(&plain, range.len(), &header.shape())?;
        record_outcomes(self.outcome(), outcomes, range)
    }
}

impl Partial for Aggregator {
    fn binding(&self) -> &Binding {
        &self.binding
    }

    fn shape(&self, _inputs: usize) -> Shape {
        Shape {
            values: self.schema.parameter_count() as u64,
            evaluation: self.evaluation.is_some(),
            health: self.health.is_some(),
            table: None,
            masked_slot_bytes: None,
        }
    }

    fn outcome(&self) -> &Mutex<Outcome> {
        &self.outcome
    }

    /// The sum (8 bytes a value), the outcomes, the unclipped count, the metric sums if
    /// evaluating, the health count if counting.
    fn into_body(
        self,
        outcomes: &[u8],
        _shape: &Shape,
    ) -> Result<Zeroizing<Vec<u8>>, PartitionError> {
        let values = self.schema.parameter_count();
        let mut body = Zeroizing::new(Vec::with_capacity(values * 8 + outcomes.len() + 64));
        for value in self.sum.into_sum() {
            body.extend_from_slice(&value.to_le_bytes());
        }
        body.extend_from_slice(outcomes);
        body.extend_from_slice(&self.unclipped.into_inner().to_le_bytes());
        if let Some((_, sums)) = self.evaluation {
            for sum in sums.take() {
                body.extend_from_slice(&sum.to_le_bytes());
            }
        }
        if let Some(watch) = self.health {
            body.extend_from_slice(&watch.take().to_le_bytes());
        }
        Ok(body)
    }

    fn absorb_state<'p>(
        &self,
        plain: &'p [u8],
        inputs: usize,
        _shape: &Shape,
    ) -> Result<&'p [u8], PartitionError> {
        let values = self.schema.parameter_count();
        let (sum, rest) = plain.split_at(values * 8);
        let (outcomes, rest) = rest.split_at(inputs);
        let (unclipped, rest) = rest.split_at(8);
        let (metrics, zeroed) = rest.split_at(if self.evaluation.is_some() { 24 } else { 0 });
        let sum: Zeroizing<Vec<i64>> = Zeroizing::new(
            sum.chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
        );
        self.sum.add_exact(&sum);
        self.unclipped.fetch_add(
            u64::from_le_bytes(unclipped.try_into().expect("8 bytes")),
            std::sync::atomic::Ordering::Relaxed,
        );
        if let Some((_, sums)) = &self.evaluation {
            let mut units = [0i64; 3];
            for (unit, bytes) in units.iter_mut().zip(metrics.chunks_exact(8)) {
                *unit = i64::from_le_bytes(bytes.try_into().expect("8 bytes"));
            }
            sums.add(units);
        }
        if let Some(watch) = &self.health {
            watch.add(u64::from_le_bytes(zeroed.try_into().expect("8 bytes")));
        }
        Ok(outcomes)
    }
}

/// Records an opened partition's outcome bytes for its range's `inputs`, decoded first: a code
/// that names no reason refuses the partition before anything is recorded.
fn record_outcomes(
    outcome: &Mutex<Outcome>,
    outcomes: &[u8],
    inputs: &[Input],
) -> Result<(), PartitionError> {
    let reasons = outcomes
        .iter()
        .map(|&code| match code {
            INCLUDED => Ok(None),
            _ => Exclusion::ALL
                .get(usize::from(code) - 1)
                .map(|reason| Some(*reason))
                .ok_or_else(|| PartitionError::Malformed(format!("outcome code {code}"))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut outcome = outcome.lock().expect("aggregation outcome");
    for (input, reason) in inputs.iter().zip(reasons) {
        let assignment_ref = input.assignment_ref.clone();
        match reason {
            Some(reason) => outcome.excluded.push((assignment_ref, reason)),
            None => outcome.included.push(assignment_ref),
        }
    }
    Ok(())
}

/// One byte per input of the range, in its order: `INCLUDED`, or 1 + the exclusion's index in
/// `Exclusion::ALL`. Refuses outcomes that are not exactly the range's inputs, once each.
fn outcome_bytes(outcome: Outcome, inputs: &[Input]) -> Result<Vec<u8>, PartitionError> {
    let mut by_ref: std::collections::HashMap<String, u8> =
        std::collections::HashMap::with_capacity(inputs.len());
    let coded = outcome.included.into_iter().map(|r| (r, INCLUDED)).chain(
        outcome.excluded.into_iter().map(|(r, why)| {
            let index = Exclusion::ALL.iter().position(|e| *e == why);
            (r, index.map_or(u8::MAX, |i| i as u8 + 1))
        }),
    );
    for (assignment_ref, code) in coded {
        if by_ref.insert(assignment_ref.clone(), code).is_some() {
            return Err(PartitionError::Incomplete(format!(
                "contribution {assignment_ref} was added twice"
            )));
        }
    }
    let bytes = inputs
        .iter()
        .map(|input| by_ref.remove(&input.assignment_ref))
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(|| {
            PartitionError::Incomplete("an input of the partition was not added".into())
        })?;
    if let Some(extra) = by_ref.keys().next() {
        return Err(PartitionError::Incomplete(format!(
            "contribution {extra} is not in the partition"
        )));
    }
    Ok(bytes)
}

/// The first field in which a sealed partition's header differs from the plan's.
fn foreign(got: &PartitionHeader, expected: &PartitionHeader) -> String {
    let got = serde_json::to_value(got).expect("a header serializes");
    let expected = serde_json::to_value(expected).expect("a header serializes");
    // Over the fields of both: a field left out of one (`health` when false) differs too.
    let keys: std::collections::BTreeSet<&String> = [&got, &expected]
        .iter()
        .filter_map(|header| header.as_object())
        .flat_map(|fields| fields.keys())
        .collect();
    let field = keys
        .into_iter()
        .find(|k| got.get(k.as_str()) != expected.get(k.as_str()))
        .map(|k| {
            let shown =
                |v: Option<&serde_json::Value>| v.map_or("absent".into(), |v| v.to_string());
            format!(
                "its {k} is {}, the round's {}",
                shown(got.get(k.as_str())),
                shown(expected.get(k.as_str()))
            )
        })
        .unwrap_or_default();
    format!("partition {}: {field}", got["index"])
}
