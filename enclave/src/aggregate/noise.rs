//! The round's noise: derived once, deterministically, inside the enclave.
//!
//! The sampler's randomness is ChaCha12 (as in `rand`'s `StdRng`) keyed with
//! `HMAC-SHA256(round private key, label || task || round || policy hash || model hash || inputs
//! digest)`, every part followed by a zero byte. Only the enclave holds the private key, so nobody
//! outside can predict or remove the noise. A retried job over the same inputs derives the same
//! key, the same noise and byte-identical output, whatever attempt number the untrusted store
//! gives it, so a crash between noising and commit can never lead to a second, differently
//! noised release of the same sum. Anything else that changes the release gets independent noise:
//! the inputs digest covers every input contribution's stored bytes (BLAKE3, collision
//! resistant also for a sealer, who knows the AEAD key), the policy hash every privacy parameter,
//! the model hash the base model. The same noise over two sets differing in one device would
//! reveal that device's update exactly; independent noise over them is what the key services'
//! release ledger rations.
//!
//! Coordinates are noised in blocks in parallel; block `b` uses ChaCha12 stream `b`, so the
//! output does not depend on the number of threads.
//!
//! Two exact samplers map a stream to values. A Gaussian round's release draws with
//! `sampler_steps` (`add_steps`, the one BLT's rounds use), about five times faster than
//! `sampler` at the grid's scales; the round's inputs digest names it
//! (`inputs::bind_gaussian_sampler`). Everything whose values must not change between versions
//! keeps `sampler` (`add`): DP-FTRL's tree nodes, shared by every round of a tree, and the
//! scalar and analytics draws, where the sampler's speed does not matter.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;
use rayon::prelude::*;
use zeroize::Zeroizing;

use crate::dp::DiscreteGaussian;
use crate::dp::sampler_bits::Bits;
use crate::dp::tree::Node;
use crate::envelope::RoundContext;
use crate::hpke::PrivateKey;

const LABEL: &[u8] = b"confed/dp-noise/v2";
const TREE_LABEL: &[u8] = b"confed/dp-tree-node/v1";
const COUNT_LABEL: &[u8] = b"confed/dp-count/v1";
const EVALUATION_LABEL: &[u8] = b"confed/dp-evaluation/v1";
const BLT_LABEL: &[u8] = b"confed/dp-blt/v1";
const HEALTH_LABEL: &[u8] = b"confed/dp-health/v1";
/// Coordinates per ChaCha12 stream.
const BLOCK: usize = 1 << 14;

/// What the noise of one release is bound to.
pub struct NoiseBinding<'a> {
    /// Task, round, policy hash and model hash.
    pub context: &'a RoundContext,
    /// `aggregate::inputs::inputs_digest` of every contribution the job was given.
    pub inputs_digest: &'a str,
}

/// The ChaCha12 key of a release.
pub fn seed(private_key: &PrivateKey, binding: &NoiseBinding<'_>) -> Zeroizing<[u8; 32]> {
    labelled_seed(LABEL, private_key, binding)
}

/// The ChaCha12 key of adaptive clipping's count noise: bound to what the release's is, under
/// its own label.
pub fn count_seed(private_key: &PrivateKey, binding: &NoiseBinding<'_>) -> Zeroizing<[u8; 32]> {
    labelled_seed(COUNT_LABEL, private_key, binding)
}

/// The ChaCha12 key of a BLT round's fresh noise `z_t`: bound to what a Gaussian release's is
/// (the inputs digest then also binds the state the round continues, `inputs::bind_blt_state`),
/// under its own label. Each round draws independent `z_t`; the correlation across rounds is the
/// matrix's, applied exactly to the releases (`dp::blt`), not shared noise.
pub fn blt_seed(private_key: &PrivateKey, binding: &NoiseBinding<'_>) -> Zeroizing<[u8; 32]> {
    labelled_seed(BLT_LABEL, private_key, binding)
}

