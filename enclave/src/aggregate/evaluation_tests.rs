//! Evaluation rounds: the metrics sums released within their recorded noise, charged to the
//! budget, accepted only in evaluation rounds, and the same on the streamed path.

use super::tests::{KEY, ROUND, Round, binding, context, privacy, round, sealed};
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

/// An update of `values` with the device's `[loss_sum, correct, examples]`.
fn evaluated_update(values: &[f32], metrics: [f32; 3]) -> Vec<u8> {
    encode_f32_tensors(&[
        ("b", vec![2], &values[..2]),
        ("w", vec![values.len() - 2], &values[2..]),
        (EVALUATION_TENSOR, vec![3], &metrics),
    ])
    .unwrap()
}

fn evaluating_privacy() -> PrivacyParams {
    PrivacyParams {
        rounds: ROUND as u32,
        evaluation: Some(EVALUATION),
        ..privacy()
    }
}

fn aggregator(r: &Round, binding: Binding) -> Aggregator {
    Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .evaluating(Some(EVALUATION))
}

/// The manifest of an evaluation round over `inputs` under a large budget (epsilon 50), so that
/// little noise fits.
fn released_at_epsilon_50(
    r: &Round,
    evaluation: Evaluation,
    inputs: &[(String, Option<Vec<u8>>)],
) -> Manifest {
    let binding = Binding {
        inputs_digest: inputs::digest_of(inputs),
        ..binding()
    };
    let agg = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .evaluating(Some(evaluation));
    agg.add_batch(inputs);
    let params = PrivacyParams {
        epsilon: 50.0,
        evaluation: Some(evaluation),
        ..evaluating_privacy()
    };
    agg.finish(&r.private, params).unwrap().manifest
}

#[test]
fn an_evaluation_round_releases_the_metric_sums_within_the_recorded_noise_and_spends_the_budget() {
    // 200 devices: sealing is slow in debug builds.
    let evaluation = Evaluation {
        stddev: 6.0,
        ..EVALUATION
    };
    let r = round(4);
    let inputs: Vec<_> = (0..200)
        .map(|i| {
            let plaintext = evaluated_update(&[0.1, 0.0, 0.0, 0.0], [5.0, 7.0, 10.0]);
            let (id, bytes) = sealed(&r, &format!("a{i}"), ROUND, &plaintext);
            (id, Some(bytes))
        })
        .collect();
    let manifest = released_at_epsilon_50(&r, evaluation, &inputs);
    assert_eq!(manifest.included, 200);
    let record = manifest.evaluation.expect("an evaluation record");
    assert_eq!(record.model_version, ROUND - 1);
    assert!((6.0..6.01).contains(&record.stddev), "{record:?}");
    for (noised, truth) in [
        (record.examples, 2_000.0),
        (record.correct, 1_400.0),
        (record.loss_sum / evaluation.max_loss, 500.0),
    ] {
        assert!(
            (noised - truth).abs() < 6.0 * record.stddev,
            "{noised} vs {truth}: {record:?}"
        );
    }
    assert!((record.accuracy.unwrap() - 0.7).abs() < 0.04, "{record:?}");
    assert!((record.loss.unwrap() - 0.5).abs() < 0.04, "{record:?}");
    // The last planned round: value noise and evaluations together spend the whole budget.
    assert!(
        (manifest.privacy.epsilon_spent - 50.0).abs() < 1e-3,
        "{:?}",
        manifest.privacy
    );
}

