//! Noise calibration and privacy accounting, over an `Accountant`'s two privacy maps.
//!
//! The privacy unit is one device per round (add/remove neighbours), so one round's sum of
//! clipped updates has L2 sensitivity `clip_norm`. Each round adds discrete Gaussian noise on a
//! fixed-point grid (see `grid`); rounds compose under zero-concentrated DP (zCDP) by adding rho,
//! and the task's total rho converts to (epsilon, delta) with the accountant's zCDP ->
//! approximate-DP conversion (OpenDP's in the enclave, `closed_form` in the front end).
//!
//! `R` rounds at per-round scale `sigma` spend exactly what one release at scale `sigma / sqrt(R)`
//! spends (rho adds: `R * D^2 / (2 sigma^2)`), so calibration searches one release for the scale
//! that meets (epsilon, delta) and multiplies it by `sqrt(R)`. Every figure below comes from the
//! accountant's maps on the integer grid the enclave really samples on.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use super::closed_form::ClosedForm;
use super::grid::{GRID_UNITS_PER_CLIP, MAX_SCALE_GRID};
use super::{Accountant, DpError};

/// Largest noise multiplier a task may be calibrated to: beyond this the grid's exact sampler
/// would leave its machine-word range (`MAX_SCALE_GRID`).
pub const MAX_NOISE_MULTIPLIER: f64 = MAX_SCALE_GRID as f64 / GRID_UNITS_PER_CLIP as f64;

/// A task's noise, fixed once from its budget and planned rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Per-round noise standard deviation in units of the clip norm (sigma / C).
    pub noise_multiplier: f64,
    /// zCDP rho one round spends.
    pub rho_per_round: f64,
}

