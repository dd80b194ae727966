//! Tails of the noise distributions partition selection is calibrated with: the discrete
//! Gaussian the enclave samples (computed exactly, as a sum of its probability mass), and the
//! continuous Gaussian's quantile the published thresholds use (Google's
//! `GaussianPartitionSelection`, PipelineDP's `create_gaussian_thresholding`), which confed
//! reports beside its own for comparison (docs/privacy.md, "Partition selection").
//!
//! `libm` (rust-lang's port of musl's libm) gives `erfc`; nothing well kept offers the discrete
//! Gaussian's tail, which is a sum of a few thousand terms and written here.

use std::f64::consts::{PI, SQRT_2};

/// The discrete Gaussian with integer variance parameter `variance` (its mass at `x` is
/// proportional to `exp(-x^2 / (2 variance))`, as the enclave's sampler draws).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiscreteGaussianTail {
    variance: u64,
    normalizer: f64,
}

impl DiscreteGaussianTail {
    pub fn new(variance: u64) -> Self {
        let variance = variance.max(1);
        let v = variance as f64;
        // Jacobi's identity: sum over x in Z of exp(-x^2 / 2v) = sqrt(2 pi v) (1 + 2 sum over
        // j >= 1 of exp(-2 pi^2 v j^2)); for v >= 1 the terms past j = 3 are below 1e-150.
        let theta: f64 = (1..=3)
            .map(|j: i32| 2.0 * (-2.0 * PI * PI * v * f64::from(j * j)).exp())
            .sum();
        Self {
            variance,
            normalizer: (2.0 * PI * v).sqrt() * (1.0 + theta),
        }
    }

    pub fn variance(&self) -> u64 {
        self.variance
    }

    /// `P[Z = x]`.
    pub fn mass(&self, x: i64) -> f64 {
        let x = x as f64;
        (-x * x / (2.0 * self.variance as f64)).exp() / self.normalizer
    }

    /// `P[Z >= m]`, to about 1e-13 relative: the mass summed from `m` outward until the terms
    /// no longer change the sum (at most about ten standard deviations of terms).
    pub fn at_least(&self, m: i64) -> f64 {
        if m <= 0 {
            // Symmetry: P[Z >= m] = 1 - P[Z <= m - 1] = 1 - P[Z >= 1 - m].
            return 1.0 - self.at_least(1 - m);
        }
        let v = self.variance as f64;
        // exp underflows to 0 beyond about 38.6 standard deviations.
        if (m as f64) > 40.0 * v.sqrt() + 1.0 {
            return 0.0;
        }
        let (mut sum, mut compensation) = (0.0f64, 0.0f64);
        let mut x = m;
        loop {
            let xf = x as f64;
            let term = (-xf * xf / (2.0 * v)).exp();
            // Neumaier's compensated sum: the terms fall from the largest.
            let next = sum + term;
            compensation += if sum.abs() >= term {
                (sum - next) + term
            } else {
                (term - next) + sum
            };
            sum = next;
            if term <= sum * 1e-18 {
                break;
            }
            x += 1;
        }
        (sum + compensation) / self.normalizer
    }
}

/// `P[N >= x]` for a standard normal `N`.
pub fn normal_upper_tail(x: f64) -> f64 {
    libm::erfc(x / SQRT_2) / 2.0
}

/// The `x` with `P[N >= x] = p` for a standard normal `N`, `p` in (0, 1): bisection on the
/// (decreasing) tail down to adjacent floats, so as exact as `erfc`.
pub fn normal_upper_quantile(p: f64) -> f64 {
    let (mut low, mut high) = (-40.0f64, 40.0f64);
    loop {
        let middle = low + (high - low) / 2.0;
        if middle <= low || middle >= high {
            return middle;
        }
        if normal_upper_tail(middle) > p {
            low = middle;
        } else {
            high = middle;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `P[Z >= m]` by summing every term in order (the reference for small variances).
    fn naive(variance: u64, m: i64) -> f64 {
        let v = variance as f64;
        let mass = |x: i64| (-(x as f64).powi(2) / (2.0 * v)).exp();
        let total: f64 = (-2000..=2000).map(mass).sum();
        let tail: f64 = (m..=2000).map(mass).sum();
        tail / total
    }

    #[test]
    fn the_tail_matches_a_plain_sum_and_is_symmetric() {
        for variance in [1, 2, 9, 100, 1000] {
            let tail = DiscreteGaussianTail::new(variance);
            for m in [-30, -3, 0, 1, 2, 5, 10, 40, 90] {
                let (ours, theirs) = (tail.at_least(m), naive(variance, m));
                assert!(
                    (ours - theirs).abs() <= 1e-12 * theirs.max(1e-300),
                    "variance {variance}, m {m}: {ours} vs {theirs}"
                );
            }
            let mass: f64 = (-500..=500).map(|x| tail.mass(x)).sum();
            assert!((mass - 1.0).abs() < 1e-12, "{mass}");
        }
    }

    #[test]
    fn the_discrete_tail_sits_between_the_continuous_tails_cks20_bound() {
        // Canonne, Kamath and Steinke 2020, Proposition 25: P[Z >= m] <= P[N >= m - 1].
        for variance in [4u64, 100, 10_000] {
            let sigma = (variance as f64).sqrt();
            let tail = DiscreteGaussianTail::new(variance);
            for m in [1i64, 3, 10, 30] {
                let m = m * sigma as i64 / 2 + 1;
                let bound = normal_upper_tail((m - 1) as f64 / sigma);
                assert!(tail.at_least(m) <= bound, "{variance} {m}");
                assert!(tail.at_least(m) >= normal_upper_tail(m as f64 / sigma));
            }
        }
    }

    #[test]
    fn the_quantile_inverts_the_tail() {
        for p in [0.5, 0.1, 1e-3, 1e-7, 1e-12, 1e-20] {
            let x = normal_upper_quantile(p);
            assert!((normal_upper_tail(x) / p - 1.0).abs() < 1e-13, "{p}");
        }
        assert!((normal_upper_quantile(0.025) - 1.959963984540054).abs() < 1e-12);
    }
}
