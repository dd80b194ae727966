//! The exact discrete Gaussian sampler of Canonne, Kamath and Steinke (2020, "The Discrete
//! Gaussian for Differential Privacy", Algorithms 1-3) in machine words: the enclave's
//! (`confed_enclave::dp::DiscreteGaussian`) and the key services' distributed noise
//! (`distributed`) draw with it.
//!
//! The variance is an integer `sigma^2 <= 2^60`, so every quantity the algorithm compares is a
//! ratio of integers below 2^128: it draws only uniform integers and compares them, never a
//! float. The single approximation: a Laplace candidate so far in the tail that `(|y| t -
//! sigma^2)^2` exceeds u128 is rejected instead of accepted with probability `exp(-gamma)`; there
//! `gamma >= 32`, so the distribution moves by less than `e^-32 * P[tail]`, below 2^-1000 for
//! every variance allowed. The enclave's tests compare its output with OpenDP's.

use rand_core::RngCore;

/// `floor(sqrt(sigma2)) + 1`: the Laplace proposal's scale `t` for variance `sigma2`.
pub fn proposal_scale(sigma2: u64) -> u64 {
    sigma2.isqrt() + 1
}

/// One sample of the discrete Gaussian of integer variance parameter `sigma2` (1..=2^60), with
/// `t = proposal_scale(sigma2)` (Algorithm 3: discrete Laplace proposal, Bernoulli(exp(-gamma))
/// acceptance).
pub fn sample<R: RngCore>(sigma2: u64, t: u64, rng: &mut R) -> i64 {
    let scale = u128::from(t);
    let sigma2 = u128::from(sigma2);
    // gamma = (|y| - sigma^2/t)^2 / (2 sigma^2) = (|y| t - sigma^2)^2 / (2 sigma^2 t^2).
    let denominator = 2 * sigma2 * scale * scale;
    loop {
        let y = discrete_laplace(rng, t);
        let offset = (u128::from(y.unsigned_abs()) * scale).abs_diff(sigma2);
        let Some(numerator) = offset.checked_mul(offset) else {
            continue;
        };
        if bernoulli_exp(rng, numerator, denominator) {
            return y;
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
