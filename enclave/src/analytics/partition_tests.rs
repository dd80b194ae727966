//! Partitioned analytics rounds: every query releases the one-worker bytes whatever the plan, a
//! sealed open-domain partition's length does not depend on the keys devices sent, and a
//! partition of another query fails the merge.

use confed_protocol::answer::{self, Key};

use super::tests::{Round, binding, params, result, round, sealed};
use super::*;
use crate::aggregate::inputs::{Input, committed};
use crate::aggregate::partition::{Partial, Partition, PartitionError};

type Pairs = Vec<(String, Option<Vec<u8>>)>;

fn aggregator(r: &Round, query: &AnalyticsQuery, digest: &str) -> AnalyticsAggregator {
    AnalyticsAggregator::new(binding(digest), query.clone(), &r.private).unwrap()
}

fn add(aggregator: &AnalyticsAggregator, inputs: &[Input]) {
    for input in inputs {
        let _ = aggregator.add(&input.assignment_ref, input.retained.as_deref());
    }
}

/// Partition `index` of `count`, added and sealed by its own aggregator (its own worker).
fn seal(
    r: &Round,
    query: &AnalyticsQuery,
    (inputs, digest): &(Vec<Input>, String),
    index: u32,
    count: u32,
) -> Vec<u8> {
    let partition = Partition {
        inputs,
        index,
        count,
    };
    let worker = aggregator(r, query, digest);
    add(&worker, partition.inputs().unwrap());
    worker.seal_partition(&r.private, &partition).unwrap()
}

