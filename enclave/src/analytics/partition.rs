//! An analytics round in partitions (docs/analytics.md, "Partitioned rounds"): a partition's
//! worker seals its range's exact table, the root adds every partition's table into its own and
//! releases once, as one worker would. Integer sums do not care about grouping, and an open
//! domain's keys are merged into the root's map and sorted at release, so the release is the
//! one-worker bytes whatever the plan.
//!
//! What the operator sees of a sealed partition is its length, so the table is sealed in a shape
//! the query and the range's length fix: a closed domain's or the quantile tree's counts, 8 bytes
//! each; an open domain's keys padded to the most its range can hold (`contributions x
//! keys_per_device`, at most `MAX_OPEN_KEYS`), each slot `max_key_bytes` + 9 bytes. Sealed as it
//! is, an open table's length would count the partition's distinct keys exactly.

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use confed_dp::analytics::MAX_OPEN_KEYS;
use confed_protocol::answer::Key;
use zeroize::Zeroizing;

use super::AnalyticsAggregator;
use super::table::Table;
use crate::aggregate::Outcome;
use crate::aggregate::contribution::Binding;
use crate::aggregate::partition::{Partial, PartitionError, Shape, TableShape};

impl Partial for AnalyticsAggregator {
    fn binding(&self) -> &Binding {
        &self.binding
    }

    fn shape(&self, inputs: usize) -> Shape {
        Shape {
            values: 0,
            evaluation: false,
            health: false,
            table: Some(self.table.sealed_shape(inputs)),
            masked_slot_bytes: None,
        }
    }

    fn outcome(&self) -> &Mutex<Outcome> {
        &self.outcome
    }

    /// The table, then the outcomes.
    fn into_body(
        self,
        outcomes: &[u8],
        shape: &Shape,
    ) -> Result<Zeroizing<Vec<u8>>, PartitionError> {
        let table = shape.table.ok_or_else(not_a_table)?;
        let mut body = self.table.into_sealed(&table)?;
        body.extend_from_slice(outcomes);
        Ok(body)
    }

    fn absorb_state<'p>(
        &self,
        plain: &'p [u8],
        inputs: usize,
        shape: &Shape,
    ) -> Result<&'p [u8], PartitionError> {
        let table = shape.table.ok_or_else(not_a_table)?;
        let (state, outcomes) = plain.split_at(plain.len() - inputs);
        self.table.absorb_sealed(state, &table)?;
        Ok(outcomes)
    }
}

fn not_a_table() -> PartitionError {
    PartitionError::Foreign("a training partition for an analytics round".into())
}

fn malformed(why: &str) -> PartitionError {
    PartitionError::Malformed(format!("its analytics table: {why}"))
}

impl Table {
    /// The shape this table is sealed in for a range of `inputs` contributions.
    pub fn sealed_shape(&self, inputs: usize) -> TableShape {
        match self {
            Self::Dense { counts, .. } => TableShape {
                slots: counts.len() as u64,
                slot_bytes: 8,
                open: false,
            },
            Self::Open {
                max_key_bytes,
                keys_per_device,
                ..
            } => TableShape {
                slots: (inputs as u64)
                    .saturating_mul(u64::from(*keys_per_device))
                    .min(MAX_OPEN_KEYS),
                slot_bytes: 1 + u64::from(*max_key_bytes) + 8,
                open: true,
            },
        }
    }

    /// The table's bytes in `shape`: each count (u64, little endian) in node order; or the slots
    /// used (u64), whether the table filled (1 byte), and `slots` slots of key length (1 byte),
    /// key padded with zeros to `max_key_bytes`, count (u64), keys in byte order, unused slots
    /// all zeros.
    fn into_sealed(self, shape: &TableShape) -> Result<Zeroizing<Vec<u8>>, PartitionError> {
        let len = shape.slots as usize * shape.slot_bytes as usize
            + if shape.open {
                TableShape::OPEN_PREAMBLE as usize
            } else {
                0
            };
        let mut body = Zeroizing::new(Vec::with_capacity(len));
        if matches!(self, Self::Dense { .. }) {
            for count in self.into_dense().ok_or_else(|| malformed("not dense"))? {
                body.extend_from_slice(&count.to_le_bytes());
            }
            return Ok(body);
        }
        let (entries, full) = self.into_open().ok_or_else(|| malformed("not open"))?;
        if entries.len() as u64 > shape.slots {
            // No count in the words: a job's error leaves the enclave exactly.
            return Err(PartitionError::Incomplete(
                "more distinct keys than the range's slots".into(),
            ));
        }
        let key_bytes = shape.slot_bytes as usize - 9;
        body.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        body.push(u8::from(full));
        for (key, count) in &entries {
            body.push(key.len() as u8);
            body.extend_from_slice(key);
            let padded = body.len() + key_bytes - key.len();
            body.resize(padded, 0);
            body.extend_from_slice(&count.to_le_bytes());
        }
        body.resize(len, 0);
        Ok(body)
    }

    /// Adds a sealed partition's table (its length checked against `shape`): a dense table count
    /// by count, node by node (a tree's nodes are added as they are, not as leaves); an open
    /// one key by key, as answers' keys are (the root's table fills as one worker's would).
    fn absorb_sealed(&self, state: &[u8], shape: &TableShape) -> Result<(), PartitionError> {
        match self {
            Self::Dense { counts, .. } => {
                if state.len() != counts.len() * 8 {
                    return Err(malformed("its length is not the domain's"));
                }
                for (count, bytes) in counts.iter().zip(state.chunks_exact(8)) {
                    let value = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
                    count.fetch_add(value, Ordering::Relaxed);
                }
                Ok(())
            }
            Self::Open {
                full,
                max_key_bytes,
                ..
            } => {
                let key_bytes = *max_key_bytes as usize;
                let expected = TableShape::OPEN_PREAMBLE + shape.slots * shape.slot_bytes;
                if shape.slot_bytes != key_bytes as u64 + 9 || state.len() as u64 != expected {
                    return Err(malformed("its slots are not the query's"));
                }
                let (preamble, slots) = state.split_at(TableShape::OPEN_PREAMBLE as usize);
                let used = u64::from_le_bytes(preamble[..8].try_into().expect("8 bytes"));
                if used > shape.slots || preamble[8] > 1 {
                    return Err(malformed("its used slots or full flag"));
                }
                for slot in slots
                    .chunks_exact(shape.slot_bytes as usize)
                    .take(used as usize)
                {
                    let len = usize::from(slot[0]);
                    if len > key_bytes {
                        return Err(malformed("a key longer than the query's max_key_bytes"));
                    }
                    let count =
                        u64::from_le_bytes(slot[1 + key_bytes..].try_into().expect("8 bytes"));
                    self.add(Key::Text(&slot[1..1 + len]), count);
                }
                if preamble[8] == 1 {
                    full.store(true, Ordering::Relaxed);
                }
                Ok(())
            }
        }
    }
}
