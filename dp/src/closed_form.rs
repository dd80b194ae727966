//! The grid mechanism's privacy maps in plain f64, for the front end's plan check.
//!
//! - rho: discrete Gaussian noise of standard deviation `s` on a sum of sensitivity `D` is
//!   `D^2 / (2 s^2)`-zCDP (Canonne, Kamath and Steinke, "The Discrete Gaussian for Differential
//!   Privacy", 2020, Theorem 14).
//! - (epsilon, delta): a rho-zCDP release is (epsilon, delta)-DP for every alpha > 1 with
//!   `delta = exp((alpha - 1)(alpha rho - epsilon) + alpha ln(1 - 1/alpha)) / (alpha - 1)`
//!   (ibid., Corollary 13). The log of that delta is convex in alpha with derivative
//!   `(2 alpha - 1) rho - epsilon + ln(1 - 1/alpha)`, so the best alpha is found by bisection on
//!   the derivative's sign; epsilon for a given delta by bisection on the (decreasing) delta.
//!
//! This is the conversion OpenDP implements, with the same search bounds (alpha at least 1.01,
//! as OpenDP, where smaller alphas only matter for useless budgets), but without OpenDP's
//! outward rounding of each operation; the enclave's tests hold the two within 1e-9 (relative)
//! of each other.

use super::grid::GRID_UNITS_PER_CLIP;
use super::{Accountant, DpError};

/// The smallest Renyi order searched, as OpenDP.
const MIN_ALPHA: f64 = 1.01;

/// The closed-form accountant.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClosedForm;

impl Accountant for ClosedForm {
    fn name(&self) -> &'static str {
        "the closed-form accountant"
    }

    fn rho_at(&self, scale_grid: f64) -> Result<f64, DpError> {
        if !(scale_grid.is_finite() && scale_grid > 0.0) {
            return Err(self.refusal(format!(
                "the noise scale must be positive and finite (got {scale_grid})"
            )));
        }
        let ratio = GRID_UNITS_PER_CLIP as f64 / scale_grid;
        Ok(ratio * ratio / 2.0)
    }

    fn epsilon_at(&self, scale_grid: f64, delta: f64) -> Result<f64, DpError> {
        if !(0.0..=1.0).contains(&delta) {
            return Err(self.refusal(format!("delta must be in [0, 1] (got {delta})")));
        }
        let rho = self.rho_at(scale_grid)?;
        epsilon_of(rho, delta).ok_or_else(|| {
            self.refusal(format!(
                "the conversion of rho {rho} at delta {delta} leaves the range of f64"
            ))
        })
    }
}

impl ClosedForm {
    fn refusal(&self, reason: String) -> DpError {
        DpError::Accountant {
            accountant: self.name(),
            reason,
        }
    }
}

/// The smallest delta the conversion gives a rho-zCDP release at `epsilon`; `None` where an
/// intermediate leaves f64's range (OpenDP refuses there too), never a made-up bound.
pub fn delta_of(rho: f64, epsilon: f64) -> Option<f64> {
    if rho == 0.0 || epsilon.is_infinite() {
        return Some(0.0);
    }
    // The optimal alpha is below (epsilon + 1) / (2 rho) + 2, where the derivative is positive.
    let (mut low, mut high) = (MIN_ALPHA, (epsilon + 1.0) / (2.0 * rho) + 2.0);
    loop {
        let middle = low + (high - low) / 2.0;
        if middle == low || middle == high {
            break;
        }
        let derivative = (2.0 * middle - 1.0) * rho - epsilon + (-1.0 / middle).ln_1p();
        if derivative < 0.0 {
            low = middle;
        } else {
            high = middle;
        }
    }
    let alpha = high;
    let exponent = (alpha - 1.0) * (alpha * rho - epsilon) + alpha * (-1.0 / alpha).ln_1p();
    let delta = exponent.exp() / (alpha - 1.0);
    (alpha.is_finite() && delta.is_finite()).then(|| delta.min(1.0))
}

/// The smallest epsilon whose delta (`delta_of`) is at most `delta`; `None` where `delta_of` is.
pub fn epsilon_of(rho: f64, delta: f64) -> Option<f64> {
    if rho == 0.0 || delta >= 1.0 || delta_of(rho, 0.0)? <= delta {
        return Some(0.0);
    }
    let mut high = 2.0f64;
    while delta_of(rho, high)? > delta {
        high *= high;
        if high.is_infinite() {
            return Some(f64::INFINITY);
        }
    }
    let mut low = 0.0f64;
    loop {
        let middle = low + (high - low) / 2.0;
        if middle == low || middle == high {
            return Some(high);
        }
        if delta_of(rho, middle)? > delta {
            low = middle;
        } else {
            high = middle;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_release_at_the_python_reference_scale_spends_epsilon_one() {
        // OpenDP's Python package: scale 4.530877 per unit of sensitivity for epsilon 1, delta
        // 1e-6 (zCDP, then the conversion).
        let scale = 4.530877 * GRID_UNITS_PER_CLIP as f64;
        let epsilon = ClosedForm.epsilon_at(scale, 1e-6).unwrap();
        assert!((epsilon - 1.0).abs() < 1e-5, "{epsilon}");
    }

    #[test]
    fn the_conversion_is_monotone_and_its_delta_is_a_probability() {
        let rho = 0.05;
        let mut last = f64::INFINITY;
        for epsilon in [0.1, 0.5, 1.0, 2.0, 4.0, 8.0] {
            let delta = delta_of(rho, epsilon).unwrap();
            assert!(
                (0.0..=1.0).contains(&delta) && delta < last,
                "{epsilon}: {delta}"
            );
            last = delta;
        }
        assert!(epsilon_of(0.05, 1e-6).unwrap() < epsilon_of(0.05, 1e-9).unwrap());
        assert!(epsilon_of(0.01, 1e-6).unwrap() < epsilon_of(0.05, 1e-6).unwrap());
        assert_eq!(epsilon_of(0.0, 1e-6), Some(0.0));
    }

    #[test]
    fn the_found_epsilon_meets_delta_and_a_hair_less_does_not() {
        for (rho, delta) in [(0.01, 1e-6), (0.5, 1e-5), (3.0, 1e-9)] {
            let epsilon = epsilon_of(rho, delta).unwrap();
            assert!(delta_of(rho, epsilon).unwrap() <= delta);
            assert!(delta_of(rho, epsilon * (1.0 - 1e-9)).unwrap() > delta);
        }
    }

    #[test]
    fn scales_and_deltas_outside_their_ranges_are_refused_naming_the_accountant() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let error = ClosedForm.rho_at(bad).unwrap_err();
            assert!(
                error.to_string().contains("closed-form accountant"),
                "{error}"
            );
        }
        assert!(ClosedForm.epsilon_at(1e5, 1.5).is_err());
    }

    #[test]
    fn a_conversion_that_leaves_f64_is_refused_not_bounded() {
        // rho this large overflows exp (OpenDP refuses it too); a made-up delta of 1 would let
        // a search conclude anything.
        assert_eq!(delta_of(1e6, 1.0), None);
        assert!(ClosedForm.epsilon_at(1e-3, 1e-6).is_err());
    }
}
