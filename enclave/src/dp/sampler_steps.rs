//! The step sampler (a Gaussian round's release noise, BLT's): the same distribution as `sampler` (the integer variance
//! parameter `sigma^2`), drawn by rejection from a step envelope, each acceptance decided in
//! floating point where a rigorous error bound makes the float's answer certain and exactly
//! (`exp_bounds`) where it does not.
//!
//! The half-line is cut into steps of `w = ceil(sigma / 8)` integers; step `j` holds `[j w, (j+1)
//! w)`. A step is drawn from a fixed table with probability `q_j`, a multiple of 2^-41 close to
//! `exp(-j^2 / 128) / H` (Walker's alias method: 9 bits pick a bucket, 32 a side, so the
//! probabilities are exactly the table's), an integer `i` of it uniformly (Lemire's method), a
//! sign (`-0` refused), and `i` is kept with probability
//!
//! ```text
//! a = exp(-i^2 / (2 sigma^2)) / (C q_j)
//! ```
//!
//! where the constant `C` makes `a <= 1`: `i >= j w >= j sigma / 8`, so `exp(-i^2 / (2 sigma^2))
//! <= exp(-j^2 / 128) <= C q_j`. Every `i` then comes out with probability `(q_j / w) a =
//! exp(-i^2 / (2 sigma^2)) / (C w)`, the discrete Gaussian's weight, exactly. The table ends at
//! step 320 (`40 sigma`): the distribution is cut at `|z| >= 320 w >= 40 sigma`, a mass below
//! 2^-1100, which moves it by less than that (docs/privacy.md). About 0.95 of the draws are kept at
//! BLT's scales (the envelope is 5 % above the curve), and a draw spends 106 random bits.
//!
//! The acceptance: with `u` the first 32 binary digits of the uniform `U` compared, `a` is
//! computed in f64 within a relative 2^-44 (the analysis is at `accepts`); `u` clear of `a` by the
//! margin of 2^-32 decides. Otherwise, about once in 2^31, the exact comparison reads on.
//!
//! Its values differ from the ones Karney's algorithm (this file's predecessor) drew from the same
//! stream, and the inputs digest of a BLT round names the sampler (`inputs::bind_blt_state`), so an
//! enclave of either version refuses to finish a round the other started. A Gaussian round's
//! release draws with it too, named the same way (`inputs::bind_gaussian_sampler`).

use std::sync::OnceLock;

use rand_core::RngCore;

use super::DiscreteGaussian;
use super::exp_bounds;
use super::sampler::ceil_sqrt;
use super::sampler_bits::Bits;

/// Steps per standard deviation.
const STEPS_PER_SIGMA: u64 = 8;
/// Steps in the envelope: it ends at `STEPS / STEPS_PER_SIGMA = 40` standard deviations.
const STEPS: usize = 320;
/// Alias buckets, `2^BUCKET_BITS`.
const BUCKET_BITS: u32 = 9;
const BUCKETS: usize = 1 << BUCKET_BITS;
/// The table's probabilities are multiples of `2^-MASS_BITS`: a bucket, then 32 bits of a side.
const MASS_BITS: u32 = BUCKET_BITS + 32;
/// `C`'s denominator is `2^C_BITS`.
const C_BITS: u32 = 32;
/// `a = exp(-x) 2^SHIFT / K_j` with `K_j = C 2^C_BITS m_j` an integer.
const SHIFT: usize = (MASS_BITS + C_BITS) as usize;
/// The float test's margin, relative, on `a` (its error is below 2^-44).
const MARGIN: f64 = 1.0 / (1u64 << 32) as f64;
/// `2^32`.
const TWO_32: f64 = (1u64 << 32) as f64;
/// Above this exponent `a < 2^-54` (`K_j >= 2^35`, so `2^SHIFT / K_j <= 2^38`): any `u > 0`
/// refuses, and `exp` never leaves the normal range where its error bound holds.
const FLOAT_LIMIT: f64 = 64.0;

/// One alias bucket: a 32-bit draw below `threshold` takes `primary`, else `alias`.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    threshold: u64,
    primary: u16,
    alias: u16,
}

