//! A masked round's distributed noise (docs/secure-aggregation.md, "Distributed noise"): every
//! holder of a mask group subtracts, from its sum of that group's streams over the agreed set,
//! the discrete Gaussian vector drawn from the group's noise key
//! (`confed_protocol::masking_noise`), so what the enclave unmasks is the included updates' sum
//! plus every group's noise, and no honest group's noise ever leaves its holders alone.
//!
//! The draw is deterministic in the key, so every holder of a group answers the same (the
//! enclave's cross-check of holders still works) and a service asked twice for one agreed set
//! answers the same twice: fresh noise per request would let whoever asks average it away.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;

use crate::exact_sampler;

/// Values per ChaCha12 stream: value `i` is drawn from stream `i / BLOCK`.
pub const BLOCK: usize = 1 << 14;

/// The noise vector of `values` values: discrete Gaussians of integer variance parameter
/// `variance` (1..=2^60), value `i` drawn in order on ChaCha12 stream `i / BLOCK` keyed with
/// `key`.
pub fn noise(values: usize, variance: u64, key: &[u8; 32]) -> Vec<i64> {
    let t = exact_sampler::proposal_scale(variance);
    let mut out = vec![0i64; values];
    for (block, chunk) in out.chunks_mut(BLOCK).enumerate() {
        let mut rng = ChaCha12Rng::from_seed(*key);
        rng.set_stream(block as u64);
        for value in chunk {
            *value = exact_sampler::sample(variance, t, &mut rng);
        }
    }
    out
}

/// Subtracts `noise(sum.len(), variance, key)` from `sum`, mod 2^64: the enclave, which subtracts
/// the mask sum, is left with the noise added.
pub fn noise_mask_sum(sum: &mut [u64], variance: u64, key: &[u8; 32]) {
    let t = exact_sampler::proposal_scale(variance);
    for (block, chunk) in sum.chunks_mut(BLOCK).enumerate() {
        let mut rng = ChaCha12Rng::from_seed(*key);
        rng.set_stream(block as u64);
        for value in chunk {
            *value = value.wrapping_sub(exact_sampler::sample(variance, t, &mut rng) as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_the_same_for_one_key_and_independent_across_keys() {
        let a = noise(40_000, 1 << 20, &[1; 32]);
        assert_eq!(a, noise(40_000, 1 << 20, &[1; 32]));
        let b = noise(40_000, 1 << 20, &[2; 32]);
        let equal = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        // Two independent draws of standard deviation 1024 agree on a value about 1 in 3,600.
        assert!(equal < 40, "{equal} equal values");
    }

    /// Every holder of a group must draw the same values from the same key, whatever its build:
    /// a change of generator (rand_chacha's word order, say) or of the sampler's use of it would
    /// make holders on two versions disagree (`Disagree`), so it is pinned here. The expected
    /// values are this implementation's (docs/protocol.md, "Masks", distributed noise).
    const PINNED_FIRST: [i64; 4] = [8395, 27608, -36597, -5562];
    const PINNED_SECOND_STREAM: [i64; 4] = [-22405, -37628, -120963, -33682];

    #[test]
    fn the_draw_of_a_key_is_pinned_across_builds() {
        let drawn = noise(BLOCK + 4, 1 << 32, &[7; 32]);
        assert_eq!(&drawn[..4], &PINNED_FIRST);
        // The first values of the second ChaCha12 stream.
        assert_eq!(&drawn[BLOCK..], &PINNED_SECOND_STREAM);
    }

    #[test]
    fn noise_has_its_variance_and_no_bias() {
        let variance = 1u64 << 20;
        let drawn = noise(200_000, variance, &[3; 32]);
        let n = drawn.len() as f64;
        let mean = drawn.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = drawn
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        // Standard errors: 1024 / sqrt(n) = 2.3 for the mean, sqrt(2 / n) = 0.32 % relative for
        // the variance (a discrete Gaussian's variance is within 1e-9 of sigma^2 at this scale).
        assert!(mean.abs() < 12.0, "mean {mean}");
        assert!(
            (var / variance as f64 - 1.0).abs() < 0.016,
            "variance {var}"
        );
    }

    #[test]
    fn the_mask_sum_loses_exactly_the_noise() {
        let key = [5; 32];
        let mut sum: Vec<u64> = (0..20_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        let before = sum.clone();
        noise_mask_sum(&mut sum, 4096, &key);
        let drawn = noise(sum.len(), 4096, &key);
        for ((after, before), z) in sum.iter().zip(&before).zip(&drawn) {
            assert_eq!(after.wrapping_add(*z as u64), *before);
        }
    }

    /// `confed_protocol::masking::NoiseRoom`, the unmask's room for this noise, against draws.
    #[test]
    fn the_unmasks_room_holds_the_drawn_noise_and_is_not_loose() {
        let (values, variance, groups) = (50_000, 1u64 << 24, 3);
        let mut total = vec![0i64; values];
        for group in 0..groups {
            for (sum, z) in total
                .iter_mut()
                .zip(noise(values, variance, &[group as u8; 32]))
            {
                *sum += z;
            }
        }
        let norm = total
            .iter()
            .map(|&v| (v as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let room = confed_protocol::masking::NoiseRoom::of(values, variance, groups);
        let bound = room.norm;
        let expected = ((values * groups) as f64 * variance as f64).sqrt();
        assert!(norm < bound, "{norm} >= {bound}");
        assert!(bound < 1.1 * expected, "bound {bound} against {expected}");
        // Against a fixed direction (a sum of updates), the noise's projection stays within
        // `spread` per unit of the sum's norm.
        let direction: Vec<f64> = (0..values).map(|i| ((i % 7) as f64) - 3.0).collect();
        let length = direction.iter().map(|d| d * d).sum::<f64>().sqrt();
        let projection: f64 = direction
            .iter()
            .zip(&total)
            .map(|(d, z)| d * *z as f64)
            .sum();
        assert!(projection.abs() < length * room.spread);
    }
}
