//! Masked rounds in the enclave: the release from masked updates is byte for byte the release
//! of the same clipped updates summed in the clear (same noise, same manifest but its masking
//! record); what the enclave holds before the masks are removed is far from the sum; a withheld
//! or wrong mask sum releases nothing; a plaintext that is not a masked update is excluded.

use confed_protocol::grid::clip_to_grid;
use confed_protocol::masking::{
    Layout, MaskContext, MaskSums, Ring, SealedSeeds, Seed, encode_masked, mask, open_seeds,
    seal_seeds,
};
use confed_protocol::masking_noise::NoiseKeys;

use super::*;
use crate::aggregate::inputs::committed;
use crate::aggregate::tests::{KEY, Normal, ROUND, Round, TASK, binding, privacy, round};
use crate::envelope;
use crate::hpke::{PublicKey, generate_keypair};

const VALUES: usize = 64;
/// The policy hash the devices' mask contexts name.
pub(super) const POLICY: &str = "5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c5e1c";

struct KeyServices {
    layout: Layout,
    keys: Vec<(PrivateKey, PublicKey)>,
}

impl KeyServices {
    fn new(n: u8, t: u8) -> Self {
        Self::in_ring(n, t, Ring::Bits64)
    }

    fn in_ring(n: u8, t: u8, ring: Ring) -> Self {
        Self {
            layout: Layout::new(n, t).unwrap().with_ring(ring),
            keys: (0..n).map(|_| generate_keypair()).collect(),
        }
    }

    /// Service `service`'s mask sums over the `included` refs, from the seeds devices sealed.
    fn answer(
        &self,
        service: u8,
        included: &[String],
        seeds: &[(String, Vec<SealedSeeds>)],
    ) -> MaskSums {
        let mut sums = MaskSums::new(&self.layout, service, VALUES).unwrap();
        for assignment_ref in included {
            let (_, sealed) = seeds.iter().find(|(r, _)| r == assignment_ref).unwrap();
            let ctx = mask_context(assignment_ref);
            let private = &self.keys[usize::from(service) - 1].0;
            let opened = open_seeds(
                &self.layout,
                private,
                &sealed[usize::from(service) - 1],
                &ctx,
            )
            .unwrap();
            sums.add(&opened, &ctx, self.layout.ring()).unwrap();
        }
        sums
    }

    /// The same answer with distributed noise of `variance` per group, as a key service draws
    /// it: each group's key from its seeds over `included` (`NoiseKeys`), the noise subtracted.
    fn noised_answer(
        &self,
        service: u8,
        included: &[String],
        seeds: &[(String, Vec<SealedSeeds>)],
        variance: u64,
    ) -> MaskSums {
        let mut sums = self.answer(service, included, seeds);
        for ((group, sum), (keyed, key)) in sums
            .sums
            .iter_mut()
            .zip(self.noise_keys(service, included, seeds))
        {
            assert_eq!(*group, keyed);
            confed_dp::distributed::noise_mask_sum(sum, variance, &key);
        }
        sums
    }

    /// Service `service`'s groups' noise keys over the `included` refs.
    fn noise_keys(
        &self,
        service: u8,
        included: &[String],
        seeds: &[(String, Vec<SealedSeeds>)],
    ) -> Vec<(usize, zeroize::Zeroizing<[u8; 32]>)> {
        let mut keys = NoiseKeys::new(&self.layout.groups_of(service), included.len());
        for assignment_ref in included {
            let (_, sealed) = seeds.iter().find(|(r, _)| r == assignment_ref).unwrap();
            let ctx = mask_context(assignment_ref);
            let private = &self.keys[usize::from(service) - 1].0;
            let opened = open_seeds(
                &self.layout,
                private,
                &sealed[usize::from(service) - 1],
                &ctx,
            )
            .unwrap();
            keys.absorb(&opened, &ctx).unwrap();
        }
        keys.finish()
    }
}

