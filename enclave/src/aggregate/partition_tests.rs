//! Partitioned rounds: any partitioning releases the one-worker bytes; a partition missing,
//! sealed twice, of another plan or inputs, or not sealed by this task's enclave fails the merge.

use super::inputs::Input;
use super::partition::{MAX_PARTITIONS, Partial, Partition, PartitionError, ranges};
use super::tests::{ROUND, Round, binding, privacy, round, sealed, update};
use super::*;
use crate::policy::{EVALUATION_TENSOR, Evaluation};
use confed_worker_api::model::encode_f32_tensors;

const EVALUATION: Evaluation = Evaluation {
    every: 1,
    max_loss: 2.0,
    max_examples: 10,
    stddev: 60.0,
    on_demand: 0,
};

/// Nine contributions: six valid (one far above the clip norm), one missing, one not an
/// envelope, one sealed for another round. With `evaluating`, each carries metrics.
fn contributions(r: &Round, evaluating: bool) -> Vec<(String, Option<Vec<u8>>)> {
    let plaintext = |i: usize| {
        let values: Vec<f32> = (0..16).map(|j| 0.01 * (i * 16 + j) as f32 - 0.5).collect();
        let values = if i == 3 {
            values.iter().map(|v| v * 40.0).collect()
        } else {
            values
        };
        match evaluating {
            false => update(&values),
            true => encode_f32_tensors(&[
                ("b", vec![2], &values[..2]),
                ("w", vec![14], &values[2..]),
                (EVALUATION_TENSOR, vec![3], &[1.5, i as f32 % 4.0, 4.0]),
            ])
            .unwrap(),
        }
    };
    let mut pairs: Vec<_> = (0..6)
        .map(|i| {
            let (id, bytes) = sealed(r, &format!("a{i}"), ROUND, &plaintext(i));
            (id, Some(bytes))
        })
        .collect();
    pairs.push((crate::envelope::assignment_ref("missing"), None));
    pairs.push((
        crate::envelope::assignment_ref("garbage"),
        Some(b"not an envelope".to_vec()),
    ));
    let (id, bytes) = sealed(r, "elsewhere", ROUND + 1, &plaintext(7));
    pairs.push((id, Some(bytes)));
    pairs
}

/// The round's inputs sorted by ref, as the worker commits them, and their digest.
pub(super) fn committed(pairs: &[(String, Option<Vec<u8>>)]) -> (Vec<Input>, Binding) {
    let (inputs, digest) = super::inputs::committed(pairs);
    let binding = Binding {
        inputs_digest: digest,
        ..binding()
    };
    (inputs, binding)
}

