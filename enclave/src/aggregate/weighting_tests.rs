//! Example-weighted averaging: a round's release is the bounded weighted average computed
//! independently here (within the recorded noise); the example count is required under a
//! weighting policy and refused elsewhere; streamed, buffered and partitioned rounds release the
//! same bytes.

use super::inputs::Input;
use super::partition::{Partial, Partition};
use super::partition_tests::committed;
use super::tests::{ROUND, Round, binding, privacy, round, sealed};
use super::*;
use crate::policy::{EXAMPLES_TENSOR, Weighting};
use confed_worker_api::model::encode_f32_tensors;

const MAX_EXAMPLES: u32 = 40;
const WEIGHTING: Weighting = Weighting {
    max_examples: MAX_EXAMPLES,
};
const CLIP: f64 = 1.0;

/// An update of `values` that trained on `examples`.
fn counted_update(values: &[f32], examples: f32) -> Vec<u8> {
    encode_f32_tensors(&[
        ("b", vec![2], &values[..2]),
        ("w", vec![values.len() - 2], &values[2..]),
        (EXAMPLES_TENSOR, vec![1], &[examples]),
    ])
    .unwrap()
}

fn weighing(r: &Round, binding: Binding) -> Aggregator {
    Aggregator::new(binding, CLIP, r.schema.clone(), &r.private)
        .unwrap()
        .weighing(Some(WEIGHTING))
}

fn weighted_privacy(epsilon: f64) -> PrivacyParams {
    PrivacyParams {
        epsilon,
        rounds: ROUND as u32,
        weighting: Some(WEIGHTING),
        ..privacy()
    }
}

/// Device `i`'s update and example count: two populations that pull the average apart, one of
/// many examples (some above the cap) pointing along `b[0]`, one of few along `b[1]`, with
/// norms below and above the clip norm.
fn device(i: usize, len: usize) -> (Vec<f32>, f32) {
    let mut values = vec![0.0f32; len];
    match i % 2 {
        0 => {
            values[0] = 0.5 + (i % 5) as f32 * 0.2; // 0.5 to 1.3: some clipped
            (values, [30.0, 40.0, 500.0][i % 3])
        }
        _ => {
            values[1] = 0.8;
            values[2] = 0.3;
            (values, [2.0, 4.0, 0.0][i % 3])
        }
    }
}

/// The bounded weighted average, computed independently: each update clipped to the clip norm,
/// times min(examples, max) / max, summed, divided by the number of devices.
fn expected_average(devices: &[(Vec<f32>, f32)]) -> Vec<f64> {
    let len = devices[0].0.len();
    let mut sum = vec![0.0f64; len];
    for (values, examples) in devices {
        let norm = values
            .iter()
            .map(|&v| f64::from(v).powi(2))
            .sum::<f64>()
            .sqrt();
        let clip = (CLIP / norm).min(1.0);
        let weight = f64::from(examples.min(MAX_EXAMPLES as f32)) / f64::from(MAX_EXAMPLES);
        for (s, &v) in sum.iter_mut().zip(values) {
            *s += f64::from(v) * clip * weight;
        }
    }
    sum.iter().map(|s| s / devices.len() as f64).collect()
}

fn sealed_devices(r: &Round, devices: &[(Vec<f32>, f32)]) -> Vec<(String, Option<Vec<u8>>)> {
    devices
        .iter()
        .enumerate()
        .map(|(i, (values, examples))| {
            let (id, bytes) = sealed(
                r,
                &format!("d{i}"),
                ROUND,
                &counted_update(values, *examples),
            );
            (id, Some(bytes))
        })
        .collect()
}

fn bound(inputs: &[(String, Option<Vec<u8>>)]) -> Binding {
    Binding {
        inputs_digest: inputs::digest_of(inputs),
        ..binding()
    }
}

#[test]
fn a_weighted_round_releases_the_bounded_weighted_average_within_the_recorded_noise() {
    let len = 6;
    let r = round(len);
    let devices: Vec<_> = (0..300).map(|i| device(i, len)).collect();
    let inputs = sealed_devices(&r, &devices);
    let agg = weighing(&r, bound(&inputs));
    agg.add_batch(&inputs);
    let release = agg.finish(&r.private, weighted_privacy(50.0)).unwrap();
    assert_eq!(release.manifest.included, 300);
    let stddev = release.manifest.noise.stddev_average;
    let expected = expected_average(&devices);
    for (i, (&got, want)) in release.values.iter().zip(&expected).enumerate() {
        assert!(
            (f64::from(got) - want).abs() <= 5.0 * stddev,
            "value {i}: released {got}, expected {want} (noise stddev {stddev})"
        );
    }
    // The test tells weighting from uniform averaging: the uniform average of the same clipped
    // updates lies many noise deviations away on b[1].
    let uniform: f64 = devices
        .iter()
        .map(|(v, _)| {
            let norm = v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            f64::from(v[1]) * (CLIP / norm).min(1.0)
        })
        .sum::<f64>()
        / devices.len() as f64;
    assert!(
        (uniform - expected[1]).abs() > 20.0 * stddev,
        "uniform {uniform}, weighted {} (stddev {stddev})",
        expected[1]
    );
    // Weighting costs no privacy: the noise is that of a uniform round of the same policy.
    let uniform_params = PrivacyParams {
        weighting: None,
        ..weighted_privacy(50.0)
    };
    assert_eq!(
        release.manifest.privacy.noise_multiplier,
        uniform_params.calibration().unwrap().noise_multiplier
    );
}

