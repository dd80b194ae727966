//! The round's noise: derived once, deterministically, inside the enclave.
//!
//! The sampler's randomness is ChaCha12 (as in `rand`'s `StdRng`) keyed with `HMAC-SHA256(round private key, label || task
//! || round || attempt || included-set digest)`. Only the enclave holds the private key, so nobody
//! outside can predict or remove the noise; and a retried job over the same contributions derives
//! the same key, the same noise and byte-identical output, so a crash between noising and
//! commit can never lead to a second, differently noised release of the same sum. A different
//! set of contributions gets independent noise (same noise over two sets differing in one device
//! would reveal that device's update exactly).
//!
//! Coordinates are noised in blocks in parallel; block `b` uses ChaCha12 stream `b`, so the
//! output does not depend on the number of threads.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;
use rayon::prelude::*;
use zeroize::Zeroizing;

use crate::dp::DiscreteGaussian;
use crate::hpke::PrivateKey;

const LABEL: &[u8] = b"confed/dp-noise/v1";
/// Coordinates per ChaCha12 stream.
const BLOCK: usize = 1 << 14;

/// What the noise of one release is bound to.
pub struct NoiseBinding<'a> {
    pub task_id: &'a str,
    pub round: u64,
    pub attempt: u64,
    /// SHA-256 (hex) over the sorted refs of the included contributions.
    pub included_digest: &'a str,
}

/// The ChaCha12 key of a release.
pub fn seed(private_key: &PrivateKey, binding: &NoiseBinding<'_>) -> Zeroizing<[u8; 32]> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, private_key.as_bytes());
    let mut context = ring::hmac::Context::with_key(&key);
    for part in [
        LABEL,
        binding.task_id.as_bytes(),
        binding.round.to_string().as_bytes(),
        binding.attempt.to_string().as_bytes(),
        binding.included_digest.as_bytes(),
    ] {
        context.update(part);
        context.update(&[0]);
    }
    let tag = context.sign();
    let mut out = Zeroizing::new([0u8; 32]);
    out.copy_from_slice(tag.as_ref());
    out
}

/// Adds discrete Gaussian noise to every coordinate of `sum`, in parallel, deterministically.
pub fn add(sum: &mut [i64], noise: &DiscreteGaussian, seed: &[u8; 32]) {
    sum.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(block, values)| {
            let mut rng = ChaCha12Rng::from_seed(*seed);
            rng.set_stream(block as u64);
            for value in values {
                *value += noise.sample(&mut rng);
            }
        });
}

/// Noise samples alone (for benchmarks and the distribution test): `count` draws.
pub fn samples(count: usize, noise: &DiscreteGaussian, seed: &[u8; 32]) -> Vec<i64> {
    let mut out = vec![0i64; count];
    add(&mut out, noise, seed);
    out
}
