#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The enclave's machine-word discrete Gaussian sampler against the exact distribution and
//! against OpenDP's arbitrary-precision sampler of the same distribution.

use confed_enclave::aggregate::noise;
use confed_enclave::dp::DiscreteGaussian;

/// P[X = x] of the discrete Gaussian with variance parameter sigma^2, for |x| <= bound.
fn exact_pmf(sigma2: f64, bound: i64) -> Vec<f64> {
    let weights: Vec<f64> = (-bound..=bound)
        .map(|x| (-(x as f64).powi(2) / (2.0 * sigma2)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

/// Pearson chi-square of `samples` against `pmf` over [-bound, bound] (tails pooled in the
/// end bins), and the degrees of freedom.
fn chi_square(samples: &[i64], pmf: &[f64], bound: i64) -> (f64, usize) {
    let mut counts = vec![0f64; pmf.len()];
    for &s in samples {
        counts[(s.clamp(-bound, bound) + bound) as usize] += 1.0;
    }
    let n = samples.len() as f64;
    let stat = counts
        .iter()
        .zip(pmf)
        .filter(|(_, p)| **p * n >= 5.0)
        .map(|(c, p)| (c - p * n).powi(2) / (p * n))
        .sum();
    let bins = pmf.iter().filter(|p| **p * n >= 5.0).count();
    (stat, bins - 1)
}

/// Chi-square critical value at p = 0.001 (Wilson-Hilferty approximation).
fn critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.09;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

/// `samples` of the discrete Gaussian of variance parameter `sigma2`: mean and variance within
/// sampling error, and, up to `chi_square_up_to`, the chi-square against the exact pmf.
fn check_distribution(samples: &[i64], sigma2: u64, chi_square_up_to: u64) {
    let n = samples.len() as f64;
    let variance = samples.iter().map(|&s| (s as f64).powi(2)).sum::<f64>() / n;
    assert!(
        (variance / sigma2 as f64 - 1.0).abs() < 0.02,
        "sigma^2 {sigma2}: variance {variance}"
    );
    let mean = samples.iter().sum::<i64>() as f64 / n;
    assert!(
        mean.abs() < 5.0 * (sigma2 as f64 / n).sqrt(),
        "sigma^2 {sigma2}: mean {mean}"
    );
    if sigma2 > chi_square_up_to {
        return;
    }
    let bound = (6.0 * (sigma2 as f64).sqrt()).ceil() as i64;
    let pmf = exact_pmf(sigma2 as f64, bound);
    let (stat, dof) = chi_square(samples, &pmf, bound);
    assert!(
        stat < critical(dof),
        "sigma^2 {sigma2}: chi2 {stat} over {dof} dof"
    );
}

#[test]
fn machine_word_sampler_matches_the_exact_discrete_gaussian() {
    for sigma2 in [1u64, 10, 1000] {
        let g = DiscreteGaussian::with_variance(sigma2);
        let samples = noise::samples(200_000, &g, &[sigma2 as u8; 32]);
        check_distribution(&samples, sigma2, u64::MAX);
    }
}

#[test]
fn blts_step_sampler_matches_the_exact_discrete_gaussian() {
    use confed_enclave::dp::sampler_bits::Bits;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;
    // Perfect squares, others, and scales up to the grid's largest.
    for sigma2 in [
        1u64,
        2,
        4,
        7,
        10,
        1000,
        123_457,
        1 << 40,
        (1 << 40) + 1,
        1 << 60,
    ] {
        let g = DiscreteGaussian::with_variance(sigma2);
        let mut rng = ChaCha12Rng::from_seed([(sigma2 % 251) as u8 ^ (sigma2 >> 56) as u8; 32]);
        let mut bits = Bits::new(&mut rng);
        let steps = g.steps();
        let samples: Vec<i64> = (0..200_000).map(|_| steps.sample(&mut bits)).collect();
        check_distribution(&samples, sigma2, 200_000);
    }
}

/// BLT's sampler (rejection from a step envelope) against the other mechanisms' (Canonne, Kamath and
/// Steinke's), both exact, at a scale of the grid where the chi-square against the pmf would need
/// too many bins: 48 bins of a quarter sigma over +-6 sigma, tails pooled, two-sample chi-square.
#[test]
fn the_two_exact_samplers_agree_at_a_large_scale() {
    use confed_enclave::dp::sampler_bits::Bits;
    use rand_chacha::ChaCha12Rng;
    use rand_core::SeedableRng;
    // The grid's typical scale, and two (not perfect squares) whose acceptance trials compare
    // digit by digit.
    for (seed, sigma2) in [
        (9u8, 937_000u64.pow(2) + 12_345),
        (11, (1 << 50) + 12_345),
        (13, (1 << 60) - 1),
    ] {
        let g = DiscreteGaussian::with_variance(sigma2);
        let n = 200_000;
        let reference = noise::samples(n, &g, &[seed; 32]);
        let mut rng = ChaCha12Rng::from_seed([seed + 1; 32]);
        let mut bits = Bits::new(&mut rng);
        let steps = g.steps();
        let blt: Vec<i64> = (0..n).map(|_| steps.sample(&mut bits)).collect();
        let sigma = (sigma2 as f64).sqrt();
        let bin = |x: i64| ((x as f64 / (sigma / 4.0)).floor().clamp(-24.0, 23.0) + 24.0) as usize;
        let (mut a, mut b) = ([0f64; 48], [0f64; 48]);
        reference.iter().for_each(|&x| a[bin(x)] += 1.0);
        blt.iter().for_each(|&x| b[bin(x)] += 1.0);
        let mut stat = 0.0;
        let mut bins = 0;
        for (x, y) in a.iter().zip(&b) {
            if x + y >= 10.0 {
                stat += (x - y).powi(2) / (x + y);
                bins += 1;
            }
        }
        assert!(
            stat < critical(bins - 1),
            "sigma^2 {sigma2}: chi2 {stat} over {} dof",
            bins - 1
        );
    }
}

#[test]
fn machine_word_sampler_agrees_with_opendp() {
    use dashu::rational::RBig;
    let sigma2 = 25u64;
    let opendp: Vec<i64> = (0..20_000)
        .map(|_| {
            let x = opendp::traits::samplers::sample_discrete_gaussian(RBig::from(5)).unwrap();
            i64::try_from(x).unwrap()
        })
        .collect();
    let ours = noise::samples(200_000, &DiscreteGaussian::with_variance(sigma2), &[42; 32]);
    // Two-sample chi-square over |x| <= 15 (3 sigma), tails pooled.
    let bound = 15i64;
    let hist = |s: &[i64]| {
        let mut h = vec![0f64; (2 * bound + 1) as usize];
        for &x in s {
            h[(x.clamp(-bound, bound) + bound) as usize] += 1.0;
        }
        h
    };
    let (a, b) = (hist(&opendp), hist(&ours));
    let (na, nb) = (opendp.len() as f64, ours.len() as f64);
    let (ka, kb) = ((nb / na).sqrt(), (na / nb).sqrt());
    let mut stat = 0.0;
    let mut bins = 0;
    for (x, y) in a.iter().zip(&b) {
        if x + y >= 10.0 {
            stat += (ka * x - kb * y).powi(2) / (x + y);
            bins += 1;
        }
    }
    assert!(
        stat < critical(bins - 1),
        "chi2 {stat} over {} dof",
        bins - 1
    );
}
