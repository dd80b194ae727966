//! A device's answer to an analytics query (docs/protocol.md, "Analytics answers"): the plaintext
//! of its contribution, sealed in the same envelope as a training update. Its tensors and shapes
//! depend only on the query, never on the device's records:
//!
//! | tensor | dtype, shape | meaning |
//! |---|---|---|
//! | `confed.present` | U8 `[k]` | 1 for a slot that carries a key, 0 for padding |
//! | `confed.keys` | U8 `[k, max_key_bytes]` (open domain) or I64 `[k]` (a closed domain's key index; a quantile leaf) | the key; a string is UTF-8 followed by zero bytes |
//! | `confed.values` | I64 `[k]` | what the slot adds to its key, in `[0, c]`; 0 in padding |
//! | `confed.health` | F32 `[1]` | 1.0 when the device sends no keys because its computation failed |
//!
//! `k` is the query's `keys_per_device` (`values_per_device` for quantiles). The device writes the
//! present slots first, in increasing key order; padding slots are all zeros. This module both
//! writes answers (devices) and reads them back with every check the enclave applies, so what a
//! device sends and what the enclave accepts are one definition.

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use thiserror::Error;

use crate::analytics::{AnalyticsQuery, QUANTILE_BRANCHING, QUANTILE_LEVELS};

pub const PRESENT_TENSOR: &str = "confed.present";
pub const KEYS_TENSOR: &str = "confed.keys";
pub const VALUES_TENSOR: &str = "confed.values";
pub use crate::mechanism::HEALTH_TENSOR;

/// Leaves of the quantile tree: `QUANTILE_BRANCHING ^ QUANTILE_LEVELS`.
pub const QUANTILE_LEAVES: u64 = (QUANTILE_BRANCHING as u64).pow(QUANTILE_LEVELS);

/// One slot's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Key<'a> {
    /// A closed domain's key index, or a quantile leaf.
    Index(u64),
    /// An open domain's string, without its padding.
    Text(&'a [u8]),
}

/// Why an answer is not one an honest device of this query writes (the enclave excludes it).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AnswerProblem {
    #[error("the answer is not safetensors: {0}")]
    Format(String),
    #[error(
        "the answer's tensors are not exactly confed.present, confed.keys, confed.values and confed.health"
    )]
    Tensors,
    #[error("tensor {0} has the wrong dtype or shape for the query")]
    Shape(&'static str),
    #[error("slot {0}: confed.present is neither 0 nor 1")]
    Presence(usize),
    #[error("slot {0} is padding but not all zeros")]
    Padding(usize),
    #[error("slot {0}: the key is outside the query's domain")]
    OutOfDomain(usize),
    #[error("slot {0}: the key is empty, not UTF-8, or has bytes after its end")]
    BadText(usize),
    #[error("slot {0}: the value is outside [0, {1}]")]
    Value(usize, u64),
    #[error("slot {0} repeats a key of an earlier slot")]
    Repeated(usize),
    #[error("present slots must come first, in increasing key order (slot {0})")]
    Order(usize),
    #[error("the health flag is neither 0.0 nor 1.0, or is set with keys present")]
    Health,
}

/// The shape of an answer to `query`: `(k, key bytes per slot or 0 for an index)`.
fn shape(query: &AnalyticsQuery) -> (usize, usize) {
    let width = match query {
        AnalyticsQuery::OpenHistogram { max_key_bytes, .. } => *max_key_bytes as usize,
        _ => 0,
    };
    (query.slots() as usize, width)
}

/// The number of keys of a closed domain (`None` for an open one).
fn domain(query: &AnalyticsQuery) -> Option<u64> {
    match query {
        AnalyticsQuery::Histogram { domain_size, .. } => Some(u64::from(*domain_size)),
        AnalyticsQuery::OpenHistogram { .. } => None,
        AnalyticsQuery::Quantiles { .. } => Some(QUANTILE_LEAVES),
    }
}