/// The step proposal, the same for every scale.
struct Envelope {
    buckets: [Bucket; BUCKETS],
    /// `m_j`: step `j`'s probability is `m_j / 2^MASS_BITS`.
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "the tests check the alias table against it")
    )]
    masses: [u64; STEPS],
    /// `K_j = c m_j`, with `C = c / 2^C_BITS`: `a = exp(-x) 2^SHIFT / K_j`.
    denominators: [u128; STEPS],
    /// `2^SHIFT / K_j` in f64.
    scales: [f64; STEPS],
}

impl Envelope {
    fn get() -> &'static Envelope {
        static ENVELOPE: OnceLock<Envelope> = OnceLock::new();
        ENVELOPE.get_or_init(Envelope::build)
    }

    fn build() -> Envelope {
        let total = 1u64 << MASS_BITS;
        let heights: Vec<f64> = (0..STEPS)
            .map(|j| (-((j * j) as f64) / (2 * STEPS_PER_SIGMA * STEPS_PER_SIGMA) as f64).exp())
            .collect();
        let sum: f64 = heights.iter().sum();
        // Masses rounded up (at least 1: a step the table never draws would be a hole in the
        // distribution), so that no step's height over its mass exceeds the sum's; step 0, the
        // largest, gives up the excess, a few hundred parts in 2^37.
        let mut masses = [0u64; STEPS];
        for (mass, height) in masses.iter_mut().zip(&heights) {
            *mass = ((height / sum * total as f64).ceil() as u64).max(1);
        }
        let rest: u64 = masses[1..].iter().sum();
        masses[0] = total - rest;
        // C >= h_j / q_j for every j, with a margin far above f64's error. From step 64 on the
        // height is at most exp(-32) < 2^-46 while C q_j >= 2^-41: no need to look.
        let needed = heights
            .iter()
            .zip(&masses)
            .take(64)
            .map(|(h, m)| h * total as f64 / *m as f64)
            .fold(1.0, f64::max);
        let c = (needed * (1.0 + 1e-9) * (1u64 << C_BITS) as f64).ceil() as u128;
        let mut denominators = [0u128; STEPS];
        let mut scales = [0f64; STEPS];
        for j in 0..STEPS {
            denominators[j] = c * u128::from(masses[j]);
            scales[j] = 2f64.powi(SHIFT as i32) / denominators[j] as f64;
        }
        Envelope {
            buckets: alias_buckets(&masses),
            masses,
            denominators,
            scales,
        }
    }
}

/// Walker's alias table (Vose's construction) of `masses`, which sum to `BUCKETS * 2^32`, in
/// integers: bucket `b` gives `primary` to draws below its threshold and `alias` to the rest, and
/// the table gives each step exactly its mass.
fn alias_buckets(masses: &[u64; STEPS]) -> [Bucket; BUCKETS] {
    const FULL: u64 = 1 << 32;
    let mut left: Vec<u64> = masses.to_vec();
    left.resize(BUCKETS, 0);
    let (mut small, mut large): (Vec<usize>, Vec<usize>) =
        (0..BUCKETS).partition(|&s| left[s] < FULL);
    let mut buckets = [Bucket::default(); BUCKETS];
    while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
        small.pop();
        buckets[s] = Bucket {
            threshold: left[s],
            // A padding bucket (past the steps, mass 0) names only its alias.
            primary: if left[s] == 0 { l } else { s } as u16,
            alias: l as u16,
        };
        left[l] -= FULL - left[s];
        if left[l] < FULL {
            large.pop();
            small.push(l);
        }
    }
    // What is left holds exactly a bucket each (the masses sum to the buckets' room).
    for s in small.into_iter().chain(large) {
        buckets[s] = Bucket {
            threshold: FULL,
            primary: s as u16,
            alias: s as u16,
        };
    }
    buckets
}

/// A discrete Gaussian prepared for `sampler_steps` (`DiscreteGaussian::steps`).
#[derive(Clone, Copy)]
pub struct StepSampler {
    sigma2: u64,
    /// `w = ceil(sigma / 8)`: integers per step.
    width: u64,
    /// Lemire's rejection threshold for `width`: `2^32 mod w`.
    lemire: u64,
    /// `1 / (2 sigma^2)`.
    inverse: f64,
    envelope: &'static Envelope,
}

