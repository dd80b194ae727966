//! The enclave's discrete Gaussian: the exact sampler in machine words of Canonne, Kamath, Steinke
//! 2020 ("The Discrete Gaussian for Differential Privacy", Algorithms 1-3), which lives in
//! `confed_dp::exact_sampler` so that the key services' distributed noise draws with the same.
//!
//! OpenDP implements the same algorithm over arbitrary-precision rationals and is exact but slow
//! (about 0.1 million samples/s here). This one restricts the variance to an integer `sigma^2 <=
//! 2^60` (the enclave rounds the calibrated variance *up*, which only adds noise) so that every
//! quantity the algorithm compares is a ratio of integers below 2^128: it draws only uniform
//! integers and compares them, never a float. A test compares its output with OpenDP's.
//!
//! The single approximation: a Laplace candidate so far in the tail that `(|y| t - sigma^2)^2`
//! exceeds u128 is rejected instead of accepted with probability `exp(-gamma)`; there `gamma >=
//! 2^128 / 2^123 = 32`, so the output distribution moves by less than `e^-32 * P[tail]`, which is
//! below 2^-1000 for every scale the grid allows.
//!
//! Randomness comes from the caller (the enclave uses ChaCha12 keyed from a secret, see
//! `aggregate::noise`), so a retried job reproduces its noise bit for bit.

use rand_core::RngCore;

use confed_dp::exact_sampler;

use super::DpError;
use super::grid::MAX_SCALE_GRID;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscreteGaussian {
    /// The variance, an integer.
    sigma2: u64,
    /// floor(sigma) + 1: the Laplace proposal's scale.
    t: u64,
}

/// `ceil(sqrt(v))`, exactly.
pub(crate) fn ceil_sqrt(v: u128) -> u128 {
    let root = v.isqrt();
    if root * root == v { root } else { root + 1 }
}

impl DiscreteGaussian {
    /// The discrete Gaussian whose variance is `scale^2` rounded up to an integer.
    pub fn at_least(scale: f64) -> Result<Self, DpError> {
        if !(scale.is_finite() && scale >= 1.0 && scale <= MAX_SCALE_GRID as f64) {
            return Err(DpError::ScaleOutOfRange(scale));
        }
        // A whole-number scale (a count's 2 x count_stddev, an evaluation's 1024 x stddev)
        // squares exactly; any other takes one part in 2^40 upward, absorbing the float rounding
        // of the square. Adding it to an exact square gave one unit too many (count_stddev 5
        // recorded as 5.0249).
        let sigma2 = if scale.fract() == 0.0 {
            (scale as u64).pow(2)
        } else {
            (scale * scale * (1.0 + 1e-12)).ceil() as u64
        };
        Ok(Self::with_variance(sigma2))
    }

    /// The discrete Gaussian with integer variance `sigma2` (1..=2^60).
    pub fn with_variance(sigma2: u64) -> Self {
        let sigma2 = sigma2.clamp(1, MAX_SCALE_GRID * MAX_SCALE_GRID);
        Self {
            sigma2,
            t: exact_sampler::proposal_scale(sigma2),
        }
    }

    /// The standard-deviation parameter sigma (sqrt of the integer variance).
    pub fn scale(&self) -> f64 {
        (self.sigma2 as f64).sqrt()
    }

    pub fn variance(&self) -> u64 {
        self.sigma2
    }

    /// (sigma^2, t): the algorithm's parameters.
    pub(crate) fn parameters(&self) -> (u64, u64) {
        (self.sigma2, self.t)
    }

    /// One sample (`confed_dp::exact_sampler`: the key services draw distributed noise with the
    /// same algorithm).
    pub fn sample<R: RngCore>(&self, rng: &mut R) -> i64 {
        exact_sampler::sample(self.sigma2, self.t, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variance_is_rounded_up_never_down() {
        let g = DiscreteGaussian::at_least(4.5).unwrap();
        assert_eq!(g.variance(), 21); // 20.25 -> 21
        assert!(g.scale() >= 4.5);
        // A whole-number scale is its own square, not one more (a count_stddev of 5 is
        // recorded as 5, not 5.0249).
        assert_eq!(DiscreteGaussian::at_least(10.0).unwrap().variance(), 100);
        assert_eq!(
            DiscreteGaussian::at_least(2f64.powi(30))
                .unwrap()
                .variance(),
            1 << 60
        );
        // Just above a whole number still rounds up.
        assert_eq!(
            DiscreteGaussian::at_least(10.0 + 1e-9).unwrap().variance(),
            101
        );
        assert!(DiscreteGaussian::at_least(0.5).is_err());
        assert!(DiscreteGaussian::at_least(f64::NAN).is_err());
        assert!(DiscreteGaussian::at_least(2f64.powi(31)).is_err());
    }
}
