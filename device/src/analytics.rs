//! A device's answer to an analytics query, computed from its local records by the declared query
//! (never by partner code) and laid out in the query's fixed shape (`confed_protocol::answer`):
//! whatever the records, the answer has the same size, so its length, and when it is sent (the
//! policy's upload window, as for training), say nothing about them.
//!
//! Per query (docs/analytics.md):
//! - closed histogram: the distinct key indices among the records (records outside the domain are
//!   ignored), each with 1 (`max_value` 1) or the sum of its records' values, capped at
//!   `max_value`;
//! - open histogram: the distinct strings, each cut to `max_key_bytes` at a character boundary
//!   (empty strings and strings holding a zero byte are ignored), each with 1;
//! - quantiles: the values (NaN ignored), each as its leaf of the quantile tree with 1.
//!
//! A device with more keys (or values) than the bound contributes a uniformly random choice of
//! them; the choice is made among the keys, never by their values.

use std::collections::BTreeMap;

use confed_protocol::analytics::AnalyticsQuery;
use confed_protocol::answer::{self, AnswerProblem, Key, quantile_leaf};
use thiserror::Error;

/// A device's local records, of the kind its query reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Records {
    /// A closed histogram's records: key index and value (integer units; counts ignore it).
    Keyed(Vec<(u64, u64)>),
    /// An open histogram's records: strings (words, app events), repeats allowed.
    Strings(Vec<String>),
    /// A quantile query's records: numbers.
    Values(Vec<f64>),
}

#[derive(Debug, Error)]
pub enum AnalyticsError {
    #[error("the query reads {expected} records, and the device gave {given}")]
    WrongRecords {
        expected: &'static str,
        given: &'static str,
    },
    #[error("the answer does not lay out: {0}")]
    Layout(#[from] AnswerProblem),
    #[error("no randomness for the choice of keys: {0}")]
    Randomness(String),
}

impl Records {
    fn kind(&self) -> &'static str {
        match self {
            Self::Keyed(_) => "keyed",
            Self::Strings(_) => "string",
            Self::Values(_) => "value",
        }
    }
}

/// The answer's plaintext (to seal like an update) for `records`, choosing keys with the
/// operating system's randomness.
pub fn answer(query: &AnalyticsQuery, records: &Records) -> Result<Vec<u8>, AnalyticsError> {
    let mut failure = None;
    let bytes = answer_with(query, records, &mut || {
        let mut word = [0u8; 8];
        if let Err(e) = getrandom::fill(&mut word) {
            failure = Some(e.to_string());
        }
        u64::from_le_bytes(word)
    })?;
    match failure {
        Some(why) => Err(AnalyticsError::Randomness(why)),
        None => Ok(bytes),
    }
}

/// The answer of a device whose computation failed: no keys, the health flag set.
pub fn failed_answer(query: &AnalyticsQuery) -> Result<Vec<u8>, AnalyticsError> {
    Ok(answer::write(query, &[], true)?)
}

/// `answer` with the randomness given (`random` returns uniform 64-bit words).
pub fn answer_with(
    query: &AnalyticsQuery,
    records: &Records,
    random: &mut dyn FnMut() -> u64,
) -> Result<Vec<u8>, AnalyticsError> {
    let wrong = |expected| AnalyticsError::WrongRecords {
        expected,
        given: records.kind(),
    };
    let bound = query.slots() as usize;
    match (query, records) {
        (
            AnalyticsQuery::Histogram {
                domain_size,
                max_value,
                ..
            },
            Records::Keyed(records),
        ) => {
            let mut totals: BTreeMap<u64, u64> = BTreeMap::new();
            for (key, value) in records {
                if *key < u64::from(*domain_size) {
                    let total = totals.entry(*key).or_default();
                    *total = total.saturating_add(*value);
                }
            }
            let keys: Vec<u64> = totals.keys().copied().collect();
            let mut slots: Vec<(Key<'_>, u64)> = choose(&keys, bound, random)
                .into_iter()
                .map(|key| {
                    let value = match max_value {
                        1 => 1,
                        cap => totals[&key].min(*cap),
                    };
                    (Key::Index(key), value)
                })
                .collect();
            slots.sort();
            Ok(answer::write(query, &slots, false)?)
        }
        (AnalyticsQuery::OpenHistogram { max_key_bytes, .. }, Records::Strings(records)) => {
            let distinct: std::collections::BTreeSet<&str> = records
                .iter()
                .map(|text| cut(text, *max_key_bytes as usize))
                .filter(|text| !text.is_empty() && !text.contains('\0'))
                .collect();
            let distinct: Vec<&str> = distinct.into_iter().collect();
            let mut chosen = choose(&distinct, bound, random);
            chosen.sort();
            let slots: Vec<(Key<'_>, u64)> = chosen
                .iter()
                .map(|text| (Key::Text(text.as_bytes()), 1))
                .collect();
            Ok(answer::write(query, &slots, false)?)
        }
        (AnalyticsQuery::Quantiles { min, max, .. }, Records::Values(records)) => {
            let leaves: Vec<u64> = records
                .iter()
                .filter_map(|value| quantile_leaf(*min, *max, *value))
                .collect();
            let mut chosen = choose(&leaves, bound, random);
            chosen.sort();
            let slots: Vec<(Key<'_>, u64)> = chosen
                .into_iter()
                .map(|leaf| (Key::Index(leaf), 1))
                .collect();
            Ok(answer::write(query, &slots, false)?)
        }
        (AnalyticsQuery::Histogram { .. }, _) => Err(wrong("keyed")),
        (AnalyticsQuery::OpenHistogram { .. }, _) => Err(wrong("string")),
        (AnalyticsQuery::Quantiles { .. }, _) => Err(wrong("value")),
    }
}

/// The longest prefix of `text` of at most `bytes` bytes that ends at a character boundary: how
/// an open-domain key longer than the query's `max_key_bytes` is sent.
pub fn cut(text: &str, bytes: usize) -> &str {
    let mut end = bytes.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A uniformly random choice of `count` of `items` (all of them when there are no more): a
/// partial Fisher-Yates shuffle with unbiased draws.
fn choose<T: Copy>(items: &[T], count: usize, random: &mut dyn FnMut() -> u64) -> Vec<T> {
    let mut items = items.to_vec();
    let count = count.min(items.len());
    for i in 0..count {
        let remaining = (items.len() - i) as u64;
        let j = i + below(remaining, random) as usize;
        items.swap(i, j);
    }
    items.truncate(count);
    items
}

/// A uniform draw in `0..n` (n >= 1), by rejection of the biased top of the range.
fn below(n: u64, random: &mut dyn FnMut() -> u64) -> u64 {
    let zone = u64::MAX - u64::MAX % n;
    loop {
        let word = random();
        if word < zone {
            return word % n;
        }
    }
}

#[cfg(test)]
mod tests;
