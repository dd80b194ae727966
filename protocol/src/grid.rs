//! The fixed-point grid every confed sum is exact on (dp's `grid` re-exports the constant): an
//! update clipped to L2 norm `C` is scaled so that `C` is `GRID_UNITS_PER_CLIP` units and rounded
//! to integers whose exact integer L2 norm is at most `GRID_UNITS_PER_CLIP`.
//!
//! The enclave clips on the grid when it sees updates; in a masked round
//! (docs/secure-aggregation.md) it cannot, so the device does it here (`clip_to_grid`) with the
//! same guarantee, checked exactly: the integer norm bounds what the device adds to the sum.

/// Grid units per clip norm: 2^16. The rounding error per coordinate (half a unit, C / 2^17) is
/// far below any usable noise (at least C / 2^5 per coordinate of the sum).
pub const GRID_UNITS_PER_CLIP: i64 = 1 << 16;

/// The exact squared integer norm a clipped update may reach (2^32).
const MAX_SQUARES: u128 = (GRID_UNITS_PER_CLIP as u128) * (GRID_UNITS_PER_CLIP as u128);

/// Passes `clip_to_grid` makes, every time: an update within the policy's bounds fits in two.
const MAX_PASSES: usize = 4;

/// `update` clipped to L2 norm `clip_norm` and put on the grid: scaled by `GRID_UNITS_PER_CLIP /
/// clip_norm` (shrunk first if its norm is above `clip_norm`), rounded to the nearest integer
/// (ties to even, as the enclave rounds: an update within the clip norm lands on the integers the
/// enclave would add for it), and shrunk again by the rounding's worst case until the exact
/// integer norm is at most `GRID_UNITS_PER_CLIP`. An update holding a NaN or an infinity, a clip
/// norm outside the policy's `[MIN_CLIP_NORM, MAX_CLIP_NORM]`, or an update that still does not
/// fit after `MAX_PASSES` gives zeros: a device's failed training sends a zero update.
///
/// The work does not depend on the values: every pass runs (the first that fits is kept), and a
/// non-finite update is passed over like any other before zeros are chosen. A device clips at its
/// send instant, and when it sends must not say how close its update came to the clip norm, or
/// that its training diverged (docs/privacy.md, "Time").
pub fn clip_to_grid(update: &[f32], clip_norm: f64) -> Vec<i64> {
    let norm = update
        .iter()
        .map(|v| f64::from(*v) * f64::from(*v))
        .sum::<f64>()
        .sqrt();
    let clip_ok =
        (crate::policy::MIN_CLIP_NORM..=crate::policy::MAX_CLIP_NORM).contains(&clip_norm);
    let usable = norm.is_finite() && clip_ok;
    let clip = if clip_ok { clip_norm } else { 1.0 };
    let mut factor = if usable && norm > clip {
        clip / norm
    } else {
        1.0
    };
    // Worst-case rounding adds sqrt(len)/2 units of norm (plus one), as a share of the clip's.
    let margin = ((update.len() as f64).sqrt() / 2.0 + 1.0) / GRID_UNITS_PER_CLIP as f64;
    // Every pass writes its grid to `chosen` (the first that fits) or to `scratch`: the same
    // work whichever pass fits, or none.
    let mut chosen = vec![0i64; update.len()];
    let mut scratch = vec![0i64; update.len()];
    let mut found = false;
    let mut grid = vec![0i64; update.len()];
    // A non-finite update is passed over as zeros (the same work), then zeros are sent; both
    // buffers are made either way.
    let zeros = vec![0f32; update.len()];
    let zero_grid = vec![0i64; update.len()];
    let source: &[f32] = if usable { update } else { &zeros };
    for _ in 0..MAX_PASSES {
        let units = GRID_UNITS_PER_CLIP as f64 * (factor / clip);
        for (slot, v) in grid.iter_mut().zip(source) {
            *slot = (f64::from(*v) * units).round_ties_even() as i64;
        }
        // Every value is within 2^16 units (the factor clipped the norm first), so each square
        // is at most 2^32 and the u64 sum is exact for any model under 2^32 values (the model
        // limit is far below).
        let squares: u64 = grid.iter().map(|v| v.unsigned_abs().pow(2)).sum();
        let keep = !found && u128::from(squares) <= MAX_SQUARES;
        let target = if keep { &mut chosen } else { &mut scratch };
        target.copy_from_slice(&grid);
        found |= keep;
        factor *= (1.0 - margin).max(0.5);
    }
    if found && usable { chosen } else { zero_grid }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn squares(grid: &[i64]) -> u128 {
        grid.iter()
            .map(|v| u128::from(v.unsigned_abs()).pow(2))
            .sum()
    }

    #[test]
    fn an_update_within_the_clip_norm_is_scaled_and_rounded_only() {
        let grid = clip_to_grid(&[0.5, -0.25, 0.0], 1.0);
        assert_eq!(grid, vec![32768, -16384, 0]);
    }

    #[test]
    fn an_update_above_the_clip_norm_lands_exactly_within_the_bound() {
        // Norm 5 at clip norm 1, and updates whose rounding alone would cross the bound.
        // [3, 4] / 5 is [39321.6, 52428.8] units: rounded, [39322, 52429] would cross 2^32 by
        // 52,429, so the update is shrunk by the rounding's worst case and rounded again.
        let grid = clip_to_grid(&[3.0, 4.0], 1.0);
        assert_eq!(grid, vec![39321, 52427]);
        assert!(squares(&grid) <= MAX_SQUARES);
        for len in [1usize, 7, 1000, 65_536] {
            let update: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let grid = clip_to_grid(&update, 0.5);
            assert!(squares(&grid) <= MAX_SQUARES, "len {len}");
            // Clipped, not crushed: within a rounding margin of the bound.
            let norm = (squares(&grid) as f64).sqrt();
            assert!(
                norm > GRID_UNITS_PER_CLIP as f64 * 0.99,
                "len {len}: {norm}"
            );
        }
    }

    #[test]
    fn a_non_finite_update_or_clip_norm_gives_zeros() {
        assert_eq!(clip_to_grid(&[1.0, f32::NAN], 1.0), vec![0, 0]);
        assert_eq!(clip_to_grid(&[f32::INFINITY], 1.0), vec![0]);
        assert_eq!(clip_to_grid(&[1.0], 0.0), vec![0]);
        assert_eq!(clip_to_grid(&[1.0], f64::NAN), vec![0]);
        // Outside the policy's clip norms (where the scale would overflow to infinity).
        assert_eq!(clip_to_grid(&[1.0, 1.0], 1e-305), vec![0, 0]);
        assert_eq!(clip_to_grid(&[1.0], 1e7), vec![0]);
    }

    #[test]
    fn the_largest_values_and_clip_norms_of_the_policy_still_fit() {
        let grid = clip_to_grid(&[f32::MAX, -f32::MAX, 1.0], crate::policy::MIN_CLIP_NORM);
        assert!(squares(&grid) <= MAX_SQUARES);
        assert!(grid[0] > 46_000 && grid[1] < -46_000, "{grid:?}");
        let grid = clip_to_grid(&[f32::MIN_POSITIVE, 0.0], crate::policy::MAX_CLIP_NORM);
        assert_eq!(grid, vec![0, 0]);
    }
}