fn aggregator(r: &Round, binding: &Binding, evaluating: bool) -> Aggregator {
    Aggregator::new(binding.clone(), 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .evaluating(evaluating.then_some(EVALUATION))
}

fn add(aggregator: &Aggregator, inputs: &[Input]) {
    for input in inputs {
        let _ = aggregator.add(&input.assignment_ref, input.retained.as_deref());
    }
}

/// Partition `index` of `count`, summed and sealed by its own aggregator (its own worker).
fn seal(
    r: &Round,
    inputs: &[Input],
    binding: &Binding,
    evaluating: bool,
    index: u32,
    count: u32,
) -> Vec<u8> {
    let partition = Partition {
        inputs,
        index,
        count,
    };
    let worker = aggregator(r, binding, evaluating);
    add(&worker, partition.inputs().unwrap());
    worker.seal_partition(&r.private, &partition).unwrap()
}

fn params(evaluating: bool) -> PrivacyParams {
    PrivacyParams {
        rounds: ROUND as u32,
        evaluation: evaluating.then_some(EVALUATION),
        ..privacy()
    }
}

#[test]
fn a_round_in_1_2_3_or_4_partitions_releases_the_one_worker_bytes() {
    let r = round(16);
    for evaluating in [false, true] {
        let (inputs, binding) = committed(&contributions(&r, evaluating));
        let whole = aggregator(&r, &binding, evaluating);
        add(&whole, &inputs);
        let expected = whole.finish(&r.private, params(evaluating)).unwrap();
        assert_eq!(expected.manifest.included, 6);
        assert_eq!(expected.manifest.excluded.values().sum::<u64>(), 3);
        for count in 1..=4 {
            // Sealed in reverse order: the merge does not depend on the order either.
            let sealed: Vec<Vec<u8>> = (0..count)
                .rev()
                .map(|index| seal(&r, &inputs, &binding, evaluating, index, count))
                .collect();
            let root = aggregator(&r, &binding, evaluating);
            root.merge(&r.private, &inputs, count, &sealed).unwrap();
            let release = root.finish(&r.private, params(evaluating)).unwrap();
            assert_eq!(release.average, expected.average, "{count} partitions");
            assert_eq!(release.manifest, expected.manifest, "{count} partitions");
            assert_eq!(
                release.manifest.to_json(),
                expected.manifest.to_json(),
                "{count} partitions"
            );
        }
    }
}

#[test]
fn adaptive_clippings_count_is_merged_exactly() {
    // Clip norm 5: some of the six valid updates are within it, one is far above; the noised
    // count of those within, and so the next clip norm, must come out the same merged.
    let r = round(16);
    let (inputs, binding) = committed(&contributions(&r, false));
    let adaptive = PrivacyParams {
        epsilon: 50.0,
        clip_norm: 5.0,
        adaptive: Some(crate::policy::AdaptiveClipping {
            target_quantile: 0.5,
            learning_rate: 0.2,
            count_stddev: 0.5,
        }),
        ..params(false)
    };
    let clipped =
        |clip: f64| Aggregator::new(binding.clone(), clip, r.schema.clone(), &r.private).unwrap();
    let whole = clipped(5.0);
    add(&whole, &inputs);
    assert!(whole.unclipped.load(std::sync::atomic::Ordering::Relaxed) > 0);
    let expected = whole.finish(&r.private, adaptive).unwrap();
    let sealed: Vec<Vec<u8>> = (0..2)
        .map(|index| {
            let partition = Partition {
                inputs: &inputs,
                index,
                count: 2,
            };
            let worker = clipped(5.0);
            add(&worker, partition.inputs().unwrap());
            worker.seal_partition(&r.private, &partition).unwrap()
        })
        .collect();
    let root = clipped(5.0);
    root.merge(&r.private, &inputs, 2, &sealed).unwrap();
    let release = root.finish(&r.private, adaptive).unwrap();
    assert_eq!(
        release.manifest.adaptive_clipping,
        expected.manifest.adaptive_clipping
    );
    assert_eq!(release.manifest.to_json(), expected.manifest.to_json());
}

#[test]
fn a_partition_of_another_round_or_kind_of_round_fails_the_merge() {
    let r = round(16);
    let (inputs, binding) = committed(&contributions(&r, false));
    let halves: Vec<_> = (0..2)
        .map(|i| seal(&r, &inputs, &binding, false, i, 2))
        .collect();
    let foreign_field = |sealed: Vec<u8>, root: Aggregator| -> String {
        match root.merge(&r.private, &inputs, 2, &[halves[0].clone(), sealed]) {
            Err(PartitionError::Foreign(why)) => why,
            other => panic!("{other:?}"),
        }
    };
    // Sealed for the next round (same inputs, key and plan).
    let next_round = Binding {
        context: super::tests::context(ROUND + 1),
        ..binding.clone()
    };
    let why = foreign_field(
        seal(&r, &inputs, &next_round, false, 1, 2),
        aggregator(&r, &binding, false),
    );
    assert!(why.contains("round"), "{why}");
    // Sealed by a round that evaluates, merged by one that does not.
    let why = foreign_field(
        seal(&r, &inputs, &binding, true, 1, 2),
        aggregator(&r, &binding, false),
    );
    assert!(why.contains("evaluation"), "{why}");
    // A root that added contributions itself merges nothing.
    let busy = aggregator(&r, &binding, false);
    add(&busy, &inputs[..1]);
    assert!(matches!(
        busy.merge(&r.private, &inputs, 2, &halves),
        Err(PartitionError::Incomplete(_))
    ));
}

#[test]
fn a_missing_partition_fails_the_merge() {
    let r = round(16);
    let (inputs, binding) = committed(&contributions(&r, false));
    let sealed = vec![
        seal(&r, &inputs, &binding, false, 0, 3),
        seal(&r, &inputs, &binding, false, 2, 3),
    ];
    let root = aggregator(&r, &binding, false);
    assert_eq!(
        root.merge(&r.private, &inputs, 3, &sealed),
        Err(PartitionError::Missing {
            missing: vec![1],
            count: 3
        })
    );
}

#[test]
fn a_partition_sealed_twice_fails_the_merge() {
    let r = round(16);
    let (inputs, binding) = committed(&contributions(&r, false));
    let first = seal(&r, &inputs, &binding, false, 0, 2);
    let second = seal(&r, &inputs, &binding, false, 1, 2);
    let root = aggregator(&r, &binding, false);
    assert_eq!(
        root.merge(&r.private, &inputs, 2, &[first.clone(), second, first]),
        Err(PartitionError::Duplicate { index: 0, count: 2 })
    );
}

#[test]
fn a_partition_of_another_plan_inputs_or_key_fails_the_merge() {
    let r = round(16);
    let pairs = contributions(&r, false);
    let (inputs, binding) = committed(&pairs);
    let merge = |sealed: Vec<Vec<u8>>, count: u32| {
        aggregator(&r, &binding, false).merge(&r.private, &inputs, count, &sealed)
    };
    // Another plan: the halves of a plan of 2 offered to a plan of 3.
    let halves: Vec<_> = (0..2)
        .map(|i| seal(&r, &inputs, &binding, false, i, 2))
        .collect();
    assert!(matches!(
        merge(halves.clone(), 3),
        Err(PartitionError::Foreign(_))
    ));
    // Other inputs: one contribution's bytes swapped (same refs, so the same ranges).
    let mut swapped = pairs.clone();
    let (id, bytes) = sealed(&r, "a0", ROUND, &update(&[0.25; 16]));
    let slot = swapped.iter().position(|(r, _)| *r == id).unwrap();
    swapped[slot].1 = Some(bytes);
    let (other_inputs, other_binding) = committed(&swapped);
    let foreign: Vec<_> = (0..2)
        .map(|i| seal(&r, &other_inputs, &other_binding, false, i, 2))
        .collect();
    let error = merge(vec![halves[0].clone(), foreign[1].clone()], 2).unwrap_err();
    assert!(
        matches!(&error, PartitionError::Foreign(why) if why.contains("inputs_digest")),
        "{error}"
    );
    // Sealed by an enclave of another key (or forged by the store): it does not open.
    let other = round(16);
    let outsider = {
        let partition = Partition {
            inputs: &inputs,
            index: 1,
            count: 2,
        };
        let worker =
            Aggregator::new(binding.clone(), 1.0, other.schema.clone(), &other.private).unwrap();
        add(&worker, partition.inputs().unwrap());
        worker.seal_partition(&other.private, &partition).unwrap()
    };
    assert_eq!(
        merge(vec![halves[0].clone(), outsider], 2),
        Err(PartitionError::Unauthentic)
    );
    // One byte of the ciphertext changed.
    let mut tampered = halves[1].clone();
    let last = tampered.len() - 20;
    tampered[last] ^= 1;
    assert_eq!(
        merge(vec![halves[0].clone(), tampered], 2),
        Err(PartitionError::Unauthentic)
    );
}

#[test]
fn a_sealed_partitions_length_does_not_depend_on_what_the_devices_sent() {
    let r = round(16);
    let valid: Vec<_> = (0..4)
        .map(|i| {
            let (id, bytes) = sealed(&r, &format!("v{i}"), ROUND, &update(&[0.1; 16]));
            (id, Some(bytes))
        })
        .collect();
    let broken: Vec<_> = (0..4)
        .map(|i| (crate::envelope::assignment_ref(&format!("b{i}")), None))
        .collect();
    let lengths: Vec<usize> = [valid, broken]
        .iter()
        .map(|pairs| {
            let (inputs, binding) = committed(pairs);
            seal(&r, &inputs, &binding, false, 0, 1).len()
        })
        .collect();
    assert_eq!(lengths[0], lengths[1]);
}

#[test]
fn a_worker_that_added_other_inputs_than_its_partitions_seals_nothing() {
    let r = round(16);
    let (inputs, binding) = committed(&contributions(&r, false));
    let partition = Partition {
        inputs: &inputs,
        index: 0,
        count: 2,
    };
    let too_few = aggregator(&r, &binding, false);
    add(&too_few, &partition.inputs().unwrap()[1..]);
    assert!(matches!(
        too_few.seal_partition(&r.private, &partition),
        Err(PartitionError::Incomplete(_))
    ));
    let too_many = aggregator(&r, &binding, false);
    add(&too_many, &inputs[..partition.inputs().unwrap().len() + 1]);
    assert!(matches!(
        too_many.seal_partition(&r.private, &partition),
        Err(PartitionError::Incomplete(_))
    ));
}

#[test]
fn partitions_cover_every_input_once_in_near_equal_runs() {
    for (inputs, count) in [(0, 1), (1, 1), (9, 2), (9, 4), (1000, 7), (5, 5)] {
        let runs = ranges(inputs, count).unwrap();
        assert_eq!(runs.len(), count as usize);
        assert_eq!(runs[0].start, 0);
        assert_eq!(runs.last().unwrap().end, inputs);
        assert!(runs.windows(2).all(|w| w[0].end == w[1].start));
        let lengths: Vec<usize> = runs.iter().map(|r| r.len()).collect();
        let (min, max) = (lengths.iter().min(), lengths.iter().max());
        assert!(max.unwrap() - min.unwrap() <= 1, "{inputs} / {count}");
    }
    for (inputs, count) in [(5, 0), (5, 6), (0, 2), (1 << 20, MAX_PARTITIONS + 1)] {
        assert!(
            matches!(ranges(inputs, count), Err(PartitionError::Plan(_))),
            "{inputs} / {count}"
        );
    }
}
