//! An exact discrete Gaussian sampler in machine words (Canonne, Kamath, Steinke 2020,
//! "The Discrete Gaussian for Differential Privacy", Algorithms 1-3).
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
            t: sigma2.isqrt() + 1,
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

    /// One sample (Algorithm 3: discrete Laplace proposal, Bernoulli(exp(-gamma)) acceptance).
    pub fn sample<R: RngCore>(&self, rng: &mut R) -> i64 {
        let t = u128::from(self.t);
        let sigma2 = u128::from(self.sigma2);
        // gamma = (|y| - sigma^2/t)^2 / (2 sigma^2) = (|y| t - sigma^2)^2 / (2 sigma^2 t^2).
        let denominator = 2 * sigma2 * t * t;
        loop {
            let y = discrete_laplace(rng, self.t);
            let offset = (u128::from(y.unsigned_abs()) * t).abs_diff(sigma2);
            let Some(numerator) = offset.checked_mul(offset) else {
                continue;
            };
            if bernoulli_exp(rng, numerator, denominator) {
                return y;
            }
        }
    }
}

/// Discrete Laplace with integer scale `t` (Algorithm 2 with s = 1).
fn discrete_laplace<R: RngCore>(rng: &mut R, t: u64) -> i64 {
    loop {
        let u = uniform_below_u64(rng, t);
        if !bernoulli_exp_fraction(rng, u128::from(u), u128::from(t)) {
            continue;
        }
        let mut v: u64 = 0;
        while bernoulli_exp_fraction(rng, 1, 1) {
            v += 1;
        }
        let x = u + t * v;
        let negative = rng.next_u32() & 1 == 1;
        if negative && x == 0 {
            continue;
        }
        return if negative { -(x as i64) } else { x as i64 };
    }
}

/// Bernoulli(exp(-n/d)) for any n/d >= 0: one exp(-1) trial per whole unit, then the fraction.
fn bernoulli_exp<R: RngCore>(rng: &mut R, mut n: u128, d: u128) -> bool {
    while n > d {
        if !bernoulli_exp_fraction(rng, 1, 1) {
            return false;
        }
        n -= d;
    }
    bernoulli_exp_fraction(rng, n, d)
}

/// Bernoulli(exp(-n/d)) for 0 <= n/d <= 1 (Algorithm 1): draw Bernoulli(n/(d k)) for k = 1, 2,
/// ... until one fails; the k it fails at is odd with probability exactly exp(-n/d).
fn bernoulli_exp_fraction<R: RngCore>(rng: &mut R, n: u128, d: u128) -> bool {
    let mut k: u128 = 1;
    loop {
        let Some(dk) = d.checked_mul(k) else {
            // Unreachable in practice: needs k! > 2^64 consecutive successes.
            return k % 2 == 1;
        };
        if uniform_below_u128(rng, dk) >= n {
            return k % 2 == 1;
        }
        k += 1;
    }
}

/// Uniform in [0, n) for n >= 1 (Lemire's multiply-shift with rejection: unbiased). The
/// rejection threshold `2^64 mod n` is below `n`, so a draw whose low word is at least `n` is
/// accepted without computing it: the same draws accepted and rejected as always computing it
/// (so the same output, bit for bit), without a 64-bit division on nearly every call.
fn uniform_below_u64<R: RngCore>(rng: &mut R, n: u64) -> u64 {
    let mut product = u128::from(rng.next_u64()) * u128::from(n);
    if (product as u64) < n {
        let threshold = n.wrapping_neg() % n;
        while (product as u64) < threshold {
            product = u128::from(rng.next_u64()) * u128::from(n);
        }
    }
    (product >> 64) as u64
}

/// Uniform in [0, n) for n >= 1.
fn uniform_below_u128<R: RngCore>(rng: &mut R, n: u128) -> u128 {
    if let Ok(small) = u64::try_from(n) {
        return u128::from(uniform_below_u64(rng, small));
    }
    let mask = u128::MAX >> n.leading_zeros();
    loop {
        let draw = ((u128::from(rng.next_u64()) << 64) | u128::from(rng.next_u64())) & mask;
        if draw < n {
            return draw;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

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

    #[test]
    fn uniform_below_covers_the_range_evenly() {
        let mut rng = ChaCha20Rng::from_seed([7; 32]);
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            counts[uniform_below_u64(&mut rng, 3) as usize] += 1;
        }
        for c in counts {
            assert!((9_500..10_500).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn bernoulli_exp_matches_its_probability() {
        let mut rng = ChaCha20Rng::from_seed([9; 32]);
        for (n, d) in [(1u128, 2u128), (3, 1), (7, 5)] {
            let trials = 200_000;
            let hits = (0..trials)
                .filter(|_| bernoulli_exp(&mut rng, n, d))
                .count() as f64;
            let expected = (-(n as f64) / d as f64).exp();
            let sd = (expected * (1.0 - expected) / trials as f64).sqrt();
            assert!(
                (hits / trials as f64 - expected).abs() < 5.0 * sd,
                "{n}/{d}: {} vs {expected}",
                hits / trials as f64
            );
        }
    }
}