fn mask_context(assignment_ref: &str) -> MaskContext<'_> {
    MaskContext::new(TASK, ROUND, assignment_ref, POLICY, VALUES).unwrap()
}

struct Masked {
    /// (ref, stored envelope) of every contribution, valid or not.
    stored: Vec<(String, Option<Vec<u8>>)>,
    /// The same devices' updates sent in the clear (an unmasked round's contributions).
    clear: Vec<(String, Option<Vec<u8>>)>,
    /// Each device's seeds as sealed to each key service.
    seeds: Vec<(String, Vec<SealedSeeds>)>,
    /// The valid devices' clipped updates on the grid, summed in the clear.
    exact: Vec<i64>,
}

/// 20 devices clip their updates on the grid, mask them and seal; one more sends a plaintext
/// that is not a masked update, one is missing.
fn masked_round(r: &Round, services: &KeyServices) -> Masked {
    let mut rng = Normal::seeded(11);
    let public: Vec<PublicKey> = services.keys.iter().map(|(_, p)| *p).collect();
    let mut stored = Vec::new();
    let mut clear = Vec::new();
    let mut seeds = Vec::new();
    let mut exact = vec![0i64; VALUES];
    for d in 0..20 {
        let assignment_id = format!("device-{d}");
        let assignment_ref = envelope::assignment_ref(&assignment_id);
        // Within the clip norm (about 0.4 of it): the device's grid values are the ones the
        // enclave would add for the update in the clear.
        let update: Vec<f32> = (0..VALUES).map(|_| 0.05 * rng.normal()).collect();
        let grid = clip_to_grid(&update, 1.0);
        let (_, in_clear) = crate::aggregate::tests::sealed(
            r,
            &assignment_id,
            ROUND,
            &crate::aggregate::tests::update(&update),
        );
        clear.push((assignment_ref.clone(), Some(in_clear)));
        for (sum, v) in exact.iter_mut().zip(&grid) {
            *sum += v;
        }
        let ctx = mask_context(&assignment_ref);
        let device_seeds: Vec<Seed> = services
            .layout
            .groups()
            .iter()
            .map(|_| Seed::random())
            .collect();
        let masked = mask(&services.layout, &grid, &device_seeds, &ctx).unwrap();
        let (_, bytes) = crate::aggregate::tests::sealed(
            r,
            &assignment_id,
            ROUND,
            &encode_masked(&masked, services.layout.ring()),
        );
        let sealed = seal_seeds(&services.layout, &device_seeds, &public, &ctx).unwrap();
        stored.push((assignment_ref.clone(), Some(with_seeds(&bytes, &sealed))));
        seeds.push((assignment_ref, sealed));
    }
    let (garbage_ref, garbage) =
        crate::aggregate::tests::sealed(r, "device-garbage", ROUND, b"not a masked update");
    let garbage_seeds = seeds[0].1.clone();
    stored.push((
        garbage_ref.clone(),
        Some(with_seeds(&garbage, &garbage_seeds)),
    ));
    clear.push((garbage_ref, Some(garbage)));
    stored.push((envelope::assignment_ref("device-missing"), None));
    clear.push((envelope::assignment_ref("device-missing"), None));
    Masked {
        stored,
        clear,
        seeds,
        exact,
    }
}

/// A stored envelope with the sealed seeds beside its ciphertext, as a masked device uploads it.
fn with_seeds(stored: &[u8], sealed: &[SealedSeeds]) -> Vec<u8> {
    let mut envelope = envelope::Envelope::from_cbor(stored).unwrap();
    envelope.seeds = Some(confed_protocol::masking::envelope_seeds(sealed));
    envelope.to_cbor()
}

fn model_round() -> Round {
    round(VALUES)
}

