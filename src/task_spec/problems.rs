//! Collecting every invalid field of a request, each with its name and allowed range.

use serde::Serialize;
use utoipa::ToSchema;

/// One invalid field of a request (RFC 7807 `invalid_params` member).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct InvalidParam {
    pub name: String,
    pub reason: String,
}

#[derive(Default)]
pub(super) struct Problems(pub(super) Vec<InvalidParam>);

impl Problems {
    pub(super) fn add(&mut self, name: &str, reason: impl Into<String>) {
        self.0.push(InvalidParam {
            name: name.to_string(),
            reason: reason.into(),
        });
    }

    /// `Some(value)` if within [lo, hi]; otherwise records the problem and returns `None`.
    pub(super) fn checked_int(&mut self, name: &str, value: i64, lo: i64, hi: i64) -> Option<u32> {
        if (lo..=hi).contains(&value) {
            Some(value as u32)
        } else {
            self.add(name, format!("must be between {lo} and {hi} (got {value})"));
            None
        }
    }

    pub(super) fn int(&mut self, name: &str, value: i64, lo: i64, hi: i64) -> u32 {
        self.checked_int(name, value, lo, hi).unwrap_or(lo as u32)
    }

    /// `lo_open` makes the lower bound exclusive: (lo, hi] instead of [lo, hi].
    pub(super) fn float(&mut self, name: &str, value: f64, lo: f64, lo_open: bool, hi: f64) -> f64 {
        let above_lo = if lo_open { value > lo } else { value >= lo };
        if value.is_finite() && above_lo && value <= hi {
            value
        } else {
            let open = if lo_open { "(" } else { "[" };
            self.add(name, format!("must be in {open}{lo}, {hi}] (got {value})"));
            hi
        }
    }
}