/// The ChaCha12 key of an evaluation round's noised metric sums: bound to what the release's is,
/// under its own label.
pub fn evaluation_seed(
    private_key: &PrivateKey,
    binding: &NoiseBinding<'_>,
) -> Zeroizing<[u8; 32]> {
    labelled_seed(EVALUATION_LABEL, private_key, binding)
}

/// The seed of the health count's noise: keyed like the round's value noise, under its own
/// label.
pub fn health_seed(private_key: &PrivateKey, binding: &NoiseBinding<'_>) -> Zeroizing<[u8; 32]> {
    labelled_seed(HEALTH_LABEL, private_key, binding)
}

/// The ChaCha12 key of a release's noise under `label` (each kind of noise has its own).
pub(crate) fn labelled_seed(
    label: &[u8],
    private_key: &PrivateKey,
    binding: &NoiseBinding<'_>,
) -> Zeroizing<[u8; 32]> {
    keyed(
        private_key,
        &[
            label,
            binding.context.task_id.as_bytes(),
            binding.context.round.to_string().as_bytes(),
            binding.context.policy_sha256.as_bytes(),
            binding.context.model_sha256.as_bytes(),
            binding.inputs_digest.as_bytes(),
        ],
    )
}

/// `HMAC-SHA256(private key, part 0x00 part 0x00 ...)`: every noise key's form.
pub(crate) fn keyed(private_key: &PrivateKey, parts: &[&[u8]]) -> Zeroizing<[u8; 32]> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, private_key.as_bytes());
    let mut context = ring::hmac::Context::with_key(&key);
    for part in parts {
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

/// Adds the discrete Gaussian noise of a Gaussian round's release to every coordinate of `sum`,
/// drawn with `sampler_steps` (the same distribution as `add`'s, other values from the same
/// stream), in parallel, deterministically: block `b` on ChaCha12 stream `b`, its bits taken in
/// order (`sampler_bits`). The loop is `add`'s, written out: with both behind one closure over
/// the block's generator, one A/B run read 34 against 40 M draws/s on one thread.
pub fn add_steps(sum: &mut [i64], noise: &DiscreteGaussian, seed: &[u8; 32]) {
    let sampler = noise.steps();
    sum.par_chunks_mut(BLOCK)
        .enumerate()
        .for_each(|(block, values)| {
            let mut rng = ChaCha12Rng::from_seed(*seed);
            rng.set_stream(block as u64);
            let mut bits = Bits::new(&mut rng);
            for value in values {
                *value += sampler.sample(&mut bits);
            }
        });
}

/// The ChaCha12 key of one raw tree node (`dp::tree`): bound to the task, its policy and the
/// node, and to nothing a round changes (not the inputs, the model or the round), because every
/// later round of the tree reuses it. Only the round's private key keeps it secret, so the key
/// services pin one key per tree (`Mechanism::key_scope`); a round's one release rests on their
/// ledger alone, since a second release of a round under the same tree noise would show the
/// difference of the two sums exactly (docs/privacy.md, "DP-FTRL").
pub fn node_seed(
    private_key: &PrivateKey,
    task_id: &str,
    policy_sha256: &str,
    node: &Node,
) -> Zeroizing<[u8; 32]> {
    keyed(
        private_key,
        &[
            TREE_LABEL,
            task_id.as_bytes(),
            policy_sha256.as_bytes(),
            node.tree.to_string().as_bytes(),
            node.level.to_string().as_bytes(),
            node.index.to_string().as_bytes(),
        ],
    )
}

/// The tree mechanism's release values: for each coordinate, `D * sum + sum of weight *
/// z(node)`, computed exactly (integer weights: `dp::tree`'s numerators over `denominator` = D),
/// then `to_value` of it. `z(node)` is the node's discrete Gaussian noise vector (block `b` on
/// ChaCha12 stream `b` of the node's key, as in `add`). Every product is below 2^82 and there are
/// at most 2047 nodes, so i128 never overflows; integer sums do not depend on order or thread
/// count. Works block by block: the exact values of one block (256 KiB) per thread, never of the
/// whole model.
pub fn tree_values(
    sum: &[i64],
    denominator: i64,
    noise: &DiscreteGaussian,
    nodes: &[(i64, Zeroizing<[u8; 32]>)],
    to_value: impl Fn(i128) -> f32 + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; sum.len()];
    out.par_chunks_mut(BLOCK)
        .zip(sum.par_chunks(BLOCK))
        .enumerate()
        .for_each(|(block, (values, sums))| {
            let mut exact: Vec<i128> = sums
                .iter()
                .map(|&units| i128::from(units) * i128::from(denominator))
                .collect();
            for (weight, seed) in nodes {
                let mut rng = ChaCha12Rng::from_seed(**seed);
                rng.set_stream(block as u64);
                for value in exact.iter_mut() {
                    *value += i128::from(*weight) * i128::from(noise.sample(&mut rng));
                }
            }
            for (value, exact) in values.iter_mut().zip(&exact) {
                *value = to_value(*exact);
            }
        });
    out
}