#[test]
fn a_masked_round_releases_the_bytes_of_the_same_clipped_updates_summed_in_the_clear() {
    let r = model_round();
    for (n, t, ring) in [
        (3u8, 2u8, Ring::Bits64),
        (5, 3, Ring::Bits64),
        (3, 2, Ring::Bits32),
        (5, 3, Ring::Bits32),
    ] {
        let services = KeyServices::in_ring(n, t, ring);
        let round_data = masked_round(&r, &services);
        let (_, digest) = committed(&round_data.stored);
        let binding = Binding {
            inputs_digest: digest,
            ..binding()
        };
        let enclave =
            MaskedAggregator::new(binding.clone(), services.layout.clone(), VALUES, &r.private)
                .unwrap();
        enclave.add_batch(&round_data.stored);
        assert_eq!(enclave.counts(), (20, 2));
        let included = enclave.included();
        // Every key service answers (any quorum would do: protocol's tests).
        let answers: Vec<MaskSums> = (1..=n)
            .map(|s| services.answer(s, &included, &round_data.seeds))
            .collect();
        let (unmasked, record) = enclave
            .unmask(&answers, 1.0, None, r.schema.clone(), &r.private)
            .unwrap();
        let release = unmasked.finish(&r.private, privacy()).unwrap();
        // The same devices' updates in the clear, clipped and summed by the enclave itself.
        let clear = Aggregator::new(binding.clone(), 1.0, r.schema.clone(), &r.private).unwrap();
        clear.add_batch(&round_data.clear);
        assert_eq!(clear.counts(), (20, 2));
        let expected = clear.finish(&r.private, privacy()).unwrap();
        assert_eq!(release.average, expected.average, "{t}-of-{n}");
        assert_eq!(release.manifest, expected.manifest, "{t}-of-{n}");
        assert_eq!(record.quorum, services.layout.quorum());
        assert_eq!(record.answered, (1..=n).collect::<Vec<_>>());
        assert_eq!(release.manifest.excluded.get("not_safetensors"), Some(&1));
        assert_eq!(release.manifest.excluded.get("missing"), Some(&1));
    }
}

#[test]
fn before_the_masks_are_removed_the_enclave_holds_nothing_near_the_sum() {
    let r = model_round();
    let services = KeyServices::new(3, 2);
    let round_data = masked_round(&r, &services);
    let enclave =
        MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
    enclave.add_batch(&round_data.stored);
    let held: Vec<u64> = enclave
        .stripes
        .iter()
        .flat_map(|s| s.lock().unwrap().clone())
        .collect();
    // The true sum is within 20 x 2^16 per value; what is held is spread over all of 2^64.
    let near = held
        .iter()
        .zip(&round_data.exact)
        .filter(|(h, e)| (**h as i64).wrapping_sub(**e).unsigned_abs() < 1 << 40)
        .count();
    assert_eq!(near, 0, "{near} of {VALUES} held values near the sum");
}

#[test]
fn a_withheld_or_wrong_mask_sum_releases_nothing() {
    let r = model_round();
    let services = KeyServices::new(5, 3);
    let round_data = masked_round(&r, &services);
    let start = || {
        let enclave =
            MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
        enclave.add_batch(&round_data.stored);
        enclave
    };
    let included = start().included();
    let answer = |s: u8| services.answer(s, &included, &round_data.seeds);
    // Only three of five answered: q is 4.
    let few: Vec<MaskSums> = (1..=3).map(answer).collect();
    assert!(matches!(
        start().unmask(&few, 1.0, None, r.schema.clone(), &r.private),
        Err(MaskedError::Masking(MaskingError::Withheld { .. }))
    ));
    // A service that summed the masks of other inputs than the included ones.
    let mut wrong: Vec<MaskSums> = (1..=5).map(answer).collect();
    wrong[2] = services.answer(3, &included[1..], &round_data.seeds);
    assert!(matches!(
        start().unmask(&wrong, 1.0, None, r.schema.clone(), &r.private),
        Err(MaskedError::Masking(MaskingError::Disagree { .. }))
    ));
}

