//! What BLT noise costs one device (zCDP), and the noise lattice it runs on.
//!
//! The enclave releases, for round `t`, `y_t = x_t + round(sum_{i<t} c_{t-i} x_i) + z_t` on a
//! lattice of `U = GRID_UNITS_PER_CLIP * 2^lattice_bits` units per clip norm (the running part
//! of `C x` computed exactly in fixed point and rounded once to the lattice; `z_t` discrete
//! Gaussian on the lattice), and publishes `C^-1 y` computed from the `y`s alone
//! (docs/privacy.md, "DP-FTRL with BLT noise"). So the releases are one discrete Gaussian
//! mechanism on a deterministic function `G` of the round sums, and its sensitivity is what one
//! device can move `G`:
//!
//! - `C` times its contributions: at most `sens_r` clip norms through round `r`, the
//!   min-separation sensitivity of `C`'s first `r` rows (`blt::minsep_sensitivity_squared`,
//!   participations `ceil(r / b)`), computed in f64 from the policy's exact coefficients and
//!   raised by `SENSITIVITY_MARGIN` for its rounding;
//! - plus the rounding: for every value and round the two roundings (with and without the
//!   device) differ from the exact difference by less than one lattice unit (plus the fixed
//!   point's error, far below `ROUNDING_MARGIN`), so at most `sqrt(r * max_values)` units.
//!
//! Through round `r` the task has spent what `(sens_r + slack_r)^2` Gaussian releases of one
//! clip norm's sensitivity spend at the same noise multiplier: `units_through`.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use confed_protocol::blt_noise::{BltNoise, MAX_LATTICE_BITS, quantize};
use confed_protocol::policy::{DpMechanism, Mechanism};

use super::accounting::calibrate_task;
use super::blt::{Blt, ErrorKind, coefficients, minsep_sensitivity_squared};
use super::blt_optimize::optimize_for;
use super::calibrate::calibrate_units;
use super::grid::{GRID_UNITS_PER_CLIP, MAX_SCALE_GRID};
use super::{Accountant, DpError};

/// Relative allowance on the f64 sensitivity for its rounding (the coefficients' powers and the
/// sums are exact to about 1e-13 relative).
pub const SENSITIVITY_MARGIN: f64 = 1e-9;
/// Relative allowance on the rounding slack for the fixed point's own error: the two runs' buffers
/// each drift by less than `(rounds * sum(omega) + buffers) * 2^-40` lattice units per value, so
/// the two roundings differ from the exact difference by less than `1 + 2 (rounds + 10) 2^-40`,
/// below `1 + 2e-8` for the at most `MAX_BLT_ROUNDS` (10,000) rounds a BLT policy may plan.
pub const ROUNDING_MARGIN: f64 = 1e-6;

/// Lattice units per clip norm.
pub fn units_per_clip(blt: &BltNoise) -> f64 {
    (GRID_UNITS_PER_CLIP as f64) * f64::from(1u32 << blt.lattice_bits)
}

/// Sensitivity of `C`'s first `round` rows in clip norms (before the margin).
pub fn sensitivity_through(blt: &BltNoise, round: u64) -> f64 {
    if round == 0 {
        return 0.0;
    }
    let rows = round as usize;
    let c = coefficients(&blt.decays(), &blt.scales(), rows);
    let participations = round.div_ceil(u64::from(blt.min_separation)) as u32;
    minsep_sensitivity_squared(&c, blt.min_separation, participations).sqrt()
}

/// The rounding's share of the sensitivity through `round`, in clip norms.
pub fn rounding_slack(blt: &BltNoise, round: u64) -> f64 {
    (1.0 + ROUNDING_MARGIN) * ((round as f64) * (blt.max_values as f64)).sqrt()
        / units_per_clip(blt)
}

/// Gaussian releases of one clip norm's sensitivity that rounds `1..=round` cost one device.
pub fn units_through(blt: &BltNoise, round: u64) -> f64 {
    if round == 0 {
        return 0.0;
    }
    let sensitivity = sensitivity_through(blt, round) * (1.0 + SENSITIVITY_MARGIN);
    (sensitivity + rounding_slack(blt, round)).powi(2)
}

