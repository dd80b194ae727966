//! The exact integer sum of clipped updates on the grid, shared by all decrypting threads.
//!
//! The sum is split into stripes, each behind its own lock: a thread adds its update stripe by
//! stripe, starting at a stripe that depends on the thread, so threads rarely wait on each other
//! and no thread keeps a private copy of the sum (memory stays one sum, whatever the thread
//! count). Integer addition makes the result independent of order and thread count.

use std::sync::Mutex;

use crate::dp::grid::{self, SENSITIVITY_SQUARED};

/// Values per stripe: 128 KiB of i64, so a stripe stays in L2 while it is added.
const STRIPE: usize = 16 * 1024;

pub struct Accumulator {
    stripes: Vec<Mutex<Vec<i64>>>,
    len: usize,
}

/// One update's tensors as little-endian f32 bytes, in schema order.
pub type Update<'a> = [&'a [u8]];

impl Accumulator {
    pub fn new(len: usize) -> Self {
        let stripes = (0..len.div_ceil(STRIPE))
            .map(|i| Mutex::new(vec![0i64; STRIPE.min(len - i * STRIPE)]))
            .collect();
        Self { stripes, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Clips `update` (squared norm `norm_squared`) to `clip_norm` and adds it on the grid.
    /// Guarantees the added integer vector has L2 norm <= `GRID_UNITS_PER_CLIP` exactly: if
    /// rounding pushed it over, the addition is undone and the update shrunk by the rounding's
    /// worst case before adding again. `start` spreads threads over the stripes.
    pub fn add_clipped(
        &self,
        update: &Update<'_>,
        norm_squared: f64,
        clip_norm: f64,
        start: usize,
    ) {
        let norm = norm_squared.sqrt();
        let mut factor = if norm > clip_norm {
            clip_norm / norm
        } else {
            1.0
        };
        // Worst-case rounding adds sqrt(len)/2 units of norm; shrinking by that (plus one unit)
        // makes the second attempt fit whatever the rounding.
        let margin = ((self.len as f64).sqrt() / 2.0 + 1.0) / grid::GRID_UNITS_PER_CLIP as f64;
        for _ in 0..4 {
            let units = grid::units_per_value(clip_norm, factor);
            let squares = self.apply(update, units, start, 1);
            if squares <= SENSITIVITY_SQUARED {
                return;
            }
            self.apply(update, units, start, -1);
            factor *= 1.0 - margin;
        }
        unreachable!("a shrunk update always fits the grid's sensitivity");
    }

    /// Adds (`sign` 1) or subtracts (`sign` -1) the quantized update; returns its squared norm
    /// in grid units.
    fn apply(&self, update: &Update<'_>, units: f64, start: usize, sign: i64) -> u128 {
        let count = self.stripes.len();
        let mut squares: u128 = 0;
        for step in 0..count {
            let index = (start + step) % count;
            let first = index * STRIPE;
            let mut stripe = self.stripes[index].lock().expect("accumulator stripe");
            let end = first + stripe.len();
            let mut offset = 0usize;
            for tensor in update {
                let values = tensor.len() / 4;
                let (lo, hi) = (offset.max(first), (offset + values).min(end));
                if lo < hi {
                    let bytes = &tensor[(lo - offset) * 4..(hi - offset) * 4];
                    squares +=
                        add_quantized(&mut stripe[lo - first..hi - first], bytes, units, sign);
                }
                offset += values;
                if offset >= end {
                    break;
                }
            }
        }
        squares
    }

    /// The sum, consuming the accumulator.
    pub fn into_sum(self) -> Vec<i64> {
        let mut sum = Vec::with_capacity(self.len);
        for stripe in self.stripes {
            sum.extend(stripe.into_inner().expect("accumulator stripe"));
        }
        sum
    }
}

#[inline]
fn add_quantized(target: &mut [i64], bytes: &[u8], units: f64, sign: i64) -> u128 {
    let mut squares: u64 = 0;
    for (slot, value) in target.iter_mut().zip(bytes.chunks_exact(4)) {
        let q = grid::quantize(
            f32::from_le_bytes([value[0], value[1], value[2], value[3]]),
            units,
        );
        *slot += sign * q;
        // |q| <= 2^16 after clipping (2^17 before a retry), so q^2 <= 2^34 and a stripe of
        // 2^14 values sums below 2^48.
        squares += (q * q) as u64;
    }
    u128::from(squares)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn an_update_above_the_clip_norm_is_scaled_to_it_exactly() {
        let acc = Accumulator::new(2);
        let data = bytes(&[30.0, 40.0]); // norm 50, clip 5 -> (3, 4)
        acc.add_clipped(&[&data], 2500.0, 5.0, 0);
        // (3, 4) on the grid is (39321.6, 52428.8) units; rounding to nearest would overshoot the
        // clip norm, so the update is shrunk by the rounding's worst case and lands just inside.
        let sum = acc.into_sum();
        let norm = ((sum[0] * sum[0] + sum[1] * sum[1]) as f64).sqrt();
        let limit = grid::GRID_UNITS_PER_CLIP as f64;
        assert!(norm <= limit && norm > limit - 3.0, "{sum:?}");
        assert!((sum[0] as f64 / sum[1] as f64 - 0.75).abs() < 1e-4);
    }

    #[test]
    fn sums_span_stripes_and_tensors_in_order() {
        let len = STRIPE + 10;
        let acc = Accumulator::new(len);
        let first = bytes(&vec![0.001; STRIPE - 3]);
        let second = bytes(&[-0.002; 13]);
        let norm2 = (STRIPE - 3) as f64 * 1e-6 + 13.0 * 4e-6;
        acc.add_clipped(&[&first, &second], norm2, 100.0, 1);
        acc.add_clipped(&[&first, &second], norm2, 100.0, 0);
        let sum = acc.into_sum();
        let unit = grid::GRID_UNITS_PER_CLIP as f64 / 100.0;
        assert_eq!(sum[0], 2 * (0.001f32 as f64 * unit).round() as i64);
        assert_eq!(sum[len - 1], 2 * (-0.002f32 as f64 * unit).round() as i64);
        assert_eq!(sum[STRIPE - 3], sum[len - 1]);
    }

    #[test]
    fn rounding_can_never_push_an_update_past_the_sensitivity() {
        // Every coordinate rounds up: 1000 values at just above half a unit each, scaled so
        // the float norm equals the clip norm exactly.
        let len = 1000;
        let clip = 1.0;
        let value = (1.0 / (len as f64).sqrt()) as f32;
        let data = bytes(&vec![value; len]);
        let acc = Accumulator::new(len);
        acc.add_clipped(&[&data], f64::from(value).powi(2) * len as f64, clip, 0);
        let squares: i128 = acc
            .into_sum()
            .iter()
            .map(|&q| i128::from(q) * i128::from(q))
            .sum();
        assert!(squares as u128 <= SENSITIVITY_SQUARED);
    }
}
