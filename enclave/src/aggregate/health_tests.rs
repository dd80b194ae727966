//! The noised health signal: the count of devices that sent zeros, released within its recorded
//! noise and charged to the budget; the flag required in every update of a health policy and
//! refused elsewhere; the same count streamed, buffered and merged from partitions.

use super::inputs::Input;
use super::partition::{Partial, Partition};
use super::partition_tests::committed;
use super::tests::{ROUND, Round, binding, privacy, round, sealed};
use super::*;
use crate::policy::{EVALUATION_TENSOR, Evaluation, HEALTH_TENSOR, Health};
use confed_worker_api::model::encode_f32_tensors;

const HEALTH: Health = Health { stddev: 4.0 };

/// An update of `values` with the device's health flag (`1.0`: it sent zeros).
fn flagged_update(values: &[f32], flag: f32) -> Vec<u8> {
    encode_f32_tensors(&[
        ("b", vec![2], &values[..2]),
        ("w", vec![values.len() - 2], &values[2..]),
        (HEALTH_TENSOR, vec![1], &[flag]),
    ])
    .unwrap()
}

fn watching(r: &Round, binding: Binding) -> Aggregator {
    Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .watching_health(Some(HEALTH))
}

fn health_privacy(epsilon: f64) -> PrivacyParams {
    PrivacyParams {
        epsilon,
        rounds: ROUND as u32,
        health: Some(HEALTH),
        ..privacy()
    }
}

fn bound(inputs: &[(String, Option<Vec<u8>>)]) -> Binding {
    Binding {
        inputs_digest: inputs::digest_of(inputs),
        ..binding()
    }
}

/// `zeroed` devices that sent zeros (flag 1) and `trained` that did not.
fn devices(r: &Round, zeroed: usize, trained: usize) -> Vec<(String, Option<Vec<u8>>)> {
    (0..zeroed + trained)
        .map(|i| {
            let plaintext = match i < zeroed {
                true => flagged_update(&[0.0; 4], 1.0),
                false => flagged_update(&[0.1, 0.0, 0.0, 0.0], 0.0),
            };
            let (id, bytes) = sealed(r, &format!("d{i}"), ROUND, &plaintext);
            (id, Some(bytes))
        })
        .collect()
}

#[test]
fn a_round_where_half_the_devices_fail_releases_about_half_within_the_recorded_noise() {
    let r = round(4);
    let inputs = devices(&r, 60, 60);
    let agg = watching(&r, bound(&inputs));
    agg.add_batch(&inputs);
    let release = agg.finish(&r.private, health_privacy(20.0)).unwrap();
    let manifest = release.manifest;
    assert_eq!(manifest.included, 120);
    let record = manifest.health.expect("a health record");
    assert!((4.0..4.01).contains(&record.stddev), "{record:?}");
    assert!(
        (record.zeroed - 60).abs() as f64 <= 6.0 * record.stddev,
        "{record:?}"
    );
    // The last planned round: the value noise and the counts spend the whole budget.
    assert!(
        (manifest.privacy.epsilon_spent - 20.0).abs() < 1e-3,
        "{:?}",
        manifest.privacy
    );
    // It is charged: the value noise is larger than without the health count.
    let plain = PrivacyParams {
        health: None,
        ..health_privacy(20.0)
    };
    assert!(
        manifest.privacy.noise_multiplier > plain.calibration().unwrap().noise_multiplier,
        "{:?}",
        manifest.privacy
    );
}

/// Many releases of the same count under different inputs: the noise's spread is the recorded
/// standard deviation, and the same inputs reproduce the same noise.
#[test]
fn the_health_noise_has_the_recorded_spread_and_is_reproduced_for_the_same_inputs() {
    let r = round(4);
    let release = |digest: String| {
        let binding = Binding {
            inputs_digest: digest,
            ..binding()
        };
        health::release(&HEALTH, 10, &r.private, &binding)
            .unwrap()
            .0
    };
    let counts: Vec<f64> = (0..800)
        .map(|i| release(format!("{i:064}")).zeroed as f64)
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len() as f64;
    let variance =
        counts.iter().map(|c| (c - mean).powi(2)).sum::<f64>() / (counts.len() - 1) as f64;
    assert!((mean - 10.0).abs() < 0.6, "mean {mean}");
    assert!(
        (variance.sqrt() - 4.0).abs() < 0.4,
        "stddev {}",
        variance.sqrt()
    );
    let digest = "f".repeat(64);
    assert_eq!(release(digest.clone()), release(digest));
}

