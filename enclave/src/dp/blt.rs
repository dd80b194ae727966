//! One round of BLT noise (docs/privacy.md, "DP-FTRL with BLT noise"), over the state the
//! enclave keeps between rounds.
//!
//! For each value, with `x` the round's exact sum moved onto the noise lattice (`2^lattice_bits`
//! units per grid unit):
//!
//! ```text
//! y = x + round(sum_j omega_j b_j) + z      b_j <- theta_j b_j + x
//! r = y + sum_j omegahat_j s_j              s_j <- thetahat_j s_j + y
//! ```
//!
//! `y` is the DP release: `x` plus a rounding of `C`'s running part (the strategy buffers `b_j`,
//! exact fixed point with `FRACTION_BITS` fractional bits in i128, multiplied by the policy's
//! decays and scales exactly: they are multiples of 2^-52) plus discrete Gaussian noise `z` on the
//! lattice, so the mechanism is an exact discrete Gaussian mechanism on a deterministic function
//! of the sums (drawn by `sampler_steps`: the same distribution by another exact algorithm,
//! faster). `r = (C^-1 y)` is what the model updater adds, computed in f64 from the `y`s alone
//! (post-processing: its rounding costs accuracy, never privacy). The noise is keyed like
//! everything else (`aggregate::noise`): block `k` of values draws from ChaCha12 stream `k` of the
//! round's seed, so the result does not depend on the thread count.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;
use rayon::prelude::*;
use thiserror::Error;

use super::DiscreteGaussian;
use super::sampler_bits::Bits;
use super::sampler_steps::StepSampler;

/// Fractional bits of the strategy buffers: the products are truncated, and their accumulated
/// error stays below `(rounds * sum(omega) + buffers) * 2^-40` lattice units per value, far inside
/// the accounting's allowance (`confed_dp::blt_accounting::ROUNDING_MARGIN`).
pub const FRACTION_BITS: u32 = 40;
/// Decays and scales are `k / 2^52`.
const QUANTUM_BITS: u32 = 52;
/// Values per ChaCha12 stream.
const BLOCK: usize = 1 << 14;

#[derive(Debug, Error, PartialEq)]
pub enum BltError {
    #[error("a BLT number {0:e} is not a multiple of 2^-52 in [0, 1)")]
    Number(f64),
    #[error("the BLT state holds {got} values with {buffers} buffers, the round {expected}")]
    Shape {
        got: usize,
        buffers: usize,
        expected: usize,
    },
    #[error("a BLT strategy buffer left the fixed point's range (2^87 lattice units)")]
    Overflow,
    #[error("a BLT lattice of {0} bits (at most 14)")]
    Lattice(u32),
}

/// The matrices of one task: `C`'s decays and scales as integers over 2^52, `C^-1`'s as floats.
#[derive(Debug, Clone)]
pub struct BltKernel {
    decays: Vec<u64>,
    scales: Vec<u64>,
    inverse_decays: Vec<f64>,
    inverse_scales: Vec<f64>,
    lattice_bits: u32,
}

/// What the enclave keeps between rounds, per value: `C`'s buffers (`buffers` i128 each) and
/// `C^-1`'s (as many f64).
/// The strategy buffers are linear combinations of past un-noised sums: never printed, wiped
/// when dropped, and sealed whenever they leave the enclave (`aggregate::blt_state`).
#[derive(Clone, PartialEq)]
pub struct BltState {
    pub strategy: Vec<i128>,
    pub release: Vec<f64>,
}

impl std::fmt::Debug for BltState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BltState {{ {} strategy and {} release buffers, redacted }}",
            self.strategy.len(),
            self.release.len()
        )
    }
}

impl Drop for BltState {
    fn drop(&mut self) {
        use zeroize::Zeroize;
        self.strategy.zeroize();
        self.release.zeroize();
    }
}

fn quantum(x: f64) -> Result<u64, BltError> {
    let k = x * (1u64 << QUANTUM_BITS) as f64;
    if !(0.0..(1u64 << QUANTUM_BITS) as f64).contains(&k) || k.fract() != 0.0 {
        return Err(BltError::Number(x));
    }
    Ok(k as u64)
}