/// Writes an answer with `slots` (key and value; at most `k`, each valid for the query, sorted
/// and distinct as `Answer::read` requires) and the health flag. Devices build the slots with
/// `confed_device::analytics`; this only lays them out.
pub fn write(
    query: &AnalyticsQuery,
    slots: &[(Key<'_>, u64)],
    failed: bool,
) -> Result<Vec<u8>, AnswerProblem> {
    let (k, width) = shape(query);
    if slots.len() > k {
        return Err(AnswerProblem::Shape(KEYS_TENSOR));
    }
    let mut present = vec![0u8; k];
    let mut keys = vec![0u8; k * width.max(8)];
    let mut values = vec![0u8; k * 8];
    for (i, (key, value)) in slots.iter().enumerate() {
        present[i] = 1;
        match key {
            Key::Index(index) if width == 0 => {
                keys[i * 8..i * 8 + 8].copy_from_slice(&index.to_le_bytes());
            }
            Key::Text(text) if width > 0 && text.len() <= width => {
                keys[i * width..i * width + text.len()].copy_from_slice(text);
            }
            _ => return Err(AnswerProblem::Shape(KEYS_TENSOR)),
        }
        let value = i64::try_from(*value).map_err(|_| AnswerProblem::Value(i, u64::MAX))?;
        values[i * 8..i * 8 + 8].copy_from_slice(&value.to_le_bytes());
    }
    let health = if failed { 1.0f32 } else { 0.0 }.to_le_bytes();
    fn view(dtype: Dtype, shape: Vec<usize>, data: &[u8]) -> Result<TensorView<'_>, AnswerProblem> {
        TensorView::new(dtype, shape, data).map_err(|e| AnswerProblem::Format(e.to_string()))
    }
    let keys_view = match width {
        0 => view(Dtype::I64, vec![k], &keys[..k * 8])?,
        _ => view(Dtype::U8, vec![k, width], &keys[..k * width])?,
    };
    let tensors = [
        (PRESENT_TENSOR, view(Dtype::U8, vec![k], &present)?),
        (KEYS_TENSOR, keys_view),
        (VALUES_TENSOR, view(Dtype::I64, vec![k], &values)?),
        (HEALTH_TENSOR, view(Dtype::F32, vec![1], &health)?),
    ];
    let bytes =
        safetensors::serialize(tensors, None).map_err(|e| AnswerProblem::Format(e.to_string()))?;
    // What is written is what is read: a device never sends an answer the enclave excludes.
    Answer::read(query, &bytes)?;
    Ok(bytes)
}

/// An answer read and checked against its query: the enclave adds `slots()` and nothing else.
pub struct Answer<'a> {
    count: usize,
    width: usize,
    keys: &'a [u8],
    values: &'a [u8],
    failed: bool,
}

impl<'a> Answer<'a> {
    /// Reads `plaintext` as an answer to `query`, refusing anything an honest device's answer
    /// cannot be (`AnswerProblem`): the fixed tensors and shapes, 0/1 presence with the present
    /// slots first in increasing key order (so distinct), zero padding, keys inside the domain
    /// (strings: non-empty UTF-8 without a zero byte, then zeros), values in `[0, c]`.
    pub fn read(query: &AnalyticsQuery, plaintext: &'a [u8]) -> Result<Self, AnswerProblem> {
        let tensors = Self::tensors(query, plaintext)?;
        Self::check(query, tensors)
    }