#[test]
fn a_masked_update_of_another_length_is_excluded() {
    let r = model_round();
    let services = KeyServices::new(3, 2);
    let short = encode_masked(&[1, 2, 3], Ring::Bits64);
    let (assignment_ref, bytes) =
        crate::aggregate::tests::sealed(&r, "device-short", ROUND, &short);
    let enclave =
        MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
    let ctx = mask_context(&assignment_ref);
    let seeds: Vec<Seed> = services
        .layout
        .groups()
        .iter()
        .map(|_| Seed::random())
        .collect();
    let public: Vec<PublicKey> = services.keys.iter().map(|(_, p)| *p).collect();
    let sealed = seal_seeds(&services.layout, &seeds, &public, &ctx).unwrap();
    assert_eq!(
        enclave.add(&assignment_ref, Some(&with_seeds(&bytes, &sealed))),
        Err(Exclusion::WrongTensors)
    );
    let _ = KEY;
}

#[test]
fn a_masked_envelope_without_its_layouts_sealed_seeds_is_excluded_before_it_is_opened() {
    let r = model_round();
    let services = KeyServices::new(3, 2);
    let (assignment_ref, bytes) = crate::aggregate::tests::sealed(
        &r,
        "device-seedless",
        ROUND,
        &encode_masked(&[0; VALUES], Ring::Bits64),
    );
    let enclave =
        MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
    assert_eq!(
        enclave.add(&assignment_ref, Some(&bytes)),
        Err(Exclusion::MalformedEnvelope),
        "no seeds"
    );
    // Seeds of another layout (3-of-5's are longer) cannot be cut into this one's.
    let other = KeyServices::new(5, 3);
    let ctx = mask_context(&assignment_ref);
    let seeds: Vec<Seed> = other
        .layout
        .groups()
        .iter()
        .map(|_| Seed::random())
        .collect();
    let public: Vec<PublicKey> = other.keys.iter().map(|(_, p)| *p).collect();
    let sealed = seal_seeds(&other.layout, &seeds, &public, &ctx).unwrap();
    assert_eq!(
        enclave.add(&assignment_ref, Some(&with_seeds(&bytes, &sealed))),
        Err(Exclusion::MalformedEnvelope),
        "another layout's seeds"
    );
}

/// The variance the test policy's budget calibrates (`privacy()`), per group.
fn calibrated_variance() -> u64 {
    let z = privacy().calibration().unwrap().noise_multiplier;
    crate::dp::DiscreteGaussian::at_least(z * 65536.0)
        .unwrap()
        .variance()
}

#[test]
fn with_distributed_noise_the_release_is_the_exact_sum_plus_every_groups_draw_and_no_enclave_noise()
{
    let r = model_round();
    let variance = calibrated_variance();
    for (n, t) in [(3u8, 2u8), (5, 3)] {
        let services = KeyServices::new(n, t);
        let round_data = masked_round(&r, &services);
        let enclave =
            MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
        enclave.add_batch(&round_data.stored);
        let included = enclave.included();
        let answers: Vec<MaskSums> = (1..=n)
            .map(|s| services.noised_answer(s, &included, &round_data.seeds, variance))
            .collect();
        let (unmasked, record) = enclave
            .unmask(&answers, 1.0, Some(variance), r.schema.clone(), &r.private)
            .unwrap();
        assert_eq!(record.noise_variance_grid, Some(variance));
        let release = unmasked.finish(&r.private, privacy()).unwrap();
        // Independently: the clipped updates' exact sum plus each group's draw (from the keys
        // any holder derives), averaged; nothing of the enclave's own.
        let groups = services.layout.groups().len();
        let mut expected = round_data.exact.clone();
        for group in 0..groups {
            let holder = services.layout.groups()[group][0];
            let keys = services.noise_keys(holder, &included, &round_data.seeds);
            let (_, key) = keys.iter().find(|(g, _)| *g == group).unwrap();
            for (sum, z) in expected
                .iter_mut()
                .zip(confed_dp::distributed::noise(VALUES, variance, key))
            {
                *sum += z;
            }
        }
        let average: Vec<f32> = expected
            .iter()
            .map(|&units| crate::dp::grid::to_average(units, 1.0, 20))
            .collect();
        assert_eq!(release.values, average, "{t}-of-{n}");
        let noise = &release.manifest.noise;
        assert_eq!(noise.mechanism, "distributed_discrete_gaussian_on_grid");
        assert_eq!(noise.variance_grid, variance);
        let one = (variance as f64).sqrt() / 65536.0;
        assert!((noise.stddev_sum - one * (groups as f64).sqrt()).abs() < 1e-9);
        // The accounting is the enclave-noised round's: one group's draw is the guarantee.
        let clear = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
        clear.add_batch(&round_data.clear);
        let enclave_noised = clear.finish(&r.private, privacy()).unwrap();
        assert_eq!(release.manifest.privacy, enclave_noised.manifest.privacy);
    }
}