/// Under a health policy every update carries the flag: without it, or with a wrong shape or
/// dtype, it is refused; a NaN flag or non-finite values count as zeros sent. Without a health
/// policy the flag is refused.
#[test]
fn the_flag_is_required_under_a_health_policy_counts_nan_and_non_finite_and_is_refused_elsewhere() {
    let r = round(4);
    let cases: [(&str, Vec<u8>); 3] = [
        ("nan-flag", flagged_update(&[0.1, 0.0, 0.0, 0.0], f32::NAN)),
        (
            "nan-values",
            flagged_update(&[f32::NAN, 0.0, 0.0, 0.0], 0.0),
        ),
        ("fine", flagged_update(&[0.1, 0.0, 0.0, 0.0], 0.0)),
    ];
    let mut inputs: Vec<_> = cases
        .iter()
        .map(|(id, plaintext)| {
            let (id, bytes) = sealed(&r, id, ROUND, plaintext);
            (id, Some(bytes))
        })
        .collect();
    let agg = watching(&r, bound(&inputs));
    agg.add_batch(&inputs);
    assert_eq!(agg.counts(), (3, 0));
    let zeroed = agg.health.as_ref().unwrap().zeroed();
    assert_eq!(zeroed, 2, "a NaN flag and NaN values both count");
    let unflagged = sealed(
        &r,
        "unflagged",
        ROUND,
        &super::tests::update(&[0.1, 0.0, 0.0, 0.0]),
    );
    assert_eq!(
        agg.add(&unflagged.0, Some(&unflagged.1)),
        Err(Exclusion::WrongTensors)
    );
    let wrong_shape = encode_f32_tensors(&[
        ("b", vec![2], &[0.0, 0.0]),
        ("w", vec![2], &[0.0, 0.0]),
        (HEALTH_TENSOR, vec![2], &[1.0, 1.0]),
    ])
    .unwrap();
    let wrong = sealed(&r, "wrong", ROUND, &wrong_shape);
    assert_eq!(
        agg.add(&wrong.0, Some(&wrong.1)),
        Err(Exclusion::WrongTensors)
    );
    let plain = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    inputs.truncate(1);
    let (id, bytes) = (&inputs[0].0, inputs[0].1.as_deref());
    assert_eq!(plain.add(id, bytes), Err(Exclusion::WrongTensors));
    // An aggregator and a policy that disagree on the health signal release nothing.
    let counting = watching(&r, binding());
    counting.add(id, bytes).unwrap();
    assert!(matches!(
        counting.finish(&r.private, privacy()),
        Err(AggregateError::Unsupported(_))
    ));
}

/// A large (chunked) update streams with its flag and counts as the buffered path counts it.
#[test]
fn a_streamed_health_round_counts_what_the_buffered_one_does() {
    let len = 300_000;
    let r = round(len);
    let values = vec![1e-4f32; len];
    let mut nan = values.clone();
    nan[7] = f32::INFINITY;
    let inputs: Vec<_> = [
        sealed(&r, "zeros", ROUND, &flagged_update(&vec![0.0; len], 1.0)),
        sealed(&r, "trained", ROUND, &flagged_update(&values, 0.0)),
        sealed(&r, "inf", ROUND, &flagged_update(&nan, 0.0)),
    ]
    .into_iter()
    .map(|(id, bytes)| (id, Some(bytes)))
    .collect();
    let run = |agg: Aggregator| {
        agg.add_batch(&inputs);
        assert_eq!(agg.counts(), (3, 0));
        assert_eq!(agg.health.as_ref().unwrap().zeroed(), 2);
        agg.finish(&r.private, health_privacy(20.0)).unwrap()
    };
    let buffered = run(watching(&r, bound(&inputs)).stream_above(usize::MAX));
    let streamed = run(watching(&r, bound(&inputs)).stream_above(0));
    assert_eq!(buffered.manifest, streamed.manifest);
    assert_eq!(buffered.average, streamed.average);
    // Without a health policy the streamed path refuses the flag too.
    let plain = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .stream_above(0);
    let (id, bytes) = (&inputs[1].0, inputs[1].1.as_deref());
    assert_eq!(plain.add(id, bytes), Err(Exclusion::WrongTensors));
}

