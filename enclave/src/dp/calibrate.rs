//! Noise calibration and privacy accounting with OpenDP.
//!
//! The privacy unit is one device per round (add/remove neighbours), so one round's sum of
//! clipped updates has L2 sensitivity `clip_norm`. Each round adds discrete Gaussian noise on a
//! fixed-point grid (see `grid`); rounds compose under zero-concentrated DP (zCDP) by adding rho,
//! and the task's total rho converts to (epsilon, delta) with OpenDP's zCDP -> approximate-DP cast.
//!
//! `R` rounds at per-round scale `sigma` spend exactly what one release at scale `sigma / sqrt(R)`
//! spends (rho adds: `R * D^2 / (2 sigma^2)`), so calibration searches one OpenDP measurement for
//! the scale that meets (epsilon, delta) and multiplies it by `sqrt(R)`. Every figure below comes
//! from OpenDP's privacy maps on the integer grid the enclave really samples on.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use opendp::combinators::{make_fix_delta, make_zCDP_to_approxDP};
use opendp::domains::AtomDomain;
use opendp::measurements::make_gaussian;
use opendp::measures::ZeroConcentratedDivergence;
use opendp::metrics::AbsoluteDistance;

use super::DpError;
use super::grid::{GRID_UNITS_PER_CLIP, MAX_SCALE_GRID};

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

type Key = (u64, u64, u32);

fn cache() -> &'static Mutex<HashMap<Key, Calibration>> {
    static CACHE: OnceLock<Mutex<HashMap<Key, Calibration>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// One release of the grid mechanism at `scale_grid`, as (epsilon, delta)-DP at `delta`.
fn epsilon_at(scale_grid: f64, delta: f64) -> Result<f64, DpError> {
    let gaussian = make_gaussian::<_, _, ZeroConcentratedDivergence>(
        AtomDomain::<i64>::default(),
        AbsoluteDistance::<i64>::default(),
        scale_grid,
        None,
    )
    .map_err(opendp_error)?;
    let approx = make_fix_delta(
        &make_zCDP_to_approxDP(gaussian).map_err(opendp_error)?,
        delta,
    )
    .map_err(opendp_error)?;
    let (epsilon, _) = approx.map(&GRID_UNITS_PER_CLIP).map_err(opendp_error)?;
    Ok(epsilon)
}

/// rho of one release of the grid mechanism at `scale_grid`.
pub fn rho_at(scale_grid: f64) -> Result<f64, DpError> {
    make_gaussian::<_, _, ZeroConcentratedDivergence>(
        AtomDomain::<i64>::default(),
        AbsoluteDistance::<i64>::default(),
        scale_grid,
        None,
    )
    .and_then(|m| m.map(&GRID_UNITS_PER_CLIP))
    .map_err(opendp_error)
}

fn opendp_error(e: opendp::error::Error) -> DpError {
    DpError::OpenDp(e.to_string())
}

/// The smallest per-round noise that keeps `rounds` releases within (epsilon, delta).
/// Cached per budget: the search evaluates OpenDP's maps a few dozen times.
pub fn calibrate(epsilon: f64, delta: f64, rounds: u32) -> Result<Calibration, DpError> {
    let valid = epsilon.is_finite() && epsilon > 0.0 && delta > 0.0 && delta < 1.0 && rounds > 0;
    if !valid {
        return Err(DpError::InvalidBudget(format!(
            "epsilon must be > 0, delta in (0, 1) and rounds >= 1 (got {epsilon}, {delta}, {rounds})"
        )));
    }
    let key = (epsilon.to_bits(), delta.to_bits(), rounds);
    if let Some(found) = cache().lock().expect("calibration cache").get(&key) {
        return Ok(*found);
    }
    // Bisection on the single-release scale in grid units: epsilon falls as the scale grows.
    let fits = |scale: f64| epsilon_at(scale, delta).map(|e| e <= epsilon);
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
    let single = hi / GRID_UNITS_PER_CLIP as f64;
    let noise_multiplier = single * f64::from(rounds).sqrt();
    let calibration = Calibration {
        noise_multiplier,
        rho_per_round: rho_at(noise_multiplier * GRID_UNITS_PER_CLIP as f64)?,
    };
    cache()
        .lock()
        .expect("calibration cache")
        .insert(key, calibration);
    Ok(calibration)
}

/// (epsilon at `delta`) of a total zCDP `rho`: one grid release at the scale that costs `rho`.
pub fn epsilon_of_rho(rho: f64, delta: f64) -> Result<f64, DpError> {
    if rho <= 0.0 {
        return Ok(0.0);
    }
    epsilon_at(GRID_UNITS_PER_CLIP as f64 / (2.0 * rho).sqrt(), delta)
}

/// Privacy spent after `releases` rounds at per-round grid scale `scale_grid`: (rho, epsilon at
/// `delta`). Uses the same OpenDP maps as calibration.
pub fn spent(scale_grid: f64, releases: u32, delta: f64) -> Result<(f64, f64), DpError> {
    if releases == 0 {
        return Ok((0.0, 0.0));
    }
    let equivalent = scale_grid / f64::from(releases).sqrt();
    Ok((
        rho_at(scale_grid)? * f64::from(releases),
        epsilon_at(equivalent, delta)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_round_epsilon_one_matches_opendp_python_reference() {
        // OpenDP's Python package: scale 4.530877 for epsilon 1, delta 1e-6, sensitivity 1.
        let c = calibrate(1.0, 1e-6, 1).unwrap();
        assert!((c.noise_multiplier - 4.5309).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn more_rounds_need_sqrt_more_noise_per_round() {
        let one = calibrate(2.0, 1e-6, 1).unwrap();
        let many = calibrate(2.0, 1e-6, 16).unwrap();
        assert!((many.noise_multiplier / one.noise_multiplier - 4.0).abs() < 1e-6);
        assert!((many.rho_per_round * 16.0 - one.rho_per_round).abs() < 1e-9);
    }

    #[test]
    fn spending_every_planned_round_stays_within_the_budget() {
        let c = calibrate(3.0, 1e-5, 10).unwrap();
        let scale = c.noise_multiplier * GRID_UNITS_PER_CLIP as f64;
        let (_, eps_half) = spent(scale, 5, 1e-5).unwrap();
        let (_, eps_all) = spent(scale, 10, 1e-5).unwrap();
        assert!(eps_half < eps_all);
        assert!(eps_all <= 3.0 && eps_all > 2.99, "{eps_all}");
    }

    #[test]
    fn invalid_budgets_are_refused() {
        assert!(matches!(
            calibrate(0.0, 1e-6, 1),
            Err(DpError::InvalidBudget(_))
        ));
        assert!(matches!(
            calibrate(1.0, 0.0, 1),
            Err(DpError::InvalidBudget(_))
        ));
        assert!(matches!(
            calibrate(1.0, 1e-6, 0),
            Err(DpError::InvalidBudget(_))
        ));
    }
}