/// Under a weighting policy every update carries its count: without it, or with a wrong shape,
/// it is refused; a NaN, infinite or negative count weighs 0 (included, adding nothing). Without
/// a weighting policy the count is refused; an aggregator and a policy that disagree release
/// nothing.
#[test]
fn the_count_is_required_under_a_weighting_policy_bad_counts_weigh_nothing_and_it_is_refused_elsewhere()
 {
    let len = 4;
    let r = round(len);
    let big = [0.0, 0.0, 0.5, 0.0];
    let cases: Vec<_> = [f32::NAN, f32::INFINITY, -5.0, 0.0]
        .iter()
        .enumerate()
        .map(|(i, &examples)| {
            let (id, bytes) = sealed(
                &r,
                &format!("bad{i}"),
                ROUND,
                &counted_update(&big, examples),
            );
            (id, Some(bytes))
        })
        .collect();
    let agg = weighing(&r, bound(&cases));
    agg.add_batch(&cases);
    assert_eq!(agg.counts(), (4, 0));
    assert!(agg.sum.into_sum().iter().all(|&units| units == 0));

    let agg = weighing(&r, binding());
    let uncounted = sealed(&r, "uncounted", ROUND, &super::tests::update(&big));
    assert_eq!(
        agg.add(&uncounted.0, Some(&uncounted.1)),
        Err(Exclusion::WrongTensors)
    );
    let wrong_shape = encode_f32_tensors(&[
        ("b", vec![2], &[0.0, 0.0]),
        ("w", vec![2], &[0.0, 0.0]),
        (EXAMPLES_TENSOR, vec![2], &[1.0, 1.0]),
    ])
    .unwrap();
    let wrong = sealed(&r, "wrong", ROUND, &wrong_shape);
    assert_eq!(
        agg.add(&wrong.0, Some(&wrong.1)),
        Err(Exclusion::WrongTensors)
    );
    let counted = sealed(&r, "counted", ROUND, &counted_update(&big, 3.0));
    let plain = Aggregator::new(binding(), CLIP, r.schema.clone(), &r.private).unwrap();
    assert_eq!(
        plain.add(&counted.0, Some(&counted.1)),
        Err(Exclusion::WrongTensors)
    );
    let weighing_alone = weighing(&r, binding());
    weighing_alone.add(&counted.0, Some(&counted.1)).unwrap();
    assert!(matches!(
        weighing_alone.finish(&r.private, privacy()),
        Err(AggregateError::Unsupported(_))
    ));
}

/// A large (chunked) update streams with its count and is weighed as the buffered path weighs
/// it; a partitioned round releases the one-worker bytes.
#[test]
fn streamed_buffered_and_partitioned_weighted_rounds_release_the_same_bytes() {
    let len = 300_000;
    let r = round(len);
    let devices: Vec<(Vec<f32>, f32)> = (0..4)
        .map(|i| {
            let values: Vec<f32> = (0..len).map(|j| ((i * 7 + j) % 13) as f32 * 1e-3).collect();
            (values, [3.0, 40.0, 90.0, f32::NAN][i])
        })
        .collect();
    let pairs = sealed_devices(&r, &devices);
    let run = |agg: Aggregator| {
        agg.add_batch(&pairs);
        assert_eq!(agg.counts(), (4, 0));
        agg.finish(&r.private, weighted_privacy(20.0)).unwrap()
    };
    let buffered = run(weighing(&r, bound(&pairs)).stream_above(usize::MAX));
    let streamed = run(weighing(&r, bound(&pairs)).stream_above(0));
    assert_eq!(buffered.manifest, streamed.manifest);
    assert_eq!(buffered.average, streamed.average);
    // The weights were applied: unweighted, the same updates sum to something else.
    let uniform = Aggregator::new(bound(&pairs), CLIP, r.schema.clone(), &r.private).unwrap();
    let unweighted: Vec<_> = devices
        .iter()
        .enumerate()
        .map(|(i, (values, _))| {
            let (id, bytes) = sealed(&r, &format!("d{i}"), ROUND, &super::tests::update(values));
            (id, Some(bytes))
        })
        .collect();
    uniform.add_batch(&unweighted);
    let weighed = weighing(&r, bound(&pairs)).stream_above(0);
    weighed.add_batch(&pairs);
    assert_ne!(uniform.sum.into_sum(), weighed.sum.into_sum());

    let (inputs, binding) = committed(&pairs);
    let add = |agg: &Aggregator, inputs: &[Input]| {
        for input in inputs {
            let _ = agg.add(&input.assignment_ref, input.retained.as_deref());
        }
    };
    let whole = weighing(&r, binding.clone());
    add(&whole, &inputs);
    let expected = whole.finish(&r.private, weighted_privacy(20.0)).unwrap();
    let sealed_parts: Vec<Vec<u8>> = (0..2)
        .map(|index| {
            let partition = Partition {
                inputs: &inputs,
                index,
                count: 2,
            };
            let worker = weighing(&r, binding.clone());
            add(&worker, partition.inputs().unwrap());
            worker.seal_partition(&r.private, &partition).unwrap()
        })
        .collect();
    let root = weighing(&r, binding.clone());
    root.merge(&r.private, &inputs, 2, &sealed_parts).unwrap();
    let merged = root.finish(&r.private, weighted_privacy(20.0)).unwrap();
    assert_eq!(merged.manifest.to_json(), expected.manifest.to_json());
    assert_eq!(merged.average, expected.average);
}

