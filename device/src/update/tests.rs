use super::*;

fn encode(tensors: &[(&str, Vec<usize>, &[f32])]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<_> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), data)| (*name, view(shape.clone(), data)))
        .collect();
    safetensors::serialize(views, None).unwrap()
}

fn model() -> Vec<u8> {
    encode(&[("w", vec![2, 2], &[1.0; 4]), ("b", vec![2], &[0.5, 0.5])])
}

fn values_of(update: &WellFormedUpdate) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let parsed = SafeTensors::deserialize(update.bytes()).unwrap();
    let mut out: Vec<_> = parsed
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            let values = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, v.shape().to_vec(), values)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn zeros_of_the_model() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    vec![
        ("b".into(), vec![2], vec![0.0; 2]),
        ("w".into(), vec![2, 2], vec![0.0; 4]),
    ]
}

#[test]
fn a_trained_update_passes_with_its_values() {
    let shape = UpdateShape::of_model(&model()).unwrap();
    let trained = encode(&[
        ("b", vec![2], &[0.1, 0.2]),
        ("w", vec![2, 2], &[1., 2., 3., 4.]),
    ]);
    let update = shape.well_formed(Ok(trained), None);
    assert!(update.problems().is_empty());
    assert_eq!(
        values_of(&update),
        vec![
            ("b".into(), vec![2], vec![0.1, 0.2]),
            ("w".into(), vec![2, 2], vec![1., 2., 3., 4.]),
        ]
    );
}

/// Whatever training did, the bytes sent have one length: the model's (and the metrics').
type Trained = Result<Vec<u8>, String>;
type IsProblem = fn(&TrainingProblem) -> bool;

#[test]
fn every_failure_becomes_a_zero_update_of_the_same_length() {
    let shape = UpdateShape::of_model(&model()).unwrap();
    let good = encode(&[
        ("b", vec![2], &[0.1, 0.2]),
        ("w", vec![2, 2], &[1., 2., 3., 4.]),
    ]);
    let nan = encode(&[
        ("b", vec![2], &[f32::NAN, 0.2]),
        ("w", vec![2, 2], &[1.; 4]),
    ]);
    let inf = encode(&[
        ("b", vec![2], &[0.1, 0.2]),
        ("w", vec![2, 2], &[f32::INFINITY; 4]),
    ]);
    let renamed = encode(&[("c", vec![2], &[0.1, 0.2]), ("w", vec![2, 2], &[1.; 4])]);
    let reshaped = encode(&[("b", vec![1, 2], &[0.1, 0.2]), ("w", vec![2, 2], &[1.; 4])]);
    let extra = encode(&[
        ("b", vec![2], &[0.1, 0.2]),
        ("w", vec![2, 2], &[1.; 4]),
        ("x", vec![1], &[1.0]),
    ]);
    let expected_len = shape.well_formed(Ok(good.clone()), None).bytes().len();
    let cases: [(&str, Trained, IsProblem); 7] = [
        (
            "nan",
            Ok(nan.clone()),
            |p| matches!(p, TrainingProblem::NonFinite(n) if n == "b"),
        ),
        (
            "infinity",
            Ok(inf.clone()),
            |p| matches!(p, TrainingProblem::NonFinite(n) if n == "w"),
        ),
        ("renamed", Ok(renamed.clone()), |p| p.is_programming_error()),
        ("reshaped", Ok(reshaped.clone()), |p| {
            p.is_programming_error()
        }),
        ("extra tensor", Ok(extra.clone()), |p| {
            p.is_programming_error()
        }),
        ("not safetensors", Ok(b"junk".to_vec()), |p| {
            p.is_programming_error()
        }),
        ("raised", Err("too few examples".into()), |p| {
            *p == TrainingProblem::TrainingFailed("too few examples".into())
        }),
    ];
    for (case, trained, problem) in cases {
        let update = shape.well_formed(trained, None);
        assert_eq!(values_of(&update), zeros_of_the_model(), "{case}");
        assert_eq!(update.bytes().len(), expected_len, "{case}");
        assert_eq!(update.problems().len(), 1, "{case}");
        assert!(
            problem(&update.problems()[0]),
            "{case}: {:?}",
            update.problems()
        );
        assert!(!update.problems()[0].is_programming_error() || case != "nan");
    }
}

#[test]
fn an_evaluation_round_always_carries_metrics_zero_when_evaluation_failed() {
    let shape = UpdateShape::of_model(&model()).unwrap();
    let good = encode(&[("b", vec![2], &[0.1, 0.2]), ("w", vec![2, 2], &[1.; 4])]);
    let metrics = |update: &WellFormedUpdate| {
        values_of(update)
            .into_iter()
            .find(|(name, _, _)| name == EVALUATION_TENSOR)
            .map(|(_, _, v)| v)
    };
    let sent = shape.well_formed(Ok(good.clone()), Some(Ok([3.0, 2.0, 4.0])));
    assert_eq!(metrics(&sent), Some(vec![3.0, 2.0, 4.0]));
    let failed = shape.well_formed(Ok(good.clone()), Some(Err("no held-out rows".into())));
    assert_eq!(metrics(&failed), Some(vec![0.0; 3]));
    let nan = shape.well_formed(Err("raised".into()), Some(Ok([f32::NAN, 1.0, 1.0])));
    assert_eq!(metrics(&nan), Some(vec![0.0; 3]));
    assert_eq!(nan.problems().len(), 2);
    assert_eq!(sent.bytes().len(), failed.bytes().len());
    assert_eq!(sent.bytes().len(), nan.bytes().len());
    assert_eq!(metrics(&shape.well_formed(Ok(good.clone()), None)), None);
}