    /// The four tensors' bytes (present, keys, values, health), each of the query's dtype and
    /// shape.
    fn tensors(query: &AnalyticsQuery, plaintext: &'a [u8]) -> Result<Tensors<'a>, AnswerProblem> {
        let tensors = SafeTensors::deserialize(plaintext)
            .map_err(|e| AnswerProblem::Format(e.to_string()))?;
        if tensors.len() != 4 {
            return Err(AnswerProblem::Tensors);
        }
        let (k, width) = shape(query);
        let tensor = |name: &'static str, dtype: Dtype, expected: &[usize]| {
            let view = tensors.tensor(name).map_err(|_| AnswerProblem::Tensors)?;
            if view.dtype() != dtype || view.shape() != expected {
                return Err(AnswerProblem::Shape(name));
            }
            Ok(view.data())
        };
        let present = tensor(PRESENT_TENSOR, Dtype::U8, &[k])?;
        let keys = match width {
            0 => tensor(KEYS_TENSOR, Dtype::I64, &[k])?,
            _ => tensor(KEYS_TENSOR, Dtype::U8, &[k, width])?,
        };
        let values = tensor(VALUES_TENSOR, Dtype::I64, &[k])?;
        let health = tensor(HEALTH_TENSOR, Dtype::F32, &[1])?;
        // Borrowed from `plaintext` (the views only point into it).
        let within = |data: &[u8]| -> &'a [u8] {
            let start = data.as_ptr() as usize - plaintext.as_ptr() as usize;
            &plaintext[start..start + data.len()]
        };
        Ok([
            within(present),
            within(keys),
            within(values),
            within(health),
        ])
    }

    /// Every check of an answer's tensors (`read`).
    fn check(query: &AnalyticsQuery, tensors: Tensors<'a>) -> Result<Self, AnswerProblem> {
        let [present, keys, values, health] = tensors;
        let width = shape(query).1;
        let flag = f32::from_le_bytes(health.try_into().map_err(|_| AnswerProblem::Health)?);
        let slot_width = if width == 0 { 8 } else { width };
        let count = present.iter().take_while(|p| **p == 1).count();
        for (i, p) in present.iter().enumerate().skip(count) {
            if *p > 1 {
                return Err(AnswerProblem::Presence(i));
            }
            if *p == 1 {
                return Err(AnswerProblem::Order(i));
            }
            let zero = |bytes: &[u8]| bytes.iter().all(|b| *b == 0);
            if !zero(&keys[i * slot_width..(i + 1) * slot_width])
                || !zero(&values[i * 8..(i + 1) * 8])
            {
                return Err(AnswerProblem::Padding(i));
            }
        }
        if !(flag == 0.0 || flag == 1.0) || (flag == 1.0 && count > 0) {
            return Err(AnswerProblem::Health);
        }
        let answer = Self {
            count,
            width,
            keys,
            values,
            failed: flag == 1.0,
        };
        // Per slot: a quantile value adds 1 (its slots may share a leaf; the sensitivity counts
        // `values_per_device` of them), a histogram's at most `max_value`.
        let (domain, largest) = (domain(query), query.slot_bound());
        // Quantile values may share a leaf (a device's values are not distinct keys).
        let distinct = !matches!(query, AnalyticsQuery::Quantiles { .. });
        let mut previous: Option<Key<'_>> = None;
        for i in 0..count {
            let key = answer.key(i);
            match key {
                Key::Index(index) if domain.is_some_and(|n| index >= n) => {
                    return Err(AnswerProblem::OutOfDomain(i));
                }
                Key::Text(text) if !valid_text(text, &keys[i * width..(i + 1) * width]) => {
                    return Err(AnswerProblem::BadText(i));
                }
                _ => {}
            }
            if let Some(previous) = previous {
                if previous == key && distinct {
                    return Err(AnswerProblem::Repeated(i));
                }
                if previous > key {
                    return Err(AnswerProblem::Order(i));
                }
            }
            previous = Some(key);
            let value = answer.value(i);
            if !(0..=largest).contains(&value) {
                return Err(AnswerProblem::Value(i, largest));
            }
        }
        Ok(answer)
    }

    fn key(&self, i: usize) -> Key<'a> {
        match self.width {
            0 => Key::Index(u64::from_le_bytes(
                self.keys[i * 8..i * 8 + 8].try_into().expect("8 bytes"),
            )),
            width => {
                let slot = &self.keys[i * width..(i + 1) * width];
                let end = slot.iter().position(|b| *b == 0).unwrap_or(width);
                Key::Text(&slot[..end])
            }
        }
    }

    /// A slot's value as read (`read` checked it is in `[0, c]`).
    fn value(&self, i: usize) -> u64 {
        let value = i64::from_le_bytes(self.values[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        u64::try_from(value).unwrap_or(u64::MAX)
    }

    /// The present slots: each key with what it adds.
    pub fn slots(&self) -> impl Iterator<Item = (Key<'a>, u64)> + '_ {
        (0..self.count).map(|i| (self.key(i), self.value(i)))
    }

    /// Whether the device sent no keys because its computation failed.
    pub fn failed(&self) -> bool {
        self.failed
    }
}

/// The bytes of `confed.present`, `confed.keys`, `confed.values` and `confed.health`.
type Tensors<'a> = [&'a [u8]; 4];

/// How answers to one query are laid out, found once: every honest device writes the same header
/// (safetensors' serializer over the same names, dtypes and shapes), so an answer that starts with
/// it is read at fixed offsets without parsing JSON. Anything else is read the long way
/// (`Answer::read`), with the same checks.
pub struct AnswerLayout {
    query: AnalyticsQuery,
    header: Vec<u8>,
    len: usize,
    /// (start, end) of each tensor's bytes in an answer.
    ranges: [(usize, usize); 4],
}

impl AnswerLayout {
    pub fn new(query: &AnalyticsQuery) -> Result<Self, AnswerProblem> {
        let empty = write(query, &[], false)?;
        let header_len = 8 + usize::try_from(u64::from_le_bytes(
            empty[..8].try_into().map_err(|_| AnswerProblem::Tensors)?,
        ))
        .map_err(|_| AnswerProblem::Tensors)?;
        let tensors = Answer::tensors(query, &empty)?;
        let base = empty.as_ptr() as usize;
        let range = |data: &[u8]| {
            let start = data.as_ptr() as usize - base;
            (start, start + data.len())
        };
        Ok(Self {
            query: query.clone(),
            header: empty[..header_len].to_vec(),
            len: empty.len(),
            ranges: tensors.map(range),
        })
    }

    /// `Answer::read`, at fixed offsets when the answer has the header every device writes.
    pub fn read<'a>(&self, plaintext: &'a [u8]) -> Result<Answer<'a>, AnswerProblem> {
        if plaintext.len() != self.len || !plaintext.starts_with(&self.header) {
            return Answer::read(&self.query, plaintext);
        }
        Answer::check(
            &self.query,
            self.ranges.map(|(start, end)| &plaintext[start..end]),
        )
    }
}

/// A string key: non-empty UTF-8 with no zero byte, followed only by zeros in its slot.
fn valid_text(text: &[u8], slot: &[u8]) -> bool {
    !text.is_empty()
        && slot[text.len()..].iter().all(|b| *b == 0)
        && std::str::from_utf8(text).is_ok()
}

/// The leaf of the quantile tree a value falls in: `[min, max]` cut into `QUANTILE_LEAVES`
/// equal leaves, values outside clamped to the ends (`None` for NaN).
pub fn quantile_leaf(min: f64, max: f64, value: f64) -> Option<u64> {
    if value.is_nan() {
        return None;
    }
    let position = ((value - min) / (max - min)).clamp(0.0, 1.0);
    let leaves = QUANTILE_LEAVES as f64;
    Some(((position * leaves).floor() as u64).min(QUANTILE_LEAVES - 1))
}

#[cfg(test)]
mod tests;