#[test]
fn distributed_noise_below_the_calibrated_variance_or_a_holder_that_skips_it_releases_nothing() {
    let r = model_round();
    let variance = calibrated_variance();
    let services = KeyServices::new(5, 3);
    let round_data = masked_round(&r, &services);
    let start = || {
        let enclave =
            MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
        enclave.add_batch(&round_data.stored);
        enclave
    };
    let included = start().included();
    let noised: Vec<MaskSums> = (1..=5)
        .map(|s| services.noised_answer(s, &included, &round_data.seeds, variance))
        .collect();
    // Too little noise for the budget: the sum unmasks, the release is refused.
    let (unmasked, _) = start()
        .unmask(
            &noised,
            1.0,
            Some(variance - 1),
            r.schema.clone(),
            &r.private,
        )
        .unwrap();
    assert!(matches!(
        unmasked.finish(&r.private, privacy()),
        Err(AggregateError::Unsupported(why)) if why.contains("below")
    ));
    // In 3-of-5 every group has two holders: one that leaves its noise out disagrees.
    let mut skipping = noised.clone();
    skipping[0] = services.answer(1, &included, &round_data.seeds);
    assert!(matches!(
        start().unmask(&skipping, 1.0, Some(variance), r.schema.clone(), &r.private),
        Err(MaskedError::Masking(MaskingError::Disagree { .. }))
    ));
}

#[test]
fn a_round_whose_sum_and_noise_could_wrap_the_ring_of_2_32_is_refused_before_the_unmask() {
    let r = model_round();
    let services = KeyServices::in_ring(3, 2, Ring::Bits32);
    let round_data = masked_round(&r, &services);
    let enclave =
        MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
    enclave.add_batch(&round_data.stored);
    // 20 inputs fit, also with noise of bound 15 sqrt(3 x 2^52) = 2^30.7; with 15 sqrt(3 x
    // 2^54) = 2^31.7 they do not.
    assert!(enclave.check_ring(20, None).is_ok());
    assert!(enclave.check_ring(20, Some(1 << 52)).is_ok());
    assert!(matches!(
        enclave.check_ring(20, Some(1 << 54)),
        Err(MaskedError::RingTooSmall {
            included: 20,
            bits: 32
        })
    ));
    assert!(enclave.check_ring(40_000, None).is_err());
}

