//! Analytics rounds in the enclave: exact sums, noise at the planned scale, threshold selection,
//! quantiles, exclusions that never break the round, and reproducible releases.

use confed_protocol::answer::{self, Key};
use confed_protocol::policy::TaskPolicy;

use super::release::quantile;
use super::*;
use crate::envelope::{self, RoundContext};
use crate::hpke::generate_keypair;

const KEY: &str = "key-1";

pub(super) struct Round {
    pub(super) private: PrivateKey,
    pub(super) public: crate::hpke::PublicKey,
}

pub(super) fn context() -> RoundContext {
    RoundContext {
        task_id: "task-1".into(),
        round: 1,
        policy_sha256: "a".repeat(64),
        model_sha256: "b".repeat(64),
    }
}

pub(super) fn binding(inputs_digest: &str) -> Binding {
    Binding {
        context: context(),
        key_id: KEY.into(),
        inputs_digest: inputs_digest.into(),
    }
}

pub(super) fn sealed(r: &Round, device: usize, plaintext: &[u8]) -> (String, Option<Vec<u8>>) {
    let assignment = format!("assignment-{device}");
    let env = envelope::seal(
        &r.public,
        KEY,
        &context(),
        &assignment.as_str().into(),
        plaintext,
    )
    .unwrap();
    (envelope::assignment_ref(&assignment), Some(env.to_cbor()))
}

pub(super) fn params(query: AnalyticsQuery, epsilon: f64) -> AnalyticsParams {
    let mut policy = TaskPolicy::sample("task-1", 1);
    policy.epsilon = epsilon;
    policy.analytics = Some(query);
    AnalyticsParams::for_policy(&policy).unwrap().unwrap()
}

fn release(
    r: &Round,
    query: &AnalyticsQuery,
    params: &AnalyticsParams,
    inputs: &[(String, Option<Vec<u8>>)],
    digest: &str,
) -> AnalyticsRelease {
    let agg = AnalyticsAggregator::new(binding(digest), query.clone(), &r.private).unwrap();
    agg.add_batch(inputs);
    agg.finish(&r.private, params).unwrap()
}

pub(super) fn round() -> Round {
    let (private, public) = generate_keypair();
    Round { private, public }
}

pub(super) fn result(release: &AnalyticsRelease) -> serde_json::Value {
    serde_json::from_slice(&release.result).unwrap()
}