impl DiscreteGaussian {
    /// This distribution, prepared for the step sampler.
    pub fn steps(&self) -> StepSampler {
        let (sigma2, _) = self.parameters();
        // ceil(sigma / 8) = ceil(sqrt(ceil(sigma^2 / 64))): the integer square is what counts.
        let width = ceil_sqrt(u128::from(
            sigma2.div_ceil(STEPS_PER_SIGMA * STEPS_PER_SIGMA),
        )) as u64;
        StepSampler {
            sigma2,
            width,
            lemire: (1u64 << 32) % width,
            inverse: 1.0 / (2.0 * sigma2 as f64),
            envelope: Envelope::get(),
        }
    }
}

impl StepSampler {
    /// One sample.
    #[inline]
    pub fn sample<R: RngCore>(&self, bits: &mut Bits<'_, R>) -> i64 {
        self.sample_with::<true, R>(bits)
    }

    /// One sample; without `FLOAT` every acceptance is decided by the exact comparison (tests).
    #[inline(always)]
    fn sample_with<const FLOAT: bool, R: RngCore>(&self, bits: &mut Bits<'_, R>) -> i64 {
        loop {
            let word = bits.bits(MASS_BITS);
            let bucket = &self.envelope.buckets[(word as usize) & (BUCKETS - 1)];
            let step = if word >> BUCKET_BITS < bucket.threshold {
                bucket.primary
            } else {
                bucket.alias
            } as usize;
            let i = step as u64 * self.width + self.within_step(bits);
            let negative = bits.bit();
            if negative && i == 0 {
                continue;
            }
            let u = bits.bits(32);
            if self.accepts::<FLOAT, R>(bits, u, i, step) {
                return if negative { -(i as i64) } else { i as i64 };
            }
        }
    }

    /// Uniform in `[0, w)`: Lemire's multiply-and-reject on 32 bits (`w <= 2^27 + 1`).
    #[inline(always)]
    fn within_step<R: RngCore>(&self, bits: &mut Bits<'_, R>) -> u64 {
        loop {
            let product = bits.bits(32) * self.width;
            if product & 0xFFFF_FFFF >= self.lemire {
                return product >> 32;
            }
        }
    }