/// Partitions carry their exact count sealed; the merge releases the one-worker bytes.
#[test]
fn a_partitioned_health_round_releases_the_one_worker_bytes() {
    let r = round(4);
    let pairs = devices(&r, 3, 4);
    let (inputs, binding) = committed(&pairs);
    let add = |agg: &Aggregator, inputs: &[Input]| {
        for input in inputs {
            let _ = agg.add(&input.assignment_ref, input.retained.as_deref());
        }
    };
    let whole = watching(&r, binding.clone());
    add(&whole, &inputs);
    let expected = whole.finish(&r.private, health_privacy(20.0)).unwrap();
    for count in [2, 3] {
        let sealed: Vec<Vec<u8>> = (0..count)
            .map(|index| {
                let partition = Partition {
                    inputs: &inputs,
                    index,
                    count,
                };
                let worker = watching(&r, binding.clone());
                add(&worker, partition.inputs().unwrap());
                worker.seal_partition(&r.private, &partition).unwrap()
            })
            .collect();
        let root = watching(&r, binding.clone());
        root.merge(&r.private, &inputs, count, &sealed).unwrap();
        assert_eq!(root.health.as_ref().unwrap().zeroed(), 3);
        let release = root.finish(&r.private, health_privacy(20.0)).unwrap();
        assert_eq!(release.manifest.to_json(), expected.manifest.to_json());
        // A root that does not count health refuses the partitions that do.
        let plain = Aggregator::new(binding.clone(), 1.0, r.schema.clone(), &r.private).unwrap();
        assert!(plain.merge(&r.private, &inputs, count, &sealed).is_err());
    }
}

#[test]
fn the_round_parameters_take_the_health_signal_from_the_policy() {
    let mut policy = crate::policy::TaskPolicy::sample("t", 6);
    policy.epsilon = 50.0;
    policy.mechanism = "discrete_gaussian_on_grid;health=3e0".into();
    let params = PrivacyParams::for_round(&policy, None, false).unwrap();
    assert_eq!(params.health, Some(Health { stddev: 3.0 }));
    policy.mechanism = "discrete_gaussian_on_grid".into();
    assert_eq!(
        PrivacyParams::for_round(&policy, None, false)
            .unwrap()
            .health,
        None
    );
}

/// An evaluation round of a health task: both side tensors, streamed and buffered alike, and
/// merged from partitions (the sealed body holds the metric sums, then the count).
#[test]
fn an_evaluation_round_with_health_streams_and_merges_both_side_tensors() {
    const EVALUATION: Evaluation = Evaluation {
        every: 1,
        max_loss: 2.0,
        max_examples: 10,
        stddev: 60.0,
        on_demand: 0,
    };
    let both = |values: &[f32], metrics: [f32; 3], flag: f32| {
        encode_f32_tensors(&[
            ("b", vec![2], &values[..2]),
            ("w", vec![values.len() - 2], &values[2..]),
            (EVALUATION_TENSOR, vec![3], &metrics),
            (HEALTH_TENSOR, vec![1], &[flag]),
        ])
        .unwrap()
    };
    let len = 300_000;
    let r = round(len);
    let values = vec![1e-4f32; len];
    let pairs: Vec<_> = [
        sealed(&r, "e0", ROUND, &both(&vec![0.0; len], [0.0; 3], 1.0)),
        sealed(&r, "e1", ROUND, &both(&values, [3.0, 2.0, 4.0], 0.0)),
        sealed(&r, "e2", ROUND, &both(&values, [1.0, 1.0, 2.0], 0.0)),
    ]
    .into_iter()
    .map(|(id, bytes)| (id, Some(bytes)))
    .collect();
    let params = PrivacyParams {
        evaluation: Some(EVALUATION),
        ..health_privacy(50.0)
    };
    let aggregator = |binding: Binding| watching(&r, binding).evaluating(Some(EVALUATION));
    let run = |agg: Aggregator| {
        agg.add_batch(&pairs);
        assert_eq!(agg.counts(), (3, 0));
        assert_eq!(agg.health.as_ref().unwrap().zeroed(), 1);
        agg.finish(&r.private, params).unwrap()
    };
    let buffered = run(aggregator(bound(&pairs)).stream_above(usize::MAX));
    let streamed = run(aggregator(bound(&pairs)).stream_above(0));
    assert_eq!(buffered.manifest, streamed.manifest);
    assert!(buffered.manifest.evaluation.is_some() && buffered.manifest.health.is_some());
    let (inputs, binding) = committed(&pairs);
    let sealed_parts: Vec<Vec<u8>> = (0..3)
        .map(|index| {
            let partition = Partition {
                inputs: &inputs,
                index,
                count: 3,
            };
            let worker = aggregator(binding.clone());
            for input in partition.inputs().unwrap() {
                let _ = worker.add(&input.assignment_ref, input.retained.as_deref());
            }
            worker.seal_partition(&r.private, &partition).unwrap()
        })
        .collect();
    let root = aggregator(binding.clone());
    root.merge(&r.private, &inputs, 3, &sealed_parts).unwrap();
    let merged = root.finish(&r.private, params).unwrap();
    assert_eq!(merged.manifest.to_json(), buffered.manifest.to_json());
    // A root that does not count health names the field the partitions differ in.
    let plain = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .evaluating(Some(EVALUATION));
    let error = plain
        .merge(&r.private, &inputs, 3, &sealed_parts)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("its health is true, the round's absent"),
        "{error}"
    );
}