#[test]
fn a_closed_histogram_is_released_with_noise_of_the_planned_spread() {
    let r = round();
    let query = AnalyticsQuery::Histogram {
        domain_size: 2000,
        keys_per_device: 4,
        max_value: 1,
    };
    let params = params(query.clone(), 2.0);
    // 500 devices; device d holds keys d % 2000 .. +4: every key's true count is 1 or 0.
    let mut truth = vec![0i64; 2000];
    let inputs: Vec<_> = (0..500)
        .map(|d| {
            let keys: Vec<u64> = (0..4).map(|j| ((d * 4 + j) % 2000) as u64).collect();
            for k in &keys {
                truth[*k as usize] += 1;
            }
            let slots: Vec<(Key<'_>, u64)> = keys.iter().map(|k| (Key::Index(*k), 1)).collect();
            sealed(&r, d, &answer::write(&query, &slots, false).unwrap())
        })
        .collect();
    let released = release(&r, &query, &params, &inputs, &"e".repeat(64));
    let values: Vec<i64> = serde_json::from_value(result(&released)["histogram"].clone()).unwrap();
    assert_eq!(values.len(), 2000);
    // The standardized error over 2000 keys: mean near 0, spread near 1.
    let stddev = params.plan.stddev();
    let z: Vec<f64> = values
        .iter()
        .zip(&truth)
        .map(|(v, t)| (v - t) as f64 / stddev)
        .collect();
    let mean = z.iter().sum::<f64>() / z.len() as f64;
    let spread = (z.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / z.len() as f64).sqrt();
    assert!(mean.abs() < 0.1, "mean {mean}");
    assert!((spread - 1.0).abs() < 0.06, "spread {spread}");
    let manifest = &released.manifest;
    assert_eq!(manifest.included, 500);
    let record = manifest.analytics.as_ref().unwrap();
    assert_eq!(record.noise_variance, params.plan.variance);
    assert!(record.threshold.is_none());
    assert!(manifest.privacy.epsilon_spent <= 2.0);
}

#[test]
fn the_same_inputs_release_the_same_bytes_and_other_inputs_other_noise() {
    let r = round();
    let query = AnalyticsQuery::Histogram {
        domain_size: 50,
        keys_per_device: 1,
        max_value: 1,
    };
    let params = params(query.clone(), 1.0);
    let inputs: Vec<_> = (0..20)
        .map(|d| {
            let bytes = answer::write(&query, &[(Key::Index(d as u64), 1)], false).unwrap();
            sealed(&r, d, &bytes)
        })
        .collect();
    let first = release(&r, &query, &params, &inputs, &"e".repeat(64));
    let again = release(&r, &query, &params, &inputs, &"e".repeat(64));
    assert_eq!(first.result, again.result);
    assert_eq!(first.manifest, again.manifest);
    let other = release(&r, &query, &params, &inputs, &"f".repeat(64));
    assert_ne!(first.result, other.result);
}

#[test]
fn an_open_domain_releases_the_keys_many_devices_hold_and_not_one_devices() {
    let r = round();
    let query = AnalyticsQuery::OpenHistogram {
        max_key_bytes: 16,
        keys_per_device: 2,
    };
    let params = params(query.clone(), 4.0);
    let tau = params.plan.threshold.unwrap().tau;
    assert!(tau < 150, "{tau}");
    // 400 devices: every one holds "common", half hold "half", and each holds its own word.
    let inputs: Vec<_> = (0..400)
        .map(|d| {
            let own = format!("own-{d:03}");
            let second = if d % 2 == 0 { "half" } else { own.as_str() };
            let mut words = ["common", second];
            words.sort();
            let slots: Vec<(Key<'_>, u64)> =
                words.iter().map(|w| (Key::Text(w.as_bytes()), 1)).collect();
            sealed(&r, d, &answer::write(&query, &slots, false).unwrap())
        })
        .collect();
    let released = release(&r, &query, &params, &inputs, &"e".repeat(64));
    let keys: Vec<(String, i64)> =
        serde_json::from_value(result(&released)["keys"].clone()).unwrap();
    let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, vec!["common", "half"]);
    let record = released.manifest.analytics.as_ref().unwrap();
    assert_eq!(record.threshold, Some(tau));
    assert_eq!(record.released_keys, Some(2));
    // 202 distinct keys, noised with 512 x 2.
    let distinct = record.distinct_keys.unwrap();
    assert!((distinct - 202).abs() < 6 * 1024, "{distinct}");
}

#[test]
fn a_malformed_or_invalid_answer_is_excluded_and_the_round_still_releases() {
    let r = round();
    let query = AnalyticsQuery::Histogram {
        domain_size: 10,
        keys_per_device: 2,
        max_value: 1,
    };
    let params = params(query.clone(), 1.0);
    let good = answer::write(&query, &[(Key::Index(3), 1)], false).unwrap();
    let other_query = AnalyticsQuery::Histogram {
        domain_size: 10,
        keys_per_device: 3,
        max_value: 1,
    };
    let wrong_shape = answer::write(&other_query, &[(Key::Index(3), 1)], false).unwrap();
    // A value of 2 under counts: an answer of the same shape written for sums.
    let sums = AnalyticsQuery::Histogram {
        domain_size: 10,
        keys_per_device: 2,
        max_value: 5,
    };
    let too_much = answer::write(&sums, &[(Key::Index(3), 2)], false).unwrap();
    let inputs = vec![
        sealed(&r, 0, &good),
        sealed(&r, 1, &wrong_shape),
        sealed(&r, 2, &too_much),
        sealed(&r, 3, b"not safetensors"),
        ("missing".to_string(), None),
    ];
    let released = release(&r, &query, &params, &inputs, &"e".repeat(64));
    let excluded = &released.manifest.excluded;
    assert_eq!(released.manifest.included, 1);
    assert_eq!(excluded.get("wrong_tensors"), Some(&1), "{excluded:?}");
    assert_eq!(excluded.get("invalid_answer"), Some(&1), "{excluded:?}");
    assert_eq!(excluded.get("not_safetensors"), Some(&1));
    assert_eq!(excluded.get("missing"), Some(&1));
}

#[test]
fn quantiles_of_uniform_values_land_near_their_ranks() {
    let r = round();
    let query = AnalyticsQuery::Quantiles {
        min: 0.0,
        max: 100.0,
        ranks: vec![0.1, 0.5, 0.9],
        values_per_device: 1,
    };
    let params = params(query.clone(), 8.0);
    let inputs: Vec<_> = (0..2000)
        .map(|d| {
            let value = (d as f64 + 0.5) / 20.0;
            let leaf = answer::quantile_leaf(0.0, 100.0, value).unwrap();
            let bytes = answer::write(&query, &[(Key::Index(leaf), 1)], false).unwrap();
            sealed(&r, d, &bytes)
        })
        .collect();
    let released = release(&r, &query, &params, &inputs, &"e".repeat(64));
    let quantiles = result(&released)["quantiles"].clone();
    for (i, expected) in [10.0, 50.0, 90.0].iter().enumerate() {
        let value = quantiles[i]["value"].as_f64().unwrap();
        assert!((value - expected).abs() < 3.0, "rank {i}: {value}");
    }
    let tree = result(&released)["tree"].clone();
    assert_eq!(tree[3].as_array().unwrap().len(), 65536);
}

#[test]
fn the_quantile_readout_descends_to_the_rank_and_interpolates() {
    // Two levels of 16: all the mass in the root's child 2, spread evenly over its children.
    let mut top = vec![0i64; 16];
    top[2] = 160;
    let mut second = vec![0i64; 256];
    for c in 0..16 {
        second[2 * 16 + c] = 10;
    }
    // A noised negative sibling counts as 0.
    top[0] = -5;
    let levels = vec![top, second];
    // Child 2 covers [2/16, 3/16) of [0, 256] = [32, 48); its children are 1 wide.
    assert!((quantile(&levels, 0.0, 256.0, 0.5) - 40.0).abs() < 1e-9);
    assert!((quantile(&levels, 0.0, 256.0, 0.0) - 32.0).abs() < 1e-9);
    // Nothing anywhere: uniform over the range.
    let empty = vec![vec![0i64; 16], vec![0i64; 256]];
    assert!((quantile(&empty, 0.0, 256.0, 0.25) - 64.0).abs() < 1e-9);
}