/// (accountant, epsilon bits, delta bits, release units bits).
type Key = (&'static str, u64, u64, u64);

fn cache() -> &'static Mutex<HashMap<Key, Calibration>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Calibration>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The smallest per-round noise that keeps `rounds` releases within (epsilon, delta).
/// Cached per accountant and budget: the search evaluates the maps a few dozen times.
pub fn calibrate(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<Calibration, DpError> {
    if rounds == 0 {
        return Err(DpError::InvalidBudget(format!(
            "rounds must be >= 1 (got {rounds})"
        )));
    }
    calibrate_units(accountant, epsilon, delta, f64::from(rounds))
}

/// The smallest noise multiplier that keeps a mechanism costing `units` Gaussian releases of
/// sensitivity one clip norm (a real number: a BLT's squared sensitivity) within (epsilon,
/// delta).
pub fn calibrate_units(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    units: f64,
) -> Result<Calibration, DpError> {
    let valid = epsilon.is_finite()
        && epsilon > 0.0
        && delta > 0.0
        && delta < 1.0
        && units.is_finite()
        && units > 0.0;
    if !valid {
        return Err(DpError::InvalidBudget(format!(
            "epsilon must be > 0, delta in (0, 1) and the releases positive (got {epsilon}, {delta}, {units})"
        )));
    }
    let key = (
        accountant.name(),
        epsilon.to_bits(),
        delta.to_bits(),
        units.to_bits(),
    );
    if let Some(found) = cache().lock().expect("calibration cache").get(&key) {
        return Ok(*found);
    }
    let shortcut = accountant.name() != ClosedForm.name();
    let hi = search_scale(accountant, epsilon, delta, shortcut)?;
    let single = hi / GRID_UNITS_PER_CLIP as f64;
    let noise_multiplier = single * units.sqrt();
    let calibration = Calibration {
        noise_multiplier,
        rho_per_round: accountant.rho_at(noise_multiplier * GRID_UNITS_PER_CLIP as f64)?,
    };
    cache()
        .lock()
        .expect("calibration cache")
        .insert(key, calibration);
    Ok(calibration)
}

/// How far from the budget, relative, the closed form must put a scale for its answer to stand
/// in for the accountant's in the search: a thousand times the largest gap between the closed
/// form and OpenDP that the enclave's tests measure over their grid (1e-9).
const SHORTCUT_MARGIN: f64 = 1e-6;

/// The smallest single-release scale in grid units (to 1e-9 relative) at which one release is
/// within (epsilon, delta) by `accountant`: a bisection, epsilon falling as the scale grows. With
/// `shortcut`, a step whose scale the closed form (the same published conversion in plain f64)
/// puts clearly inside or outside the budget takes its answer, and only the steps near the
/// budget ask the accountant, with about a third of its evaluations (OpenDP's cost 2 ms each: a
/// first calibration took 64 ms, 26 ms with it). The result is then the accountant's own word:
/// it confirms the smallest scale the search took as fitting and the largest it took as not
/// (epsilon being monotone in the scale, every decision between agrees), or the search runs
/// again without the shortcut. So the result is the plain search's bit for bit (the enclave's
/// tests compare both over a grid of budgets, and this module's with an accountant the shortcut
/// gets wrong).
pub fn search_scale(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    shortcut: bool,
) -> Result<f64, DpError> {
    let (hi, refused) = bisect(accountant, epsilon, delta, shortcut)?;
    if !shortcut {
        return Ok(hi);
    }
    let fits = |scale: f64| accountant.epsilon_at(scale, delta).map(|e| e <= epsilon);
    let confirmed = fits(hi)? && refused.map_or(Ok(true), |lo| fits(lo).map(|f| !f))?;
    if confirmed {
        Ok(hi)
    } else {
        bisect(accountant, epsilon, delta, false).map(|(hi, _)| hi)
    }
}

/// `search_scale`'s bisection: the scale found and the largest scale it took as not fitting.
fn bisect(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    shortcut: bool,
) -> Result<(f64, Option<f64>), DpError> {
    let refused = std::cell::Cell::new(None::<f64>);
    let fits = |scale: f64| -> Result<bool, DpError> {
        let mut decided = None;
        if shortcut && let Ok(approx) = ClosedForm.epsilon_at(scale, delta) {
            if approx <= epsilon * (1.0 - SHORTCUT_MARGIN) {
                decided = Some(true);
            } else if approx > epsilon * (1.0 + SHORTCUT_MARGIN) {
                decided = Some(false);
            }
        }
        let fits = match decided {
            Some(fits) => fits,
            None => accountant.epsilon_at(scale, delta)? <= epsilon,
        };
        if !fits {
            refused.set(Some(refused.get().map_or(scale, |r: f64| r.max(scale))));
        }
        Ok(fits)
    };
    let (mut lo, mut hi) = (
        1e-3 * GRID_UNITS_PER_CLIP as f64,
        GRID_UNITS_PER_CLIP as f64,
    );
    while !fits(hi)? {
        hi *= 2.0;
        if hi > MAX_SCALE_GRID as f64 {
            return Err(DpError::BudgetTooSmall { epsilon, delta });
        }
    }
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
        if hi - lo < 1e-9 * hi {
            break;
        }
    }
    Ok((hi, refused.get()))
}

/// (epsilon at `delta`) of a total zCDP `rho`: one grid release at the scale that costs `rho`.
pub fn epsilon_of_rho(accountant: &dyn Accountant, rho: f64, delta: f64) -> Result<f64, DpError> {
    if rho <= 0.0 {
        return Ok(0.0);
    }
    accountant.epsilon_at(GRID_UNITS_PER_CLIP as f64 / (2.0 * rho).sqrt(), delta)
}

/// Privacy spent after `releases` rounds at per-round grid scale `scale_grid`: (rho, epsilon at
/// `delta`). Uses the same maps as calibration.
pub fn spent(
    accountant: &dyn Accountant,
    scale_grid: f64,
    releases: u32,
    delta: f64,
) -> Result<(f64, f64), DpError> {
    if releases == 0 {
        return Ok((0.0, 0.0));
    }
    let equivalent = scale_grid / f64::from(releases).sqrt();
    Ok((
        accountant.rho_at(scale_grid)? * f64::from(releases),
        accountant.epsilon_at(equivalent, delta)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An accountant a hair off the closed form (0.1 %, a thousand times the shortcut's
    /// margin): the shortcut's decisions near the budget are then wrong, and the search must
    /// notice and land where the plain one does.
    struct Skewed;

    impl Accountant for Skewed {
        fn name(&self) -> &'static str {
            "skewed"
        }
        fn rho_at(&self, scale_grid: f64) -> Result<f64, DpError> {
            ClosedForm.rho_at(scale_grid)
        }
        fn epsilon_at(&self, scale_grid: f64, delta: f64) -> Result<f64, DpError> {
            Ok(ClosedForm.epsilon_at(scale_grid, delta)? * 1.001)
        }
    }

    #[test]
    fn a_shortcut_that_decided_wrong_is_caught_and_the_plain_search_wins() {
        for epsilon in [0.5, 4.0, 20.0] {
            let quick = search_scale(&Skewed, epsilon, 1e-6, true).unwrap();
            let plain = search_scale(&Skewed, epsilon, 1e-6, false).unwrap();
            assert_eq!(quick.to_bits(), plain.to_bits(), "epsilon {epsilon}");
            // ... and what the shortcut alone would have found differs (so the test bites).
            let (unchecked, _) = bisect(&Skewed, epsilon, 1e-6, true).unwrap();
            assert_ne!(unchecked.to_bits(), plain.to_bits(), "epsilon {epsilon}");
        }
    }
}