    /// Whether `U < a(i, step)`, `u` being `U`'s first 32 binary digits.
    ///
    /// The float's error: `i < 2^36` and `sigma^2 <= 2^60` convert exactly or within 2^-53; the
    /// square, the reciprocal and the product round within 2^-53 each, so `y` is within 2^-51
    /// relative, 2^-45 absolute below `FLOAT_LIMIT`; `exp` adds at most an ulp, the scale and
    /// the product two more: `a` within a relative 2^-44, far inside `MARGIN` (2^-32).
    #[inline(always)]
    fn accepts<const FLOAT: bool, R: RngCore>(
        &self,
        bits: &mut Bits<'_, R>,
        u: u64,
        i: u64,
        step: usize,
    ) -> bool {
        if FLOAT {
            let x = i as f64;
            let y = x * x * self.inverse;
            let u_float = u as f64;
            if y <= FLOAT_LIMIT {
                let a = (-y).exp() * self.envelope.scales[step];
                if u_float + 1.0 <= a * (1.0 - MARGIN) * TWO_32 {
                    return true;
                }
                if u_float >= a * (1.0 + MARGIN) * TWO_32 {
                    return false;
                }
            } else if u != 0 {
                // a < 2^-54: any u > 0 is above it.
                return false;
            }
        }
        let exact = (u128::from(i) * u128::from(i), 2 * u128::from(self.sigma2));
        exp_bounds::below(bits, u, exact, SHIFT, self.envelope.denominators[step])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alias_table_gives_each_step_exactly_its_mass() {
        let envelope = Envelope::get();
        let mut given = [0u64; STEPS];
        for bucket in &envelope.buckets {
            given[bucket.primary as usize] += bucket.threshold;
            given[bucket.alias as usize] += (1 << 32) - bucket.threshold;
        }
        assert_eq!(given, envelope.masses);
        assert_eq!(envelope.masses.iter().sum::<u64>(), 1 << MASS_BITS);
        assert!(envelope.masses.iter().all(|m| *m >= 1));
    }

    /// The table is computed at start with the platform's `exp`; the stream-to-value map that
    /// `inputs::STEPS_SAMPLER` names must not move with a libm. The nearest mass is 470 ulps from
    /// a rounding boundary and `c` 12,000, so a libm within an ulp gives these exactly.
    #[test]
    fn the_table_is_the_one_the_sampler_is_named_for() {
        let envelope = Envelope::get();
        let c = envelope.denominators[0] / u128::from(envelope.masses[0]);
        assert_eq!(c, 45_211_029_608);
        let mut hasher = blake3::Hasher::new();
        for mass in envelope.masses {
            hasher.update(&mass.to_le_bytes());
        }
        assert_eq!(
            hasher.finalize().to_hex().as_str(),
            "4053e46fb95b4a8f0f2e69181a78385ad64001265ec56b3617edbcda5e6fd4dd"
        );
    }

    #[test]
    fn the_envelope_lies_above_the_curve_at_every_step() {
        // a <= 1 needs exp(-j^2 / 128) <= C q_j = K_j / 2^SHIFT, checked here in exact bounds.
        let envelope = Envelope::get();
        for j in 0..STEPS {
            let (_, high) = exp_bounds::exp_bounds((j * j) as u128, 128, 256);
            let k = dashu_int::UBig::from(envelope.denominators[j]);
            assert!(high << SHIFT <= k << 256, "step {j}");
        }
        // And hugs it: C is within 1e-6 of the heights' sum over the table's probabilities.
        let c = envelope.denominators[0] as f64 / envelope.masses[0] as f64 / 2f64.powi(32);
        let sum: f64 = (0..STEPS).map(|j| (-((j * j) as f64) / 128.0).exp()).sum();
        assert!((c / sum - 1.0).abs() < 1e-6, "{c} {sum}");
    }

    /// The exact comparison alone (the float test decides all but one acceptance in 2^31, so
    /// the whole-sampler tests barely reach it) against the pmf: chi-square over |z| <= 12.
    #[test]
    fn the_exact_acceptance_alone_draws_the_discrete_gaussian() {
        use rand_chacha::ChaCha12Rng;
        use rand_core::SeedableRng;
        let sigma2 = 10u64;
        let sampler = DiscreteGaussian::with_variance(sigma2).steps();
        let mut rng = ChaCha12Rng::from_seed([12; 32]);
        let mut bits = Bits::new(&mut rng);
        let n = 10_000;
        let bound = 12i64;
        let mut counts = vec![0f64; (2 * bound + 1) as usize];
        for _ in 0..n {
            let z = sampler.sample_with::<false, _>(&mut bits);
            counts[(z.clamp(-bound, bound) + bound) as usize] += 1.0;
        }
        let weight = |z: i64| (-((z * z) as f64) / (2.0 * sigma2 as f64)).exp();
        let total: f64 = (-200..=200).map(weight).sum();
        let mut stat = 0.0;
        for (index, count) in counts.iter().enumerate() {
            let z = index as i64 - bound;
            // The end bins pool their tails.
            let p = match z {
                z if z == -bound => (-200..=-bound).map(weight).sum::<f64>(),
                z if z == bound => (bound..=200).map(weight).sum::<f64>(),
                z => weight(z),
            } / total;
            let expected = p * n as f64;
            stat += (count - expected).powi(2) / expected;
        }
        // 25 bins, 24 degrees of freedom: the 0.001 critical value is 51.2.
        assert!(stat < 51.2, "chi2 {stat}");
    }

    #[test]
    fn widths_are_the_exact_ceilings_of_an_eighth_of_sigma() {
        for sigma2 in [
            1u64,
            2,
            63,
            64,
            65,
            1000,
            937_000 * 937_000 + 12_345,
            1 << 60,
        ] {
            let w = u128::from(DiscreteGaussian::with_variance(sigma2).steps().width);
            // w >= sigma / 8 > w - 1.
            assert!(w * w * 64 >= u128::from(sigma2), "{sigma2}");
            assert!((w - 1) * (w - 1) * 64 < u128::from(sigma2), "{sigma2}");
        }
    }
}