/// `b * k / 2^52`, truncated toward zero, exactly (`b` up to 2^126 in magnitude, `k < 2^52`).
fn times_quantum(b: i128, k: u64) -> i128 {
    let magnitude = b.unsigned_abs();
    let high = (magnitude >> 64) * u128::from(k);
    let low = (magnitude & u128::from(u64::MAX)) * u128::from(k);
    let product = (high << (64 - QUANTUM_BITS)) + (low >> QUANTUM_BITS);
    let product = product as i128;
    if b < 0 { -product } else { product }
}

/// `items` as `blocks` consecutive slices of `width` (the last may be shorter; all empty when
/// `width` is 0).
fn split_blocks<T>(items: &mut [T], width: usize, blocks: usize) -> Vec<&mut [T]> {
    if width == 0 {
        return (0..blocks).map(|_| <&mut [T]>::default()).collect();
    }
    items.chunks_mut(width).collect()
}

impl BltKernel {
    /// The kernel of `C` (decays, scales) and its inverse (decays, scales), on a lattice of
    /// `2^lattice_bits` units per grid unit.
    pub fn new(
        decays: &[f64],
        scales: &[f64],
        inverse: (&[f64], &[f64]),
        lattice_bits: u32,
    ) -> Result<Self, BltError> {
        if lattice_bits > confed_protocol::blt_noise::MAX_LATTICE_BITS {
            return Err(BltError::Lattice(lattice_bits));
        }
        Ok(Self {
            decays: decays
                .iter()
                .map(|t| quantum(*t))
                .collect::<Result<_, _>>()?,
            scales: scales
                .iter()
                .map(|w| quantum(*w))
                .collect::<Result<_, _>>()?,
            inverse_decays: inverse.0.to_vec(),
            inverse_scales: inverse.1.to_vec(),
            lattice_bits,
        })
    }

    pub fn buffers(&self) -> usize {
        self.decays.len()
    }

    /// The state before the first round: every buffer 0.
    pub fn initial_state(&self, values: usize) -> BltState {
        BltState {
            strategy: vec![0; values * self.decays.len()],
            release: vec![0.0; values * self.inverse_decays.len()],
        }
    }