#[test]
fn the_round_parameters_take_weighting_from_the_policy() {
    let mut policy = crate::policy::TaskPolicy::sample("t", 6);
    policy.mechanism = "discrete_gaussian_on_grid;weighting=examples,40".into();
    let params = PrivacyParams::for_round(&policy, None, false).unwrap();
    assert_eq!(params.weighting, Some(WEIGHTING));
    policy.mechanism = "discrete_gaussian_on_grid".into();
    assert_eq!(
        PrivacyParams::for_round(&policy, None, false)
            .unwrap()
            .weighting,
        None
    );
}

/// An update read as a stream that counts how often it was read.
struct CountedReads {
    values: Vec<u8>,
    reads: std::cell::Cell<usize>,
}

impl accumulator::Replay for CountedReads {
    type Error = ();
    fn replay(&self, each: &mut dyn FnMut(usize, usize, &[u8])) -> Result<(), ()> {
        self.reads.set(self.reads.get() + 1);
        each(0, 0, &self.values);
        Ok(())
    }
}

/// The example count is a device's data and a job's duration is the host's to see: a streamed
/// update is read exactly twice (measured, then added) whatever its weight (0, below 1, 1),
/// within the clip norm or above it, weighed or not, and even when it holds a NaN (nothing of
/// which is added); a weight of 0 takes the same buffered passes as any other.
#[test]
fn a_streamed_update_is_read_twice_whatever_its_weight_norm_or_values() {
    let counted = |values: &[f32]| CountedReads {
        values: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        reads: std::cell::Cell::new(0),
    };
    let weighed_reads = |values: &[f32], weight: f64| {
        let source = counted(values);
        let sum = accumulator::Accumulator::new(values.len());
        let _ = sum.add_weighted_stream(&source, CLIP, || weight);
        source.reads.get()
    };
    let uniform_reads = |values: &[f32]| {
        let source = counted(values);
        let sum = accumulator::Accumulator::new(values.len());
        let _ = sum.add_clipped_stream(&source, CLIP);
        source.reads.get()
    };
    let within = [0.3f32, 0.4, 0.0];
    let above = [3.0f32, 4.0, 0.0];
    let not_finite = [3.0f32, f32::NAN, 0.0];
    let cases = [&within[..], &above[..], &not_finite[..]];
    let mut counts: Vec<usize> = cases
        .iter()
        .flat_map(|values| [0.0, 0.25, 1.0].map(|w| weighed_reads(values, w)))
        .collect();
    counts.extend(cases.iter().map(|values| uniform_reads(values)));
    assert_eq!(counts, vec![2; 12], "measured, then added");
    // The NaN update is refused as non-finite and leaves nothing behind.
    let source = counted(&not_finite);
    let sum = accumulator::Accumulator::new(3);
    assert_eq!(
        sum.add_clipped_stream(&source, CLIP),
        Err(accumulator::StreamError::NonFinite)
    );
    assert_eq!(sum.into_sum(), [0, 0, 0]);
    // What stays is the weighed update: a quarter of (0.3, 0.4) on the grid, and nothing at 0.
    let source = counted(&within);
    let sum = accumulator::Accumulator::new(3);
    sum.add_weighted_stream(&source, CLIP, || 0.25).unwrap();
    let unit = dp::grid::GRID_UNITS_PER_CLIP as f64;
    assert_eq!(
        sum.into_sum(),
        [
            (0.3f32 as f64 * 0.25 * unit).round() as i64,
            (0.4f32 as f64 * 0.25 * unit).round() as i64,
            0
        ]
    );
    let zero = accumulator::Accumulator::new(3);
    zero.add_weighted(&[&source.values], CLIP, 0.0, 0).unwrap();
    assert_eq!(zero.into_sum(), [0, 0, 0]);
}