/// 120 devices answering `query` from their index (some keys shared, some their own, some
/// failed), one missing contribution and one that is not an envelope.
fn contributions(r: &Round, query: &AnalyticsQuery) -> Pairs {
    let mut pairs: Pairs = (0..120)
        .map(|d| {
            let words = [format!("w{}", d % 7), format!("own-{d}"), "all".to_string()];
            let slots: Vec<(Key<'_>, u64)> = match query {
                AnalyticsQuery::Histogram { .. } => {
                    let mut keys: Vec<u64> =
                        (0..3).map(|j| ((d * 5 + j * 11) % 300) as u64).collect();
                    keys.sort();
                    keys.iter()
                        .map(|k| (Key::Index(*k), 1 + (d % 4) as u64))
                        .collect()
                }
                AnalyticsQuery::Quantiles { min, max, .. } => {
                    let value = min + (max - min) * (d as f64 / 120.0);
                    vec![(
                        Key::Index(answer::quantile_leaf(*min, *max, value).unwrap()),
                        1,
                    )]
                }
                AnalyticsQuery::OpenHistogram { .. } => {
                    let mut slots: Vec<(Key<'_>, u64)> =
                        words.iter().map(|w| (Key::Text(w.as_bytes()), 1)).collect();
                    slots.sort_by(|a, b| match (a.0, b.0) {
                        (Key::Text(a), Key::Text(b)) => a.cmp(b),
                        _ => std::cmp::Ordering::Equal,
                    });
                    slots
                }
            };
            let failed = d % 13 == 0;
            let bytes = answer::write(query, if failed { &[] } else { &slots }, failed).unwrap();
            sealed(r, d, &bytes)
        })
        .collect();
    pairs.push((crate::envelope::assignment_ref("missing"), None));
    pairs.push(sealed(r, 999, b"not an answer"));
    pairs
}

fn queries() -> [AnalyticsQuery; 3] {
    [
        AnalyticsQuery::Histogram {
            domain_size: 300,
            keys_per_device: 3,
            max_value: 4,
        },
        AnalyticsQuery::Quantiles {
            min: 0.0,
            max: 600.0,
            ranks: vec![0.5, 0.9],
            values_per_device: 1,
        },
        AnalyticsQuery::OpenHistogram {
            max_key_bytes: 12,
            keys_per_device: 3,
        },
    ]
}

#[test]
fn every_query_in_1_2_3_or_4_partitions_releases_the_one_worker_bytes() {
    let r = round();
    for query in queries() {
        let kind = query.kind();
        let params = params(query.clone(), 8.0);
        let round_inputs = committed(&contributions(&r, &query));
        let whole = aggregator(&r, &query, &round_inputs.1);
        add(&whole, &round_inputs.0);
        let expected = whole.finish(&r.private, &params).unwrap();
        // Failed answers are included (they add nothing); the missing one and the one that is
        // not an answer are not.
        assert_eq!(expected.manifest.included, 120, "{kind}");
        assert_eq!(
            expected.manifest.excluded.values().sum::<u64>(),
            2,
            "{kind}"
        );
        if let AnalyticsQuery::OpenHistogram { .. } = query {
            // The shared words are released, every device's own is not.
            let keys = result(&expected)["keys"].to_string();
            assert!(keys.contains("\"all\"") && !keys.contains("own-"), "{keys}");
        }
        for count in 1..=4 {
            // Sealed in reverse order: the merge does not depend on the order either.
            let parts: Vec<Vec<u8>> = (0..count)
                .rev()
                .map(|index| seal(&r, &query, &round_inputs, index, count))
                .collect();
            let root = aggregator(&r, &query, &round_inputs.1);
            root.merge(&r.private, &round_inputs.0, count, &parts)
                .unwrap();
            let release = root.finish(&r.private, &params).unwrap();
            assert_eq!(
                release.result, expected.result,
                "{kind}, {count} partitions"
            );
            assert_eq!(
                release.manifest.to_json(),
                expected.manifest.to_json(),
                "{kind}, {count} partitions"
            );
        }
    }
}

#[test]
fn a_sealed_partition_has_one_length_whatever_keys_the_devices_sent() {
    let r = round();
    for query in queries() {
        // The same 60 devices: all holding the same keys, all their own, or all failed.
        let answers = |choose: &dyn Fn(usize) -> Vec<String>, failed: bool| -> Pairs {
            (0..60)
                .map(|d| {
                    let keys = choose(d);
                    let mut slots: Vec<(Key<'_>, u64)> = match &query {
                        AnalyticsQuery::OpenHistogram { .. } => {
                            keys.iter().map(|k| (Key::Text(k.as_bytes()), 1)).collect()
                        }
                        _ => keys
                            .iter()
                            .map(|k| (Key::Index(k.parse().unwrap()), 1))
                            .collect(),
                    };
                    if let AnalyticsQuery::Quantiles { .. } = query {
                        slots.truncate(1);
                    }
                    slots.sort_by_key(|(key, _)| match key {
                        Key::Text(text) => text.to_vec(),
                        Key::Index(i) => i.to_be_bytes().to_vec(),
                    });
                    let slots = if failed { &[][..] } else { &slots[..] };
                    sealed(&r, d, &answer::write(&query, slots, failed).unwrap())
                })
                .collect()
        };
        let same = answers(&|_| vec!["1".into(), "2".into(), "3".into()], false);
        let own = answers(
            &|d| (0..3).map(|j| (100 + d * 3 + j).to_string()).collect(),
            false,
        );
        let failed = answers(&|_| Vec::new(), true);
        let lengths: Vec<usize> = [same, own, failed]
            .iter()
            .map(|pairs| seal(&r, &query, &committed(pairs), 0, 1).len())
            .collect();
        assert_eq!(lengths[0], lengths[1], "{}", query.kind());
        assert_eq!(lengths[0], lengths[2], "{}", query.kind());
    }
}

#[test]
fn a_partition_of_another_query_fails_the_merge() {
    let r = round();
    let query = AnalyticsQuery::OpenHistogram {
        max_key_bytes: 12,
        keys_per_device: 3,
    };
    let other = AnalyticsQuery::OpenHistogram {
        max_key_bytes: 16,
        keys_per_device: 3,
    };
    let round_inputs = committed(&contributions(&r, &query));
    let parts: Vec<Vec<u8>> = (0..2)
        .map(|index| seal(&r, &query, &round_inputs, index, 2))
        .collect();
    let root = aggregator(&r, &other, &round_inputs.1);
    match root.merge(&r.private, &round_inputs.0, 2, &parts) {
        Err(PartitionError::Foreign(why)) => assert!(why.contains("table"), "{why}"),
        other => panic!("{:?}", other.err()),
    }
    // The same partitions merge into a root of their own query.
    let root = aggregator(&r, &query, &round_inputs.1);
    root.merge(&r.private, &round_inputs.0, 2, &parts).unwrap();
}
