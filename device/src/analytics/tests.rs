use std::collections::HashMap;
use std::path::PathBuf;

use confed_protocol::answer::Answer;

use super::*;

/// A small deterministic generator (xorshift64*) standing in for the OS's randomness.
fn generator(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed.max(1);
    move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn slots(query: &AnalyticsQuery, bytes: &[u8]) -> Vec<(String, u64)> {
    Answer::read(query, bytes)
        .unwrap()
        .slots()
        .map(|(key, value)| {
            let key = match key {
                Key::Index(i) => i.to_string(),
                Key::Text(t) => String::from_utf8(t.to_vec()).unwrap(),
            };
            (key, value)
        })
        .collect()
}

fn open(k: u32, width: u32) -> AnalyticsQuery {
    AnalyticsQuery::OpenHistogram {
        max_key_bytes: width,
        keys_per_device: k,
    }
}

#[test]
fn a_device_counts_each_distinct_word_once_cut_to_the_bound() {
    let query = open(8, 3);
    let records = Records::Strings(
        ["hél", "cat", "cat", "catalog", "", "a\0b", "zz"]
            .map(String::from)
            .to_vec(),
    );
    let bytes = answer_with(&query, &records, &mut generator(1)).unwrap();
    // "hél" (4 bytes) is cut to "hé" (3); "catalog" becomes "cat", counted once.
    assert_eq!(
        slots(&query, &bytes),
        vec![("cat".into(), 1), ("hé".into(), 1), ("zz".into(), 1)]
    );
    // A cut never splits a character: "é" starts at byte 1 and does not fit in 2.
    assert_eq!(cut("hél", 2), "h");
}

#[test]
fn sums_add_a_keys_records_and_stop_at_the_cap() {
    let query = AnalyticsQuery::Histogram {
        domain_size: 10,
        keys_per_device: 4,
        max_value: 100,
    };
    let records = Records::Keyed(vec![(3, 60), (3, 70), (1, 5), (12, 9)]);
    let bytes = answer_with(&query, &records, &mut generator(1)).unwrap();
    // Key 12 is outside the domain; key 3's 130 is capped at 100.
    assert_eq!(
        slots(&query, &bytes),
        vec![("1".into(), 5), ("3".into(), 100)]
    );
}

#[test]
fn a_device_with_more_keys_than_the_bound_sends_a_uniform_choice() {
    let query = AnalyticsQuery::Histogram {
        domain_size: 10,
        keys_per_device: 1,
        max_value: 1,
    };
    let records = Records::Keyed(vec![(0, 1), (1, 1), (2, 1), (2, 1)]);
    let mut random = generator(7);
    let mut chosen: HashMap<String, u32> = HashMap::new();
    let draws = 30_000;
    for _ in 0..draws {
        let bytes = answer_with(&query, &records, &mut random).unwrap();
        let slots = slots(&query, &bytes);
        assert_eq!(slots.len(), 1);
        *chosen.entry(slots[0].0.clone()).or_default() += 1;
    }
    // Key 2's two records do not make it likelier: each of 3 keys about a third of the time
    // (5 standard deviations: 0.0136).
    for key in ["0", "1", "2"] {
        let share = f64::from(chosen[key]) / f64::from(draws);
        assert!((share - 1.0 / 3.0).abs() < 0.0136, "{key}: {share}");
    }
}

#[test]
fn quantile_records_become_leaves_and_nan_is_ignored() {
    let query = AnalyticsQuery::Quantiles {
        min: 0.0,
        max: 10.0,
        ranks: vec![0.5],
        values_per_device: 2,
    };
    let records = Records::Values(vec![f64::NAN, 5.0]);
    let bytes = answer_with(&query, &records, &mut generator(1)).unwrap();
    assert_eq!(slots(&query, &bytes), vec![("32768".into(), 1)]);
    // More values than `values_per_device`: a choice of that many (not of 4 per value).
    let many = Records::Values((0..10).map(f64::from).collect());
    let bytes = answer_with(&query, &many, &mut generator(2)).unwrap();
    assert_eq!(slots(&query, &bytes).len(), 2);
    let wrong = answer_with(&query, &Records::Keyed(vec![]), &mut generator(1));
    assert!(matches!(wrong, Err(AnalyticsError::WrongRecords { .. })));
}

#[test]
fn a_failed_computation_sends_the_same_size_with_its_flag() {
    let query = open(16, 32);
    let failed = failed_answer(&query).unwrap();
    let full = answer(&query, &Records::Strings(vec!["a".into()])).unwrap();
    assert_eq!(failed.len(), full.len());
    assert!(Answer::read(&query, &failed).unwrap().failed());
}

/// The answers of `tests/vectors/analytics_answers.json`: the Python package must write the same
/// bytes for the same records (clients/python/tests/test_analytics.py).
#[test]
fn the_cross_language_vectors_are_what_this_library_writes() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/analytics_answers.json");
    let cases = [
        (
            open(4, 8),
            Records::Strings(["cat", "dog", "cat", "日本語"].map(String::from).to_vec()),
        ),
        (
            AnalyticsQuery::Histogram {
                domain_size: 1000,
                keys_per_device: 3,
                max_value: 20,
            },
            Records::Keyed(vec![(7, 5), (999, 30), (7, 1)]),
        ),
        (
            AnalyticsQuery::Quantiles {
                min: -1.0,
                max: 1.0,
                ranks: vec![0.5, 0.9],
                values_per_device: 2,
            },
            Records::Values(vec![0.25, -0.75]),
        ),
    ];
    let vectors: Vec<serde_json::Value> = cases
        .iter()
        .map(|(query, records)| {
            let bytes = answer_with(query, records, &mut generator(1)).unwrap();
            let records = match records {
                Records::Keyed(r) => serde_json::json!(r),
                Records::Strings(r) => serde_json::json!(r),
                Records::Values(r) => serde_json::json!(r),
            };
            serde_json::json!({
                "query": query,
                "records": records,
                "answer_hex": confed_protocol::hex::encode(&bytes),
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&vectors).unwrap() + "\n";
    if std::env::var_os("CONFED_UPDATE_VECTORS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let stored = std::fs::read_to_string(&path)
        .expect("tests/vectors/analytics_answers.json (CONFED_UPDATE_VECTORS=1 writes it)");
    assert_eq!(
        stored, text,
        "the answers changed: the Python package must change with them"
    );
}