/// A masked round cut into 1, 2 or 3 partitions: each partition seals its wrapping sum and its
/// included inputs' slots, the root merges them and asks the key services over the whole
/// included set, and the release is byte for byte the unpartitioned one. A partition seals to
/// one length whichever of its inputs were included.
#[test]
fn a_masked_round_in_partitions_releases_the_unpartitioned_bytes() {
    use crate::aggregate::partition::{Partial, Partition};
    let r = model_round();
    for (n, t, ring) in [(3u8, 2u8, Ring::Bits32), (5, 3, Ring::Bits64)] {
        let services = KeyServices::in_ring(n, t, ring);
        let round_data = masked_round(&r, &services);
        let (inputs, digest) = committed(&round_data.stored);
        let binding = Binding {
            inputs_digest: digest,
            ..binding()
        };
        let fresh = || {
            MaskedAggregator::new(binding.clone(), services.layout.clone(), VALUES, &r.private)
                .unwrap()
        };
        let release_of = |enclave: MaskedAggregator| {
            let included = enclave.included();
            let answers: Vec<MaskSums> = (1..=n)
                .map(|s| services.answer(s, &included, &round_data.seeds))
                .collect();
            let (unmasked, _) = enclave
                .unmask(&answers, 1.0, None, r.schema.clone(), &r.private)
                .unwrap();
            unmasked.finish(&r.private, privacy()).unwrap()
        };
        let whole = fresh();
        whole.add_batch(&round_data.stored);
        let kept: Vec<String> = whole
            .unmask_inputs()
            .into_iter()
            .map(|i| i.assignment_ref)
            .collect();
        let expected = release_of(whole);
        for count in 1..=3u32 {
            // Sealed in reverse order: the merge does not depend on it.
            let sealed: Vec<Vec<u8>> = (0..count)
                .rev()
                .map(|index| {
                    let partition = Partition {
                        inputs: &inputs,
                        index,
                        count,
                    };
                    let worker = fresh();
                    for input in partition.inputs().unwrap() {
                        let _ = worker.add(&input.assignment_ref, input.retained.as_deref());
                    }
                    worker.seal_partition(&r.private, &partition).unwrap()
                })
                .collect();
            // The last partition again, with one more of its inputs excluded (its bytes lost):
            // the same length.
            let partition = Partition {
                inputs: &inputs,
                index: count - 1,
                count,
            };
            let worker = fresh();
            for (i, input) in partition.inputs().unwrap().iter().enumerate() {
                let stored = if i == 0 {
                    None
                } else {
                    input.retained.as_deref()
                };
                let _ = worker.add(&input.assignment_ref, stored);
            }
            let fewer = worker.seal_partition(&r.private, &partition).unwrap();
            assert_eq!(
                fewer.len(),
                sealed[0].len(),
                "{t}-of-{n}, {count} partitions"
            );
            // ... and it merges: the kept inputs are the included ones, and they unmask.
            let other = fresh();
            let with_fewer: Vec<Vec<u8>> = std::iter::once(fewer)
                .chain(sealed[1..].iter().cloned())
                .collect();
            other
                .merge(&r.private, &inputs, count, &with_fewer)
                .unwrap();
            let (included, excluded) = other.counts();
            assert_eq!(included + excluded, 22);
            let kept_by_other: Vec<String> = other
                .unmask_inputs()
                .into_iter()
                .map(|i| i.assignment_ref)
                .collect();
            assert_eq!(kept_by_other, other.included());
            release_of(other);
            let root = fresh();
            root.merge(&r.private, &inputs, count, &sealed).unwrap();
            assert_eq!(root.counts(), (20, 2), "{t}-of-{n}, {count} partitions");
            let merged: Vec<String> = root
                .unmask_inputs()
                .into_iter()
                .map(|i| i.assignment_ref)
                .collect();
            assert_eq!(merged, kept, "{t}-of-{n}, {count} partitions");
            let release = release_of(root);
            assert_eq!(release.average, expected.average, "{count} partitions");
            assert_eq!(release.manifest, expected.manifest, "{count} partitions");
        }
    }
}