/// Under a health policy every update carries the flag, in the same shape: 1 exactly when the
/// model's values were replaced by zeros (a failed evaluation alone does not set it).
#[test]
fn a_health_policy_update_always_carries_the_flag_one_exactly_when_zeros_were_sent() {
    let shape = UpdateShape::of_model(&model())
        .unwrap()
        .reporting_health(true);
    let good = encode(&[("b", vec![2], &[0.1, 0.2]), ("w", vec![2, 2], &[1.; 4])]);
    let nan = encode(&[
        ("b", vec![2], &[f32::NAN, 0.2]),
        ("w", vec![2, 2], &[1.; 4]),
    ]);
    let flag = |update: &WellFormedUpdate| {
        values_of(update)
            .into_iter()
            .find(|(name, _, _)| name == HEALTH_TENSOR)
            .map(|(_, shape, v)| (shape, v))
    };
    let cases: [(&str, WellFormedUpdate, f32); 5] = [
        ("trained", shape.well_formed(Ok(good.clone()), None), 0.0),
        ("failed", shape.well_formed(Err("raised".into()), None), 1.0),
        ("non-finite", shape.well_formed(Ok(nan), None), 1.0),
        (
            "not safetensors",
            shape.well_formed(Ok(b"x".to_vec()), None),
            1.0,
        ),
        (
            "evaluation failed",
            shape.well_formed(Ok(good.clone()), Some(Err("no rows".into()))),
            0.0,
        ),
    ];
    let length = cases[0].1.bytes().len();
    for (case, update, expected) in &cases[..4] {
        assert_eq!(flag(update), Some((vec![1], vec![*expected])), "{case}");
        assert_eq!(update.bytes().len(), length, "{case}");
    }
    assert_eq!(flag(&cases[4].1), Some((vec![1], vec![0.0])));
    // Without a health policy there is no flag at all.
    let plain = UpdateShape::of_model(&model()).unwrap();
    assert!(!plain.reports_health());
    assert_eq!(flag(&plain.well_formed(Err("raised".into()), None)), None);
}

#[test]
fn a_model_that_cannot_be_trained_from_is_refused_before_training() {
    assert!(matches!(
        UpdateShape::of_model(b"junk"),
        Err(ModelShapeError::NotSafetensors(_))
    ));
    for name in [EVALUATION_TENSOR, HEALTH_TENSOR, "confed.future"] {
        let reserved = encode(&[(name, vec![3], &[0.0; 3])]);
        assert_eq!(
            UpdateShape::of_model(&reserved),
            Err(ModelShapeError::ReservedName(name.into()))
        );
    }
    let data = [0u8; 8];
    let f64_model = safetensors::serialize(
        [("w", TensorView::new(Dtype::F64, vec![1], &data).unwrap())],
        None,
    )
    .unwrap();
    assert_eq!(
        UpdateShape::of_model(&f64_model),
        Err(ModelShapeError::NotF32("w".into()))
    );
}

#[test]
fn a_weighing_update_always_carries_its_example_count_capped_and_zero_with_zeros() {
    use confed_protocol::policy::{EXAMPLES_TENSOR, Weighting};
    let shape = UpdateShape::of_model(&model())
        .unwrap()
        .weighing(Some(Weighting { max_examples: 50 }));
    assert!(shape.weighs());
    let good = encode(&[("b", vec![2], &[0.1, 0.2]), ("w", vec![2, 2], &[1.; 4])]);
    let count = |update: &WellFormedUpdate| {
        values_of(update)
            .into_iter()
            .find(|(name, _, _)| name == EXAMPLES_TENSOR)
            .map(|(_, shape, v)| (shape, v))
    };
    let model_values = |update: &WellFormedUpdate| {
        values_of(update)
            .into_iter()
            .filter(|(name, _, _)| name != EXAMPLES_TENSOR)
            .collect::<Vec<_>>()
    };
    let cases: [(&str, WellFormedUpdate, f32, bool); 6] = [
        (
            "counted",
            shape.well_formed_weighed(Ok(good.clone()), None, Some(12.0)),
            12.0,
            false,
        ),
        (
            "above the cap",
            shape.well_formed_weighed(Ok(good.clone()), None, Some(1e9)),
            50.0,
            false,
        ),
        (
            "failed",
            shape.well_formed_weighed(Err("raised".into()), None, Some(12.0)),
            0.0,
            true,
        ),
        (
            "no count",
            shape.well_formed_weighed(Ok(good.clone()), None, None),
            0.0,
            true,
        ),
        (
            "negative",
            shape.well_formed_weighed(Ok(good.clone()), None, Some(-1.0)),
            0.0,
            true,
        ),
        (
            "NaN",
            shape.well_formed_weighed(Ok(good.clone()), None, Some(f64::NAN)),
            0.0,
            true,
        ),
    ];
    let length = cases[0].1.bytes().len();
    for (case, update, expected, zeroed) in &cases {
        assert_eq!(count(update), Some((vec![1], vec![*expected])), "{case}");
        assert_eq!(update.bytes().len(), length, "{case}");
        assert_eq!(
            model_values(update) == zeros_of_the_model(),
            *zeroed,
            "{case}"
        );
    }
    assert!(matches!(
        cases[3].1.problems(),
        [TrainingProblem::NoExampleCount(_)]
    ));
    assert!(cases[3].1.problems()[0].is_programming_error());
    // Without a weighting policy there is no count, whatever the training code gave.
    let plain = UpdateShape::of_model(&model()).unwrap();
    assert_eq!(
        count(&plain.well_formed_weighed(Ok(good), None, Some(3.0))),
        None
    );
}