    /// One round: noises `sum` (grid units) with `noise` (on the lattice) keyed by `seed`,
    /// advances `state`, and returns `r` for every value in lattice units. After an error
    /// `state` is partly advanced and must be dropped (the caller keeps the stored state).
    pub fn step(
        &self,
        state: &mut BltState,
        sum: &[i64],
        noise: &DiscreteGaussian,
        seed: &[u8; 32],
    ) -> Result<Vec<f64>, BltError> {
        let d = self.decays.len();
        let dhat = self.inverse_decays.len();
        let values = sum.len();
        if state.strategy.len() != values * d || state.release.len() != values * dhat {
            return Err(BltError::Shape {
                got: state.strategy.len() / d.max(1),
                buffers: d,
                expected: values,
            });
        }
        let mut out = vec![0f64; values];
        let failed = std::sync::atomic::AtomicBool::new(false);
        let noise = noise.steps();
        // Each block's share of the buffers, taken by index: a kernel without buffers (the
        // identity, no correlation) still gets one (empty) share per block, not none.
        let blocks = values.div_ceil(BLOCK);
        let strategy: Vec<&mut [i128]> = split_blocks(&mut state.strategy, BLOCK * d, blocks);
        let release: Vec<&mut [f64]> = split_blocks(&mut state.release, BLOCK * dhat, blocks);
        out.par_chunks_mut(BLOCK)
            .zip(sum.par_chunks(BLOCK))
            .zip(strategy)
            .zip(release)
            .enumerate()
            .for_each(|(block, (((out, sums), strategy), release))| {
                let mut rng = ChaCha12Rng::from_seed(*seed);
                rng.set_stream(block as u64);
                if self
                    .block(out, sums, strategy, release, &noise, &mut rng)
                    .is_none()
                {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            });
        if failed.into_inner() {
            return Err(BltError::Overflow);
        }
        Ok(out)
    }

    fn block(
        &self,
        out: &mut [f64],
        sums: &[i64],
        strategy: &mut [i128],
        release: &mut [f64],
        noise: &StepSampler,
        rng: &mut ChaCha12Rng,
    ) -> Option<()> {
        let d = self.decays.len();
        let dhat = self.inverse_decays.len();
        let half = 1i128 << (FRACTION_BITS - 1);
        let mut bits = Bits::new(rng);
        for (i, (r, &x)) in out.iter_mut().zip(sums).enumerate() {
            let x = i128::from(x) << self.lattice_bits;
            let buffers = &mut strategy[i * d..(i + 1) * d];
            let mut running = 0i128;
            for (b, (&w, &t)) in buffers.iter_mut().zip(self.scales.iter().zip(&self.decays)) {
                running = running.checked_add(times_quantum(*b, w))?;
                // |x| < 2^77 (an i64 moved up at most 14 lattice bits): the shift stays below
                // 2^117 and cannot overflow; only the sums with the decayed buffers are checked.
                *b = times_quantum(*b, t).checked_add(x << FRACTION_BITS)?;
            }
            let rounded = running.checked_add(half)? >> FRACTION_BITS;
            let y = (x + rounded + i128::from(noise.sample(&mut bits))) as f64;
            let mine = &mut release[i * dhat..(i + 1) * dhat];
            let mut value = y;
            for (s, (&w, &t)) in mine
                .iter_mut()
                .zip(self.inverse_scales.iter().zip(&self.inverse_decays))
            {
                value += w * *s;
                *s = t * *s + y;
            }
            *r = value;
        }
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_dp::blt::Blt;

    fn kernel(lattice_bits: u32) -> (BltKernel, Blt) {
        let q = confed_protocol::blt_noise::quantize;
        let blt = Blt::new(vec![q(0.98), q(0.6)], vec![q(0.24), q(0.27)]);
        let inverse = blt.inverse();
        let kernel = BltKernel::new(
            &blt.decays,
            &blt.scales,
            (&inverse.decays, &inverse.scales),
            lattice_bits,
        )
        .unwrap();
        (kernel, blt)
    }

    #[test]
    fn fixed_point_products_are_exact_truncations() {
        for (b, k) in [
            (12345i128, 3u64 << 50),
            (-7, 1 << 51),
            ((1 << 70) + 3, (1 << 52) - 1),
        ] {
            let expected = if b < 0 {
                -(((-b) * i128::from(k)) >> 52)
            } else {
                (b * i128::from(k)) >> 52
            };
            assert_eq!(times_quantum(b, k), expected, "{b} {k}");
        }
        let big = (1i128 << 100) + 12345;
        let k = (1u64 << 52) - 1;
        // big * k / 2^52 = big - big / 2^52 (rounded toward zero).
        let expected = big - ((big + (1 << 52) - 1) >> 52);
        assert_eq!(times_quantum(big, k), expected);
    }

    #[test]
    fn without_noise_the_releases_add_up_to_the_running_sum_of_the_inputs() {
        let (kernel, _) = kernel(3);
        let mut state = kernel.initial_state(3);
        // Unit variance: a few lattice units (2^3 per grid unit) of noise.
        let zero = DiscreteGaussian::with_variance(1);
        let inputs = [[5i64, -3, 1000], [7, 0, -1000], [1, 1, 1], [0, 9, 4]];
        let mut total = [0f64; 3];
        let mut expected = [0i64; 3];
        for (round, sums) in inputs.iter().enumerate() {
            let r = kernel
                .step(&mut state, sums, &zero, &[round as u8; 32])
                .unwrap();
            for v in 0..3 {
                total[v] += r[v];
                expected[v] += sums[v];
            }
        }
        // The running sum of the r's is x's running sum plus A C^-1 (rounding + z): within a few
        // lattice units of the exact sum here (unit-variance noise over 4 rounds).
        for v in 0..3 {
            let exact = (expected[v] << 3) as f64;
            assert!(
                (total[v] - exact).abs() < 40.0,
                "{v}: {} vs {exact}",
                total[v]
            );
        }
    }

    #[test]
    fn a_step_is_deterministic_and_independent_of_the_thread_count() {
        let (kernel, _) = kernel(5);
        let sums: Vec<i64> = (0..40_000).map(|i| (i % 97) - 48).collect();
        let g = DiscreteGaussian::with_variance(10_000);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut state = kernel.initial_state(sums.len());
                let first = kernel.step(&mut state, &sums, &g, &[1; 32]).unwrap();
                let second = kernel.step(&mut state, &sums, &g, &[2; 32]).unwrap();
                (first, second, state)
            })
        };
        assert_eq!(run(1), run(2));
    }

    #[test]
    fn one_device_moves_the_release_by_at_most_the_charged_sensitivity() {
        // The accounting's bound on the actual kernel: a device adding a vector of norm one clip
        // (2^16 grid units) at rounds 1, 1 + b, ... (the worst case) to arbitrary other sums
        // moves G (the noise-free part of y) by at most U (sens + slack), and, this being the
        // worst case, by nearly that much. Same seeds, so the same z on both sides: y - y' = G -
        // G', recovered from the releases as C (r - r') (float error far below a lattice unit).
        let (kernel, blt) = kernel(3);
        let (values, rounds, b) = (64usize, 30usize, 5usize);
        let lattice = f64::from(1u32 << 3) * 65536.0;
        let g = DiscreteGaussian::with_variance(1 << 20);
        let mut with = kernel.initial_state(values);
        let mut without = kernel.initial_state(values);
        let mut differences: Vec<Vec<f64>> = Vec::new();
        let mut seed = 12345u64;
        for round in 0..rounds {
            let others: Vec<i64> = (0..values)
                .map(|_| {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 33) as i64 % 2_000_001) - 1_000_000
                })
                .collect();
            let mut mine = others.clone();
            if round % b == 0 {
                // 64 values of 8192: L2 norm exactly 2^16.
                mine.iter_mut().for_each(|x| *x += 8192);
            }
            let key = [round as u8; 32];
            let r = kernel.step(&mut with, &mine, &g, &key).unwrap();
            let r_other = kernel.step(&mut without, &others, &g, &key).unwrap();
            differences.push(r.iter().zip(&r_other).map(|(a, b)| a - b).collect());
        }
        let c = blt.coefficients(rounds);
        let mut squared = 0.0;
        for t in 0..rounds {
            for v in 0..values {
                let moved: f64 = differences[..=t]
                    .iter()
                    .enumerate()
                    .map(|(i, row)| c[t - i] * row[v])
                    .sum();
                squared += moved * moved;
            }
        }
        let moved = squared.sqrt();
        let sensitivity: f64 =
            confed_dp::blt::minsep_sensitivity_squared(&c, b as u32, rounds.div_ceil(b) as u32)
                .sqrt();
        let slack = ((rounds * values) as f64).sqrt() * (1.0 + 1e-6);
        assert!(
            moved <= lattice * sensitivity + slack,
            "{moved} > {} + {slack}",
            lattice * sensitivity
        );
        assert!(moved >= lattice * sensitivity - slack, "{moved}");
    }

    #[test]
    fn without_buffers_a_round_is_its_sum_plus_fresh_noise() {
        let kernel = BltKernel::new(&[], &[], (&[], &[]), 2).unwrap();
        let mut state = kernel.initial_state(40_000);
        let sums: Vec<i64> = (0..40_000).map(|i| i % 7).collect();
        let g = DiscreteGaussian::with_variance(100);
        let r = kernel.step(&mut state, &sums, &g, &[9; 32]).unwrap();
        let noise: Vec<f64> = r
            .iter()
            .zip(&sums)
            .map(|(r, x)| r - (x << 2) as f64)
            .collect();
        let variance = noise.iter().map(|n| n * n).sum::<f64>() / noise.len() as f64;
        assert!((variance / 100.0 - 1.0).abs() < 0.05, "{variance}");
    }

    #[test]
    fn numbers_off_the_quantum_and_a_mismatched_state_are_refused() {
        assert_eq!(
            BltKernel::new(&[0.1], &[0.5], (&[], &[]), 0).unwrap_err(),
            BltError::Number(0.1)
        );
        let (kernel, _) = kernel(0);
        let mut state = kernel.initial_state(2);
        let g = DiscreteGaussian::with_variance(4);
        assert!(matches!(
            kernel.step(&mut state, &[1, 2, 3], &g, &[0; 32]),
            Err(BltError::Shape { .. })
        ));
    }
}