/// Noise samples alone (for benchmarks and the distribution test): `count` draws of `add`.
pub fn samples(count: usize, noise: &DiscreteGaussian, seed: &[u8; 32]) -> Vec<i64> {
    let mut out = vec![0i64; count];
    add(&mut out, noise, seed);
    out
}

/// `count` draws of `add_steps`: a Gaussian round's release noise alone (benchmarks, tests).
pub fn samples_steps(count: usize, noise: &DiscreteGaussian, seed: &[u8; 32]) -> Vec<i64> {
    let mut out = vec![0i64; count];
    add_steps(&mut out, noise, seed);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// BLAKE3 over `draws` as little-endian i64s.
    fn pinned(draws: &[i64]) -> String {
        let mut hasher = blake3::Hasher::new();
        for draw in draws {
            hasher.update(&draw.to_le_bytes());
        }
        hasher.finalize().to_hex().to_string()
    }

    /// Three blocks and a part of a fourth, at the smallest variance, a grid-sized one and the
    /// largest.
    const COUNT: usize = 3 * BLOCK + 5;
    const VARIANCES: [u64; 3] = [1, 937_000 * 937_000 + 12_345, 1 << 60];

    /// `draw`'s values at each of `VARIANCES`, as `pinned` digests.
    fn answers(draw: fn(usize, &DiscreteGaussian, &[u8; 32]) -> Vec<i64>) -> Vec<String> {
        VARIANCES
            .iter()
            .map(|&v| pinned(&draw(COUNT, &DiscreteGaussian::with_variance(v), &[7; 32])))
            .collect()
    }

    /// Known answers for the values a Gaussian round's release noise maps the stream to. The
    /// release commitment names them (`inputs::STEPS_SAMPLER`): a change of these values (the
    /// blocks, the bit order, the sampler's steps) is a new sampler and needs a new name there,
    /// or an enclave of the new version and one of the old could each release a round with
    /// other noise.
    #[test]
    fn the_step_samplers_values_are_the_ones_its_name_stands_for() {
        assert_eq!(
            answers(samples_steps),
            [
                "f40f698d1312ae4dd6d23f0bc13289f56d730fd8a2951e6a596c3c40889253ec",
                "cdb3f054b2cfece84b9a6012b2e31e9deca6cf9271aca76690c3e2a537ef9293",
                "e8f90224b09ba495c7aebabda683c4ee2315c8c84684f2b13bc14ccad1f915f6",
            ]
        );
    }

    /// Known answers for `add`'s values: DP-FTRL's tree nodes are drawn again by every round of
    /// their tree, so a change of these values would give a tree's rounds other noise for the
    /// same node.
    #[test]
    fn the_machine_word_samplers_values_do_not_move() {
        assert_eq!(
            answers(samples),
            [
                "02c1486bc01e079ce29b33d45a79318154f3157ddb77404af750c7a2c55214d7",
                "60949d238a85223b04e6e11408d801c87b6adf0c830d47ca5810ee043c60c162",
                "32e3442109cfe954ceccc48afa7ee15c22e148a6c72be03d67c93d5792b4d62f",
            ]
        );
    }
}