/// A masked partition offered to a training root, or a training partition to a masked root, is
/// refused (another kind of state), not merged.
#[test]
fn a_root_refuses_a_partition_of_the_other_kind() {
    use crate::aggregate::partition::{Partial, Partition, PartitionError};
    let r = model_round();
    let services = KeyServices::in_ring(3, 2, Ring::Bits32);
    let round_data = masked_round(&r, &services);
    let (inputs, digest) = committed(&round_data.stored);
    let binding = Binding {
        inputs_digest: digest,
        ..binding()
    };
    let partition = Partition {
        inputs: &inputs,
        index: 0,
        count: 1,
    };
    let masked = || {
        MaskedAggregator::new(binding.clone(), services.layout.clone(), VALUES, &r.private).unwrap()
    };
    let training = || Aggregator::new(binding.clone(), 1.0, r.schema.clone(), &r.private).unwrap();
    let sealed_masked = {
        let worker = masked();
        for input in partition.inputs().unwrap() {
            let _ = worker.add(&input.assignment_ref, input.retained.as_deref());
        }
        worker.seal_partition(&r.private, &partition).unwrap()
    };
    let sealed_training = {
        let worker = training();
        for input in partition.inputs().unwrap() {
            let _ = worker.add(&input.assignment_ref, input.retained.as_deref());
        }
        worker.seal_partition(&r.private, &partition).unwrap()
    };
    assert!(matches!(
        training().merge(&r.private, &inputs, 1, std::slice::from_ref(&sealed_masked)),
        Err(PartitionError::Foreign(_))
    ));
    assert!(matches!(
        masked().merge(
            &r.private,
            &inputs,
            1,
            std::slice::from_ref(&sealed_training)
        ),
        Err(PartitionError::Foreign(_))
    ));
}

/// A masked partition's slots must be its included inputs' in ref order, then zeros: slots out
/// of order, or padding that is not zeros, fail the merge (an enclave never seals them).
#[test]
fn a_masked_partition_whose_slots_are_out_of_order_or_padded_with_data_fails() {
    use crate::aggregate::partition::{Partial, PartitionError};
    let r = model_round();
    let services = KeyServices::in_ring(3, 2, Ring::Bits32);
    let root =
        MaskedAggregator::new(binding(), services.layout.clone(), VALUES, &r.private).unwrap();
    let shape = root.shape(3);
    let slot = shape.masked_slot_bytes.unwrap() as usize;
    let slot_with_ref = |digit: char| {
        let mut bytes = vec![0u8; slot];
        bytes[..64].copy_from_slice(digit.to_string().repeat(64).as_bytes());
        bytes
    };
    let plain = |outcomes: [u8; 3], slots: [Vec<u8>; 3]| {
        let mut plain = vec![0u8; VALUES * 8];
        plain.extend_from_slice(&outcomes);
        for one in slots {
            plain.extend(one);
        }
        plain
    };
    // Two included, in order, then zeros: kept.
    let good = plain(
        [0, 0, 7],
        [slot_with_ref('a'), slot_with_ref('b'), vec![0; slot]],
    );
    assert!(root.absorb_state(&good, 3, &shape).is_ok());
    assert_eq!(root.unmask_inputs().len(), 2);
    for bad in [
        plain(
            [0, 0, 7],
            [slot_with_ref('b'), slot_with_ref('a'), vec![0; slot]],
        ),
        plain(
            [0, 0, 7],
            [slot_with_ref('a'), slot_with_ref('a'), vec![0; slot]],
        ),
        plain(
            [0, 7, 7],
            [slot_with_ref('a'), slot_with_ref('b'), vec![0; slot]],
        ),
    ] {
        assert!(matches!(
            root.absorb_state(&bad, 3, &shape),
            Err(PartitionError::Malformed(_))
        ));
    }
}

/// A masked round of more contributions than the key services unmask in one request fails
/// before the key is asked for.
#[test]
fn a_masked_round_beyond_the_key_services_unmask_limit_is_refused() {
    let limit = confed_attestation::unmask_api::MAX_UNMASK_INPUTS;
    assert!(check_unmask_inputs(limit).is_ok());
    assert!(matches!(
        check_unmask_inputs(limit + 1),
        Err(MaskedError::TooManyInputs { .. })
    ));
}
