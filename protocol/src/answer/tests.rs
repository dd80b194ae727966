use super::*;

fn open(k: u32, width: u32) -> AnalyticsQuery {
    AnalyticsQuery::OpenHistogram {
        max_key_bytes: width,
        keys_per_device: k,
    }
}

fn sums() -> AnalyticsQuery {
    AnalyticsQuery::Histogram {
        domain_size: 100,
        keys_per_device: 4,
        max_value: 50,
    }
}

/// Rewrites one tensor's bytes in an answer (the header stays, so only that check can fail).
fn tampered(bytes: &[u8], tensor: &str, edit: impl Fn(&mut [u8])) -> Vec<u8> {
    let parsed = SafeTensors::deserialize(bytes).unwrap();
    let view = parsed.tensor(tensor).unwrap();
    let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
    let len = view.data().len();
    let mut out = bytes.to_vec();
    edit(&mut out[start..start + len]);
    out
}

#[test]
fn an_answers_size_depends_on_the_query_only() {
    let query = open(16, 32);
    let none = write(&query, &[], false).unwrap();
    let one = write(&query, &[(Key::Text(b"a"), 1)], false).unwrap();
    let full: Vec<Vec<u8>> = (0..16)
        .map(|i| format!("word-{i:02}").into_bytes())
        .collect();
    let slots: Vec<(Key<'_>, u64)> = full.iter().map(|w| (Key::Text(w), 1)).collect();
    let all = write(&query, &slots, false).unwrap();
    let failed = write(&query, &[], true).unwrap();
    assert!(none.len() == one.len() && one.len() == all.len() && all.len() == failed.len());
    let summed = write(&sums(), &[(Key::Index(3), 7)], false).unwrap();
    assert_eq!(summed.len(), write(&sums(), &[], false).unwrap().len());
}

#[test]
fn what_is_written_reads_back_slot_for_slot() {
    let query = open(4, 8);
    let bytes = write(
        &query,
        &[(Key::Text(b"cat"), 1), (Key::Text(b"dog"), 1)],
        false,
    )
    .unwrap();
    let answer = Answer::read(&query, &bytes).unwrap();
    let slots: Vec<_> = answer.slots().collect();
    assert_eq!(slots, vec![(Key::Text(b"cat"), 1), (Key::Text(b"dog"), 1)]);
    assert!(!answer.failed());

    let bytes = write(&sums(), &[(Key::Index(3), 50), (Key::Index(99), 0)], false).unwrap();
    let slots: Vec<_> = Answer::read(&sums(), &bytes).unwrap().slots().collect();
    assert_eq!(slots, vec![(Key::Index(3), 50), (Key::Index(99), 0)]);

    let failed = write(&sums(), &[], true).unwrap();
    let answer = Answer::read(&sums(), &failed).unwrap();
    assert!(answer.failed() && answer.slots().next().is_none());
}

#[test]
fn a_device_cannot_write_what_the_enclave_would_exclude() {
    let query = open(2, 4);
    for slots in [
        vec![(Key::Text(b"toolong".as_slice()), 1)],
        vec![(Key::Text(b"b"), 1), (Key::Text(b"a"), 1)],
        vec![(Key::Text(b"a"), 1), (Key::Text(b"a"), 1)],
        vec![(Key::Text(b""), 1)],
        vec![(Key::Text(b"a"), 2)],
        vec![(Key::Index(1), 1)],
        vec![
            (Key::Text(b"a"), 1),
            (Key::Text(b"b"), 1),
            (Key::Text(b"c"), 1),
        ],
    ] {
        assert!(write(&query, &slots, false).is_err(), "{slots:?}");
    }
    assert!(write(&sums(), &[(Key::Index(100), 1)], false).is_err());
    assert!(write(&sums(), &[(Key::Index(1), 51)], false).is_err());
    assert!(write(&sums(), &[(Key::Index(1), 1)], true).is_err());
}

#[test]
fn every_malformed_answer_is_refused_with_its_reason() {
    let query = open(2, 4);
    let good = write(&query, &[(Key::Text(b"ab"), 1)], false).unwrap();
    let read = |bytes: &[u8]| Answer::read(&query, bytes).err();
    assert_eq!(read(&good), None);
    let cases: Vec<(Vec<u8>, AnswerProblem)> = vec![
        (
            tampered(&good, PRESENT_TENSOR, |p| p[0] = 2),
            AnswerProblem::Presence(0),
        ),
        (
            tampered(&good, PRESENT_TENSOR, |p| p[1] = 1),
            AnswerProblem::BadText(1),
        ),
        (
            tampered(&good, KEYS_TENSOR, |k| k[5] = b'x'),
            AnswerProblem::Padding(1),
        ),
        (
            tampered(&good, KEYS_TENSOR, |k| k[3] = b'x'),
            AnswerProblem::BadText(0),
        ),
        (
            tampered(&good, KEYS_TENSOR, |k| k[0] = 0xff),
            AnswerProblem::BadText(0),
        ),
        (
            tampered(&good, VALUES_TENSOR, |v| v[0] = 2),
            AnswerProblem::Value(0, 1),
        ),
        (
            tampered(&good, VALUES_TENSOR, |v| v[15] = 0x80),
            AnswerProblem::Padding(1),
        ),
        (
            tampered(&good, HEALTH_TENSOR, |h| {
                h.copy_from_slice(&1f32.to_le_bytes())
            }),
            AnswerProblem::Health,
        ),
    ];
    for (bytes, problem) in cases {
        assert_eq!(read(&bytes), Some(problem));
    }
    // Repeated and out-of-order keys.
    let two = write(
        &query,
        &[(Key::Text(b"ab"), 1), (Key::Text(b"cd"), 1)],
        false,
    )
    .unwrap();
    let repeated = tampered(&two, KEYS_TENSOR, |k| k[4..6].copy_from_slice(b"ab"));
    assert_eq!(read(&repeated), Some(AnswerProblem::Repeated(1)));
    let reversed = tampered(&two, KEYS_TENSOR, |k| k.swap(0, 4));
    assert!(matches!(read(&reversed), Some(AnswerProblem::Order(1))));
    // Another query's answer: a shape mismatch.
    assert_eq!(
        Answer::read(&open(3, 4), &good).err(),
        Some(AnswerProblem::Shape(PRESENT_TENSOR))
    );
    assert!(matches!(
        Answer::read(&query, b"not safetensors"),
        Err(AnswerProblem::Format(_))
    ));
    // A negative value is outside [0, c] whatever its magnitude.
    let sums_answer = write(&sums(), &[(Key::Index(1), 1)], false).unwrap();
    let negative = tampered(&sums_answer, VALUES_TENSOR, |v| {
        v[..8].copy_from_slice(&(-1i64).to_le_bytes())
    });
    assert_eq!(
        Answer::read(&sums(), &negative).err(),
        Some(AnswerProblem::Value(0, 50))
    );
}

#[test]
fn quantile_values_map_to_leaves_and_may_share_one() {
    let query = AnalyticsQuery::Quantiles {
        min: 0.0,
        max: 100.0,
        ranks: vec![0.5],
        values_per_device: 3,
    };
    assert_eq!(quantile_leaf(0.0, 100.0, -5.0), Some(0));
    assert_eq!(quantile_leaf(0.0, 100.0, 100.0), Some(QUANTILE_LEAVES - 1));
    assert_eq!(quantile_leaf(0.0, 100.0, 50.0), Some(QUANTILE_LEAVES / 2));
    assert_eq!(quantile_leaf(0.0, 100.0, f64::NAN), None);
    let leaf = quantile_leaf(0.0, 100.0, 42.0).unwrap();
    let bytes = write(
        &query,
        &[(Key::Index(leaf), 1), (Key::Index(leaf), 1)],
        false,
    )
    .unwrap();
    assert_eq!(Answer::read(&query, &bytes).unwrap().slots().count(), 2);
    assert!(write(&query, &[(Key::Index(QUANTILE_LEAVES), 1)], false).is_err());
    // A value adds 1: a slot adding more (v² on one node) is refused.
    assert_eq!(
        write(&query, &[(Key::Index(leaf), 2)], false).err(),
        Some(AnswerProblem::Value(0, 1))
    );
}

#[test]
fn the_layout_reads_at_fixed_offsets_what_the_long_way_reads() {
    let query = open(4, 8);
    let layout = AnswerLayout::new(&query).unwrap();
    let good = write(
        &query,
        &[(Key::Text(b"cat"), 1), (Key::Text(b"dog"), 1)],
        false,
    )
    .unwrap();
    let fast: Vec<_> = layout.read(&good).unwrap().slots().collect();
    let slow: Vec<_> = Answer::read(&query, &good).unwrap().slots().collect();
    assert_eq!(fast, slow);
    // The same checks on the fast path: a value rewritten past the bound.
    let bad = tampered(&good, VALUES_TENSOR, |v| v[0] = 9);
    assert_eq!(layout.read(&bad).err(), Some(AnswerProblem::Value(0, 1)));
    // Another header (another query's answer, or not safetensors) takes the long way.
    let other = write(&open(3, 8), &[(Key::Text(b"cat"), 1)], false).unwrap();
    assert_eq!(
        layout.read(&other).err(),
        Some(AnswerProblem::Shape(PRESENT_TENSOR))
    );
    assert!(matches!(
        layout.read(b"short"),
        Err(AnswerProblem::Format(_))
    ));
}
