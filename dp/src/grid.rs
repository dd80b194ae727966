//! The fixed-point grid the enclave sums on. An update clipped to L2 norm `C` is scaled so that
//! `C` is `GRID_UNITS_PER_CLIP` units and rounded to integers; the sum is then exact (integer
//! addition is associative, so any order or thread count gives the same bits), and the noise is
//! discrete Gaussian on the same integers, sampled exactly.
//!
//! Sensitivity stays exactly `GRID_UNITS_PER_CLIP`: after rounding, the enclave checks the
//! integer norm (`sum of squares <= GRID_UNITS_PER_CLIP^2`, computed exactly: every term is an
//! integer below 2^35 and every partial sum that matters below 2^53) and shrinks the update until
//! it holds, so float rounding can never add privacy loss (`aggregate::accumulator`).

/// Grid units per clip norm: 2^16 (one definition, the protocol's: a masked round's device
/// clips on the same grid, `confed_protocol::grid`).
pub use confed_protocol::grid::GRID_UNITS_PER_CLIP;

/// Largest noise standard deviation in grid units the exact sampler accepts (2^30): its
/// intermediate products then stay within u128.
pub const MAX_SCALE_GRID: u64 = 1 << 30;

/// Grid units per unit of update value, for an update clipped by factor `clip_factor` (<= 1) at
/// clip norm `clip_norm`.
pub fn units_per_value(clip_norm: f64, clip_factor: f64) -> f64 {
    GRID_UNITS_PER_CLIP as f64 / clip_norm * clip_factor
}

/// Converts a noised grid sum back to an average update value.
pub fn to_average(sum_units: i64, clip_norm: f64, count: u64) -> f32 {
    (sum_units as f64 * clip_norm / GRID_UNITS_PER_CLIP as f64 / count as f64) as f32
}

/// Converts a noised sum in grid units that is not an integer (tree noise is a weighted sum of
/// integer node noises) back to an average update value.
pub fn to_average_f64(sum_units: f64, clip_norm: f64, count: u64) -> f32 {
    (sum_units * clip_norm / GRID_UNITS_PER_CLIP as f64 / count as f64) as f32
}