/// The finest lattice for noise multiplier `nominal` (the calibration without the rounding
/// slack): the most bits, up to `MAX_LATTICE_BITS`, that keep the noise's standard deviation in
/// lattice units at most half the sampler's range. Usually room enough for the slack and the side
/// releases' share; `fit_lattice` coarsens it when not.
pub fn lattice_bits_for(nominal: f64) -> u32 {
    let mut bits = 0;
    while bits < MAX_LATTICE_BITS
        && nominal * GRID_UNITS_PER_CLIP as f64 * f64::from(1u32 << (bits + 1))
            <= MAX_SCALE_GRID as f64 / 2.0
    {
        bits += 1;
    }
    bits
}

/// The BLT noise of a task with `rounds` planned rounds and budget (epsilon, delta): `blt`'s
/// matrix with the lattice chosen for its nominal noise (`lattice_bits_for`).
pub fn with_lattice(
    accountant: &dyn Accountant,
    blt: BltNoise,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<BltNoise, DpError> {
    let sensitivity = sensitivity_through(&blt, u64::from(rounds));
    let nominal = calibrate_units(accountant, epsilon, delta, sensitivity * sensitivity)?;
    BltNoise::new(
        blt.min_separation,
        &blt.decays(),
        &blt.scales(),
        blt.max_values,
        lattice_bits_for(nominal.noise_multiplier),
    )
    .map_err(DpError::InvalidBudget)
}

/// `mechanism` with its BLT lattice coarsened, one bit at a time, until the noise of the whole
/// calibration (the rounding charge, adaptive clipping's and evaluation's shares included) fits
/// the sampler's range; other mechanisms unchanged.
pub fn fit_lattice(
    accountant: &dyn Accountant,
    mechanism: DpMechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<DpMechanism, DpError> {
    let mut current = mechanism;
    loop {
        let Mechanism::Blt(blt) = current.noise else {
            return Ok(current);
        };
        let z = calibrate_task(accountant, current, epsilon, delta, rounds)?.noise_multiplier;
        if blt.lattice_bits == 0 || z * units_per_clip(&blt) <= MAX_SCALE_GRID as f64 * (1.0 - 1e-6)
        {
            return Ok(current);
        }
        current.noise = Mechanism::Blt(
            BltNoise::new(
                blt.min_separation,
                &blt.decays(),
                &blt.scales(),
                blt.max_values,
                blt.lattice_bits - 1,
            )
            .map_err(DpError::InvalidBudget)?,
        );
    }
}

/// Most optimized shapes kept; the cache starts over beyond.
const CACHED_SHAPES: usize = 1024;

/// The BLT a task of `rounds` rounds at min separation `min_separation` gets when it names none:
/// optimized for `error` (`blt_optimize`), its numbers rounded to the policy's 2^-52 grid.
/// Cached: the optimization takes up to seconds and depends on nothing else.
pub fn optimized(rounds: u32, min_separation: u32, error: ErrorKind) -> Result<Blt, DpError> {
    type Key = (u32, u32, bool);
    static CACHE: OnceLock<Mutex<HashMap<Key, Blt>>> = OnceLock::new();
    let key = (rounds, min_separation, error == ErrorKind::Max);
    let cache = CACHE.get_or_init(Default::default);
    if let Some(found) = cache.lock().expect("BLT cache").get(&key) {
        return Ok(found.clone());
    }
    let (blt, loss) = optimize_for(rounds, min_separation.min(rounds.max(1)), error);
    if !loss.is_finite() {
        return Err(DpError::InvalidBudget(format!(
            "no valid BLT was found for {rounds} rounds at min_separation {min_separation}; give its buffers explicitly"
        )));
    }
    let quantized = Blt::new(
        blt.decays.iter().map(|t| quantize(*t)).collect(),
        blt.scales.iter().map(|w| quantize(*w)).collect(),
    );
    quantized.check_strategy().map_err(DpError::InvalidBudget)?;
    let mut cache = cache.lock().expect("BLT cache");
    // Bounded: tenants choose the shapes, and a shape costs a few hundred bytes.
    if cache.len() >= CACHED_SHAPES {
        cache.clear();
    }
    cache.insert(key, quantized.clone());
    Ok(quantized)
}

/// A task's BLT noise: its matrix (`explicit`, rounded to the 2^-52 grid, or `optimized`), the
/// policy's `max_values`, and the lattice for its budget (`with_lattice`).
#[allow(clippy::too_many_arguments)]
pub fn task_blt(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    rounds: u32,
    min_separation: u32,
    error: ErrorKind,
    explicit: Option<&Blt>,
    max_values: u64,
) -> Result<BltNoise, DpError> {
    let matrix = match explicit {
        Some(given) => Blt::new(
            given.decays.iter().map(|t| quantize(*t)).collect(),
            given.scales.iter().map(|w| quantize(*w)).collect(),
        ),
        None => optimized(rounds, min_separation, error)?,
    };
    let blt = BltNoise::new(
        min_separation,
        &matrix.decays,
        &matrix.scales,
        max_values,
        0,
    )
    .map_err(DpError::InvalidBudget)?;
    with_lattice(accountant, blt, epsilon, delta, rounds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClosedForm;
    use confed_protocol::blt_noise::quantize;

    fn example(lattice_bits: u32, max_values: u64) -> BltNoise {
        BltNoise::new(
            100,
            &[quantize(0.9879437955729754), quantize(0.6099329689288747)],
            &[quantize(0.2385758094449234), quantize(0.26822153963892403)],
            max_values,
            lattice_bits,
        )
        .unwrap()
    }

    #[test]
    fn the_rounding_slack_is_charged_per_value_and_round_and_shrinks_with_the_lattice() {
        let coarse = example(0, 1 << 20);
        let fine = example(12, 1 << 20);
        let r = 2000;
        let expected = (2000.0f64 * (1 << 20) as f64).sqrt() / 65536.0 * (1.0 + ROUNDING_MARGIN);
        assert!((rounding_slack(&coarse, r) - expected).abs() < 1e-12);
        assert!((rounding_slack(&fine, r) - expected / 4096.0).abs() < 1e-15);
        let sens = sensitivity_through(&fine, r);
        assert!(units_through(&fine, r) > sens * sens);
        assert!(units_through(&fine, r) < sens * sens * 1.001);
    }

    #[test]
    fn one_round_costs_one_release_plus_its_rounding() {
        let blt = example(14, 1);
        let units = units_through(&blt, 1);
        assert!((units - 1.0).abs() < 1e-6, "{units}");
    }

    #[test]
    fn the_lattice_is_as_fine_as_the_sampler_allows_with_room_for_the_slack() {
        // Noise multiplier 10: 10 * 2^16 * 2^m <= 2^29 -> m = 9 (2^9 * 10 = 5120 <= 8192).
        assert_eq!(lattice_bits_for(10.0), 9);
        assert_eq!(lattice_bits_for(0.1), MAX_LATTICE_BITS);
        assert_eq!(lattice_bits_for(10_000.0), 0);
        let blt = with_lattice(&ClosedForm, example(0, 1 << 24), 4.0, 1e-6, 2000).unwrap();
        assert!(blt.lattice_bits > 0);
        // A lattice too fine for the noise is coarsened until it fits.
        let fine = DpMechanism::plain(Mechanism::Blt(example(14, 1 << 24)));
        let fitted = fit_lattice(&ClosedForm, fine, 4.0, 1e-6, 2000).unwrap();
        let Mechanism::Blt(fitted_blt) = fitted.noise else {
            panic!("{fitted:?}")
        };
        assert!(fitted_blt.lattice_bits < 14);
        let z = calibrate_task(&ClosedForm, fitted, 4.0, 1e-6, 2000)
            .unwrap()
            .noise_multiplier;
        assert!(z * units_per_clip(&fitted_blt) <= MAX_SCALE_GRID as f64);
    }
}