/// Many releases of the same (empty) sums under different inputs: the noise's spread is the
/// recorded standard deviation, and the same inputs reproduce the same noise.
#[test]
fn the_metric_noise_has_the_recorded_spread_and_is_reproduced_for_the_same_inputs() {
    let r = round(4);
    let release = |digest: String| {
        let binding = Binding {
            inputs_digest: digest,
            ..binding()
        };
        evaluation::release(&EVALUATION, false, Default::default(), &r.private, &binding)
            .unwrap()
            .0
    };
    let examples: Vec<f64> = (0..400)
        .map(|i| release(format!("{i:064}")).examples)
        .collect();
    let n = examples.len() as f64;
    let mean = examples.iter().sum::<f64>() / n;
    let spread = (examples.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let recorded = release("0".repeat(64)).stddev;
    assert!(mean.abs() < 4.0 * recorded / n.sqrt(), "mean {mean}");
    assert!(
        (spread / recorded - 1.0).abs() < 0.12,
        "{spread} vs {recorded}"
    );
    assert_eq!(release("7".repeat(64)), release("7".repeat(64)));
}

#[test]
fn metrics_are_refused_outside_an_evaluation_round_and_optional_in_one() {
    let r = round(4);
    let with = sealed(
        &r,
        "with",
        ROUND,
        &evaluated_update(&[0.1, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0]),
    );
    let without = sealed(
        &r,
        "without",
        ROUND,
        &super::tests::update(&[0.1, 0.0, 0.0, 0.0]),
    );
    let plain = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    assert_eq!(
        plain.add(&with.0, Some(&with.1)),
        Err(Exclusion::WrongTensors)
    );
    let evaluating = aggregator(&r, binding());
    assert_eq!(evaluating.add(&with.0, Some(&with.1)), Ok(()));
    assert_eq!(evaluating.add(&without.0, Some(&without.1)), Ok(()));
    let wrong_shape = encode_f32_tensors(&[
        ("b", vec![2], &[0.0, 0.0]),
        ("w", vec![2], &[0.0, 0.0]),
        (EVALUATION_TENSOR, vec![2], &[1.0, 1.0]),
    ])
    .unwrap();
    let wrong = sealed(&r, "wrong", ROUND, &wrong_shape);
    assert_eq!(
        evaluating.add(&wrong.0, Some(&wrong.1)),
        Err(Exclusion::WrongTensors)
    );
    assert_eq!(evaluating.counts(), (2, 1));
}

/// Metrics go with their update: an update with a NaN is in as zeros, and its finite metrics
/// count; metrics with a NaN count as none and leave the update in (excluding either would
/// publish that the device's data gave a NaN).
#[test]
fn a_nan_update_keeps_its_metrics_and_nan_metrics_count_as_none() {
    let evaluation = Evaluation {
        every: 1,
        max_loss: 1.0,
        max_examples: 1,
        stddev: 1.0,
        on_demand: 0,
    };
    let r = round(4);
    let mut inputs = Vec::new();
    let cases: [(usize, [f32; 4], [f32; 3]); 3] = [
        (10, [0.1, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0]),
        (20, [f32::NAN, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0]),
        (20, [0.1, 0.0, 0.0, 0.0], [f32::NAN, 1.0, 1.0]),
    ];
    for (case, (count, values, metrics)) in cases.iter().enumerate() {
        for i in 0..*count {
            let plaintext = evaluated_update(values, *metrics);
            let (id, bytes) = sealed(&r, &format!("c{case}-{i}"), ROUND, &plaintext);
            inputs.push((id, Some(bytes)));
        }
    }
    let manifest = released_at_epsilon_50(&r, evaluation, &inputs);
    assert_eq!(manifest.included, 50);
    assert!(manifest.excluded.is_empty(), "{:?}", manifest.excluded);
    let record = manifest.evaluation.unwrap();
    // The first thirty count: 30 examples, with noise of 1 example.
    assert!((record.examples - 30.0).abs() < 6.0, "{record:?}");
    assert!((record.correct - 30.0).abs() < 6.0, "{record:?}");
}

#[test]
fn a_metrics_tensor_of_another_dtype_or_an_extra_tensor_is_refused() {
    let r = round(4);
    let agg = aggregator(&r, binding());
    let as_f64 = {
        let mut tensors = safetensors_f64_metrics();
        tensors.push(("b", vec![2], vec![0u8; 8], safetensors::Dtype::F32));
        tensors.push(("w", vec![2], vec![0u8; 8], safetensors::Dtype::F32));
        serialize(tensors)
    };
    let (id, bytes) = sealed(&r, "f64", ROUND, &as_f64);
    assert_eq!(agg.add(&id, Some(&bytes)), Err(Exclusion::WrongDtype));
    let extra = encode_f32_tensors(&[
        ("b", vec![2], &[0.0, 0.0]),
        ("w", vec![2], &[0.0, 0.0]),
        ("x", vec![3], &[1.0, 1.0, 1.0]),
    ])
    .unwrap();
    let (id, bytes) = sealed(&r, "extra", ROUND, &extra);
    assert_eq!(agg.add(&id, Some(&bytes)), Err(Exclusion::WrongTensors));
}

fn safetensors_f64_metrics() -> Vec<(&'static str, Vec<usize>, Vec<u8>, safetensors::Dtype)> {
    let values: Vec<u8> = [1.0f64, 1.0, 1.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vec![(EVALUATION_TENSOR, vec![3], values, safetensors::Dtype::F64)]
}

fn serialize(tensors: Vec<(&'static str, Vec<usize>, Vec<u8>, safetensors::Dtype)>) -> Vec<u8> {
    let views: Vec<_> = tensors
        .iter()
        .map(|(name, shape, data, dtype)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// A worker that collects metrics in a round the policy does not evaluate, or does not in one it
/// does, releases nothing: the metrics would be noise over nothing or go uncharged.
#[test]
fn the_aggregator_must_collect_metrics_exactly_when_the_policy_evaluates() {
    let r = round(4);
    let contribution = sealed(&r, "a", ROUND, &super::tests::update(&[0.1, 0.0, 0.0, 0.0]));
    let run = |agg: Aggregator, params: PrivacyParams| {
        agg.add(&contribution.0, Some(&contribution.1)).unwrap();
        agg.finish(&r.private, params)
    };
    let not_collecting = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    assert!(matches!(
        run(not_collecting, evaluating_privacy()),
        Err(AggregateError::EvaluationMismatch {
            collected: false,
            ..
        })
    ));
    let every_two = Evaluation {
        every: 2,
        ..EVALUATION
    };
    let params = PrivacyParams {
        evaluation: Some(every_two),
        ..evaluating_privacy()
    };
    assert_eq!(params.evaluation_in(ROUND), None, "round 2 of every 2: no");
    assert!(matches!(
        run(aggregator(&r, binding()), params),
        Err(AggregateError::EvaluationMismatch {
            collected: true,
            ..
        })
    ));
    // Not an evaluation round, not collecting: released without an evaluation record.
    let plain = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    assert_eq!(run(plain, params).unwrap().manifest.evaluation, None);
}

/// A large (chunked) update with metrics takes the buffered path and is summed exactly as the
/// buffered aggregator sums it; without metrics it streams.
#[test]
fn a_streamed_evaluation_round_sums_what_the_buffered_one_does() {
    let len = 300_000;
    let r = round(len);
    let values = vec![1e-4f32; len];
    let inputs: Vec<_> = [
        sealed(&r, "m", ROUND, &evaluated_update(&values, [3.0, 2.0, 4.0])),
        sealed(&r, "n", ROUND, &super::tests::update(&values)),
    ]
    .into_iter()
    .map(|(id, bytes)| (id, Some(bytes)))
    .collect();
    let binding = Binding {
        context: context(ROUND),
        key_id: KEY.into(),
        inputs_digest: inputs::digest_of(&inputs),
    };
    let run = |agg: Aggregator| {
        agg.add_batch(&inputs);
        assert_eq!(agg.counts(), (2, 0));
        agg.finish(&r.private, evaluating_privacy()).unwrap()
    };
    let buffered = run(aggregator(&r, binding.clone()).stream_above(usize::MAX));
    let streamed = run(aggregator(&r, binding.clone()).stream_above(0));
    assert_eq!(buffered.manifest, streamed.manifest);
    assert_eq!(buffered.average, streamed.average);
    assert!(buffered.manifest.evaluation.is_some());
    // Outside an evaluation round the streamed path refuses the metrics tensor too.
    let plain = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .stream_above(0);
    let (id, bytes) = (inputs[0].0.clone(), inputs[0].1.clone().unwrap());
    assert_eq!(plain.add(&id, Some(&bytes)), Err(Exclusion::WrongTensors));
}

/// On demand: the job's flag (the store's word) makes a round outside the schedule evaluate,
/// only under a policy that allows on-demand evaluations, and binds itself into the digest.
#[test]
fn an_on_demand_evaluation_needs_a_policy_that_allows_one_and_changes_the_commitment() {
    let mut policy = crate::policy::TaskPolicy::sample("t", 6);
    policy.epsilon = 50.0;
    policy.mechanism = "discrete_gaussian_on_grid;evaluation=3,1e1,10,2e2,0".into();
    assert!(PrivacyParams::for_round(&policy, None, true).is_err());
    let params = PrivacyParams::for_round(&policy, None, false).unwrap();
    assert_eq!(params.evaluation_in(2), None);
    policy.mechanism = "discrete_gaussian_on_grid;evaluation=3,1e1,10,2e2,1".into();
    let asked = PrivacyParams::for_round(&policy, None, true).unwrap();
    assert!(
        asked.evaluation_in(2).is_some(),
        "round 2 of every 3, on demand"
    );
    let not_asked = PrivacyParams::for_round(&policy, None, false).unwrap();
    assert_eq!(not_asked.evaluation_in(2), None);
    assert!(not_asked.evaluation_in(4).is_some(), "scheduled");
    // The flag is bound into what the worker commits to (and keys the noise with).
    let digest = "e".repeat(64);
    assert_ne!(asked.bind_round_choices(digest.clone()), digest);
    assert_eq!(not_asked.bind_round_choices(digest.clone()), digest);
}
