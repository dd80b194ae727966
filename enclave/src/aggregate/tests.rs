//! Aggregation tests: every exclusion reason, exact clipping, the noise's spread against the
//! recorded scale, and reproducible releases.

use super::*;
use crate::dp::grid;
use crate::envelope;
use crate::hpke::generate_keypair;
use confed_worker_api::model::{encode_f32_tensors, validate_model};

pub(crate) const TASK: &str = "task-1";
pub(crate) const ROUND: u64 = 2;
pub(crate) const KEY: &str = "key-1";

pub(crate) struct Round {
    pub(crate) private: PrivateKey,
    pub(crate) public: crate::hpke::PublicKey,
    pub(crate) schema: ModelSchema,
}

pub(crate) fn round(len: usize) -> Round {
    let (private, public) = generate_keypair();
    let model = encode_f32_tensors(&[
        ("b", vec![2], &[0.0, 0.0]),
        ("w", vec![len - 2], &vec![0.0; len - 2]),
    ])
    .unwrap();
    Round {
        private,
        public,
        schema: validate_model(&model).unwrap(),
    }
}

pub(crate) fn context(round: u64) -> envelope::RoundContext {
    envelope::RoundContext {
        task_id: TASK.into(),
        round,
        policy_sha256: "a".repeat(64),
        model_sha256: "b".repeat(64),
    }
}

pub(crate) fn binding() -> Binding {
    Binding {
        context: context(ROUND),
        key_id: KEY.into(),
        inputs_digest: "e".repeat(64),
    }
}

pub(crate) fn update(values: &[f32]) -> Vec<u8> {
    encode_f32_tensors(&[
        ("b", vec![2], &values[..2]),
        ("w", vec![values.len() - 2], &values[2..]),
    ])
    .unwrap()
}

/// Seals `plaintext` as the device holding `assignment_id` would; returns (ref, stored bytes).
pub(crate) fn sealed(
    r: &Round,
    assignment_id: &str,
    round: u64,
    plaintext: &[u8],
) -> (String, Vec<u8>) {
    let env = envelope::seal(
        &r.public,
        KEY,
        &context(round),
        &assignment_id.into(),
        plaintext,
    )
    .unwrap();
    (envelope::assignment_ref(assignment_id), env.to_cbor())
}

/// Test data only (splitmix64 + Box-Muller): never for privacy noise.
pub(crate) struct Normal(u64);

impl Normal {
    pub(crate) fn seeded(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(crate) fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform().max(1e-300), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

pub(crate) fn privacy() -> PrivacyParams {
    PrivacyParams {
        epsilon: 4.0,
        delta: 1e-6,
        clip_norm: 1.0,
        rounds: 3,
        min_reports: 1,
        mechanism: crate::policy::Mechanism::Gaussian,
        adaptive: None,
        evaluation: None,
        on_demand: false,
        health: None,
        weighting: None,
    }
}

fn exclusion_of(r: &Round, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    agg.add(assignment_ref, stored)
}

#[test]
fn a_valid_contribution_is_included() {
    let r = round(4);
    let (id, bytes) = sealed(&r, "a1", ROUND, &update(&[0.1, 0.2, 0.3, 0.4]));
    assert_eq!(exclusion_of(&r, &id, Some(&bytes)), Ok(()));
}

#[test]
fn exclusion_wrong_shape() {
    let r = round(4);
    let (id, bytes) = sealed(&r, "a1", ROUND, &update(&[0.1, 0.2, 0.3, 0.4, 0.5]));
    assert_eq!(
        exclusion_of(&r, &id, Some(&bytes)),
        Err(Exclusion::WrongTensors)
    );
    let renamed =
        encode_f32_tensors(&[("b", vec![2], &[0.0, 0.0]), ("x", vec![2], &[0.0, 0.0])]).unwrap();
    let (id, bytes) = sealed(&r, "a2", ROUND, &renamed);
    assert_eq!(
        exclusion_of(&r, &id, Some(&bytes)),
        Err(Exclusion::WrongTensors)
    );
}

/// A NaN or an infinity is what a chosen model makes a device's training produce on a chosen
/// condition of its data: the update is included as a zero update (it adds nothing and counts in
/// the denominator), so nothing exact in the release tells that it happened.
#[test]
fn a_non_finite_update_is_included_as_a_zero_update() {
    let r = round(4);
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
        let (id, bytes) = sealed(&r, "a1", ROUND, &update(&[0.1, bad, 0.3, 0.4]));
        assert_eq!(agg.add(&id, Some(&bytes)), Ok(()), "{bad}");
        assert_eq!(agg.counts(), (1, 0), "{bad}");
        assert_eq!(agg.unclipped.load(Ordering::Relaxed), 1, "{bad}");
        assert!(agg.sum.into_sum().iter().all(|&v| v == 0), "{bad}");
    }
}

#[test]
fn exclusion_wrong_dtype() {
    use safetensors::{Dtype, tensor::TensorView};
    let r = round(4);
    let data = [0u8; 16];
    let views = vec![
        (
            "b".to_string(),
            TensorView::new(Dtype::F64, vec![2], &data).unwrap(),
        ),
        (
            "w".to_string(),
            TensorView::new(Dtype::F32, vec![2], &data[..8]).unwrap(),
        ),
    ];
    let plaintext = safetensors::serialize(views, None).unwrap();
    let (id, bytes) = sealed(&r, "a1", ROUND, &plaintext);
    assert_eq!(
        exclusion_of(&r, &id, Some(&bytes)),
        Err(Exclusion::WrongDtype)
    );
}

#[test]
fn exclusion_wrong_associated_data_from_another_round_or_assignment() {
    let r = round(4);
    let plaintext = update(&[0.1, 0.2, 0.3, 0.4]);
    // Sealed for round 1, replayed into round 2.
    let (id, bytes) = sealed(&r, "a1", ROUND - 1, &plaintext);
    assert_eq!(
        exclusion_of(&r, &id, Some(&bytes)),
        Err(Exclusion::DecryptionFailed)
    );
    // Sealed for assignment a1, stored under a2.
    let (_, bytes) = sealed(&r, "a1", ROUND, &plaintext);
    let other = envelope::assignment_ref("a2");
    assert_eq!(
        exclusion_of(&r, &other, Some(&bytes)),
        Err(Exclusion::DecryptionFailed)
    );
}

#[test]
fn exclusion_undecryptable_bytes_and_malformed_envelopes() {
    let r = round(4);
    let (id, bytes) = sealed(&r, "a1", ROUND, &update(&[0.1, 0.2, 0.3, 0.4]));
    let mut env = envelope::Envelope::from_cbor(&bytes).unwrap();
    let last = env.ciphertext.len() - 1;
    env.ciphertext[last] ^= 1;
    assert_eq!(
        exclusion_of(&r, &id, Some(&env.to_cbor())),
        Err(Exclusion::DecryptionFailed)
    );
    assert_eq!(
        exclusion_of(&r, &id, Some(b"not cbor")),
        Err(Exclusion::MalformedEnvelope)
    );
    assert_eq!(exclusion_of(&r, &id, None), Err(Exclusion::Missing));
    let wrong_key = envelope::seal(
        &r.public,
        "key-2",
        &context(ROUND),
        &"a1".into(),
        &update(&[0.0; 4]),
    )
    .unwrap();
    assert_eq!(
        exclusion_of(&r, &id, Some(&wrong_key.to_cbor())),
        Err(Exclusion::WrongKey)
    );
    let not_tensors = sealed(&r, "a1", ROUND, b"plain bytes").1;
    assert_eq!(
        exclusion_of(&r, &id, Some(&not_tensors)),
        Err(Exclusion::NotSafetensors)
    );
}

#[test]
fn exclusions_are_counted_in_the_manifest_and_never_poison_the_sum() {
    let r = round(4);
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    let good = sealed(&r, "a1", ROUND, &update(&[0.1, 0.0, 0.0, 0.0]));
    let nan = sealed(&r, "a2", ROUND, &update(&[f32::NAN, 0.0, 0.0, 0.0]));
    agg.add_batch(&[
        (good.0.clone(), Some(good.1)),
        (nan.0.clone(), Some(nan.1)),
        ("missing".into(), None),
    ]);
    let release = agg.finish(&r.private, privacy()).unwrap();
    let m = &release.manifest;
    assert_eq!(m.included, 2, "the NaN update is in, as zeros");
    assert_eq!(m.excluded.get("non_finite"), None);
    assert_eq!(m.excluded.get("missing"), Some(&1));
    assert_eq!(
        m.excluded_refs,
        vec![("missing".to_string(), "missing".to_string())]
    );
    let mut refs = [good.0.as_str(), nan.0.as_str()];
    refs.sort();
    assert_eq!(m.included_digest, digest(&refs));
    assert_eq!(m.inputs_digest, binding().inputs_digest);
    assert!(release.values.iter().all(|v| v.is_finite()));
}

#[test]
fn a_round_with_nothing_valid_releases_nothing() {
    let r = round(4);
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    agg.add_batch(&[("x".into(), None)]);
    assert!(matches!(
        agg.finish(&r.private, privacy()),
        Err(AggregateError::NothingIncluded(1))
    ));
}

#[test]
fn a_round_with_fewer_valid_contributions_than_min_reports_releases_nothing() {
    let r = round(4);
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    let good = sealed(&r, "a1", ROUND, &update(&[0.1, 0.0, 0.0, 0.0]));
    agg.add_batch(&[(good.0, Some(good.1)), ("x".into(), None)]);
    let params = PrivacyParams {
        min_reports: 2,
        ..privacy()
    };
    assert!(matches!(
        agg.finish(&r.private, params),
        Err(AggregateError::TooFewIncluded {
            included: 1,
            excluded: 1,
            min_reports: 2
        })
    ));
}

/// The release of `inputs`, with their digest in the binding as the worker computes it.
fn release_of(r: &Round, binding: Binding, inputs: &[(String, Option<Vec<u8>>)]) -> Release {
    let binding = Binding {
        inputs_digest: inputs::digest_of(inputs),
        ..binding
    };
    let agg = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private).unwrap();
    agg.add_batch(inputs);
    agg.finish(&r.private, privacy()).unwrap()
}

/// There is no attempt number any more: whatever the store says, the same inputs give the same
/// bytes, so re-running a round (after a crash, or by an operator hoping for fresh noise) yields
/// nothing new.
#[test]
fn the_same_inputs_release_the_same_bytes_whatever_the_attempt() {
    let r = round(64);
    let inputs: Vec<_> = (0..5)
        .map(|i| {
            sealed(
                &r,
                &format!("a{i}"),
                ROUND,
                &update(&vec![0.01 * i as f32; 64]),
            )
        })
        .map(|(id, bytes)| (id, Some(bytes)))
        .collect();
    let first = release_of(&r, binding(), &inputs);
    let again = release_of(&r, binding(), &inputs);
    assert_eq!(first.average, again.average);
    assert_eq!(first.manifest, again.manifest);
}

/// The attack of issue 12: replace one stored envelope by another sealed (by anyone, with the
/// public key) for the same assignment ref and the same plaintext. The refs are unchanged, but
/// the inputs digest covers the stored bytes, so the noise is fresh and independent: the two
/// releases do not subtract to anything. Measured: the correlation of the two noise vectors over
/// 20,000 coordinates is within 5 standard errors of zero.
#[test]
fn noises_over_inputs_differing_in_one_contributions_bytes_are_uncorrelated() {
    let len = 20_000;
    let r = round(len);
    let zeros = update(&vec![0.0; len]);
    let mut inputs: Vec<_> = (0..3)
        .map(|i| sealed(&r, &format!("a{i}"), ROUND, &zeros))
        .map(|(id, bytes)| (id, Some(bytes)))
        .collect();
    let first = release_of(&r, binding(), &inputs);
    // The same device's same (zero) update, sealed again: other bytes, same ref, same sum.
    inputs[0].1 = Some(sealed(&r, "a0", ROUND, &zeros).1);
    let second = release_of(&r, binding(), &inputs);
    assert_eq!(
        first.manifest.included_digest,
        second.manifest.included_digest
    );
    assert_ne!(first.manifest.inputs_digest, second.manifest.inputs_digest);
    // Every input is zero, so the released values are the noise alone.
    let (x, y): (Vec<f64>, Vec<f64>) = first
        .values
        .iter()
        .zip(&second.values)
        .map(|(&a, &b)| (f64::from(a), f64::from(b)))
        .unzip();
    let correlation = correlation(&x, &y);
    assert!(
        correlation.abs() < 5.0 / (len as f64).sqrt(),
        "noise correlation {correlation}"
    );
    assert!(x.iter().any(|&v| v != 0.0), "the release is noised");
}

/// A Gaussian round's release noise comes from `sampler_steps` (`noise::add_steps`, the sampler
/// the worker names in the round's inputs digest, `inputs::STEPS_SAMPLER`), keyed as documented:
/// with every input zero, the released values are exactly those draws on the grid. Drawn with
/// `sampler` (`noise::add`) from the same key, they would differ.
#[test]
fn a_gaussian_release_draws_its_noise_with_the_step_sampler() {
    let len = 3 * (1 << 14) + 5;
    let r = round(len);
    let inputs: Vec<_> = (0..2)
        .map(|i| sealed(&r, &format!("a{i}"), ROUND, &update(&vec![0.0; len])))
        .map(|(id, bytes)| (id, Some(bytes)))
        .collect();
    let release = release_of(&r, binding(), &inputs);
    let seed = noise::seed(
        &r.private,
        &noise::NoiseBinding {
            context: &binding().context,
            inputs_digest: &release.manifest.inputs_digest,
        },
    );
    let recorded = release.manifest.noise.variance_grid;
    let gaussian = crate::dp::DiscreteGaussian::with_variance(recorded);
    let on_grid = |draws: Vec<i64>| -> Vec<f32> {
        draws
            .into_iter()
            .map(|units| grid::to_average(units, privacy().clip_norm, 2))
            .collect()
    };
    assert_eq!(
        release.values,
        on_grid(noise::samples_steps(len, &gaussian, &seed))
    );
    assert_ne!(
        release.values,
        on_grid(noise::samples(len, &gaussian, &seed))
    );
}

fn correlation(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx).powi(2);
        syy += (b - my).powi(2);
    }
    sxy / (sxx * syy).sqrt()
}

/// A policy or model other than the devices' gives other noise too (and, through the associated
/// data, opens nothing sealed under the original: see the envelope tests).
#[test]
fn the_noise_is_keyed_by_the_policy_and_the_model() {
    let r = round(64);
    let releases: Vec<Release> = [
        context(ROUND),
        envelope::RoundContext {
            policy_sha256: "c".repeat(64),
            ..context(ROUND)
        },
        envelope::RoundContext {
            model_sha256: "d".repeat(64),
            ..context(ROUND)
        },
    ]
    .into_iter()
    .map(|context| {
        let env =
            envelope::seal(&r.public, KEY, &context, &"a1".into(), &update(&[0.0; 64])).unwrap();
        let inputs = [(envelope::assignment_ref("a1"), Some(env.to_cbor()))];
        let binding = Binding {
            context,
            ..binding()
        };
        release_of(&r, binding, &inputs)
    })
    .collect();
    assert_ne!(releases[0].average, releases[1].average);
    assert_ne!(releases[0].average, releases[2].average);
    assert_eq!(releases[1].manifest.policy_sha256, "c".repeat(64));
    assert_eq!(releases[2].manifest.model_sha256, "d".repeat(64));
}

/// The released sum minus the true clipped sum is the noise: its spread must match the recorded
/// scale (100k coordinates make the estimate good to ~0.3%), its mean must be ~0, and an update
/// far above the clip norm must count exactly as one of norm `clip_norm`.
#[test]
fn released_noise_matches_the_recorded_scale_and_clipping_is_exact() {
    let len = 100_000;
    let r = round(len);
    let clip = 2.0;
    // Device 0 sends a huge update (norm 1000): clipped to norm 2 exactly.
    // Device 1 sends a small one (norm 0.5): unchanged.
    let mut rng = Normal(0x9e37_79b9_7f4a_7c15);
    let big: Vec<f32> = (0..len)
        .map(|_| rng.normal() * 1000.0 / (len as f32).sqrt())
        .collect();
    let small: Vec<f32> = (0..len)
        .map(|_| rng.normal() * 0.5 / (len as f32).sqrt())
        .collect();
    let norm = |v: &[f32]| v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let inputs = vec![
        {
            let (id, b) = sealed(&r, "big", ROUND, &update(&big));
            (id, Some(b))
        },
        {
            let (id, b) = sealed(&r, "small", ROUND, &update(&small));
            (id, Some(b))
        },
    ];
    let agg = Aggregator::new(binding(), clip, r.schema.clone(), &r.private).unwrap();
    agg.add_batch(&inputs);
    let params = PrivacyParams {
        clip_norm: clip,
        ..privacy()
    };
    let release = agg.finish(&r.private, params).unwrap();
    let scale = clip / norm(&big);
    let diffs: Vec<f64> = (0..len)
        .map(|i| {
            let expected = f64::from(big[i]) * scale + f64::from(small[i]);
            f64::from(release.values[i]) * 2.0 - expected
        })
        .collect();
    let mean = diffs.iter().sum::<f64>() / len as f64;
    let sd = (diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (len - 1) as f64).sqrt();
    let recorded = release.manifest.noise.stddev_sum;
    assert!(
        (sd / recorded - 1.0).abs() < 0.02,
        "measured {sd}, recorded {recorded}"
    );
    assert!(
        mean.abs() < 5.0 * recorded / (len as f64).sqrt(),
        "mean {mean}"
    );
    assert_eq!(release.manifest.included, 2);
}

#[test]
fn clipping_without_noise_yields_exactly_the_clip_norm() {
    let r = round(1000);
    let agg = Aggregator::new(binding(), 0.5, r.schema.clone(), &r.private).unwrap();
    let values: Vec<f32> = (0..1000).map(|i| (i as f32).sin() * 10.0).collect();
    let (id, bytes) = sealed(&r, "a", ROUND, &update(&values));
    agg.add(&id, Some(&bytes)).unwrap();
    let sum = agg.sum.into_sum();
    let units = grid::GRID_UNITS_PER_CLIP as f64;
    let norm = sum.iter().map(|&q| (q as f64).powi(2)).sum::<f64>().sqrt();
    // Exactly the clip norm up to the grid's rounding (half a unit per coordinate at worst).
    assert!(norm <= units && norm > units - (1000f64).sqrt(), "{norm}");
}

/// Large (chunked) updates streamed chunk by chunk give exactly the sum the buffered path gives,
/// and the same exclusions: clipped, NaN, a tampered last chunk, the wrong assignment.
#[test]
fn streamed_and_buffered_aggregation_agree_exactly() {
    let len = 300_000; // 1.2 MB of values: sealed in two chunks
    let r = round(len);
    let mut rng = Normal(11);
    let small: Vec<f32> = (0..len)
        .map(|_| rng.normal() * 0.3 / (len as f32).sqrt())
        .collect();
    let big: Vec<f32> = (0..len)
        .map(|_| rng.normal() * 50.0 / (len as f32).sqrt())
        .collect();
    let mut nan = small.clone();
    nan[len - 1] = f32::NAN;
    let (id_small, small_bytes) = sealed(&r, "small", ROUND, &update(&small));
    let (id_big, big_bytes) = sealed(&r, "big", ROUND, &update(&big));
    let (id_nan, nan_bytes) = sealed(&r, "nan", ROUND, &update(&nan));
    let (id_tampered, tampered) = {
        let (id, bytes) = sealed(&r, "tampered", ROUND, &update(&small));
        let mut env = envelope::Envelope::from_cbor(&bytes).unwrap();
        assert!(env.chunk.is_some(), "large updates are chunked");
        let last = env.ciphertext.len() - 1;
        env.ciphertext[last] ^= 1;
        (id, env.to_cbor())
    };
    let moved = sealed(&r, "moved", ROUND, &update(&small)).1;
    let inputs = [
        (id_small.as_str(), &small_bytes[..], Ok(())),
        (id_big.as_str(), &big_bytes[..], Ok(())),
        (id_nan.as_str(), &nan_bytes[..], Ok(())),
        (
            id_tampered.as_str(),
            &tampered[..],
            Err(Exclusion::DecryptionFailed),
        ),
        (
            "not-its-assignment",
            &moved[..],
            Err(Exclusion::DecryptionFailed),
        ),
    ];
    let run = |agg: Aggregator| {
        for (id, bytes, expected) in &inputs {
            assert_eq!(agg.add(id, Some(bytes)), *expected, "{id}");
        }
        agg.sum.into_sum()
    };
    let buffered = run(Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap());
    let streamed = run(
        Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private)
            .unwrap()
            .stream_above(0),
    );
    assert_eq!(buffered, streamed);
    assert!(buffered.iter().any(|&v| v != 0));
}

/// The noise of each release of a tree task, in grid units on the sum: the release's average
/// times its count (one all-zero contribution per round, so the sum itself is zero).
fn tree_release_noises(len: usize, length: u32, rounds: u64) -> (Vec<Vec<f64>>, Vec<Manifest>) {
    let r = round(len);
    let mechanism = crate::policy::Mechanism::Tree {
        min_separation: length,
    };
    let mut noises = Vec::new();
    let mut manifests = Vec::new();
    for round in 1..=rounds {
        let (id, bytes) = sealed(&r, &format!("a{round}"), round, &update(&vec![0.0; len]));
        let binding = Binding {
            context: context(round),
            key_id: KEY.into(),
            inputs_digest: format!("{round:064}"),
        };
        let agg = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private).unwrap();
        agg.add_batch(&[(id, Some(bytes))]);
        let params = PrivacyParams {
            rounds: rounds as u32,
            mechanism,
            ..privacy()
        };
        let release = agg.finish(&r.private, params).unwrap();
        let units = grid::GRID_UNITS_PER_CLIP as f64;
        noises.push(
            release
                .values
                .iter()
                .map(|&v| f64::from(v) * units)
                .collect(),
        );
        manifests.push(release.manifest);
    }
    (noises, manifests)
}

fn covariance_of(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    x.iter()
        .zip(y)
        .map(|(a, b)| (a - mx) * (b - my))
        .sum::<f64>()
        / (n - 1.0)
}

/// DP-FTRL's released running sums (the sums of a tree's releases) carry exactly the noise the
/// tree says: every pair of prefixes has the covariance of the efficient estimator's node
/// weights, each prefix's spread is what the manifest records, and a new tree starts afresh.
#[test]
fn tree_releases_sum_to_prefixes_with_the_recorded_noise_covariance() {
    let len = 60_000;
    let (noises, manifests) = tree_release_noises(len, 8, 9);
    let node_variance = manifests[0].noise.variance_grid as f64;
    let trees = dp::tree::Trees { length: 8 };
    let mut prefixes: Vec<Vec<f64>> = Vec::new();
    for (t, noise) in noises.iter().take(8).enumerate() {
        let mut running = prefixes.last().cloned().unwrap_or_else(|| vec![0.0; len]);
        running.iter_mut().zip(noise).for_each(|(p, n)| *p += n);
        let tree = manifests[t].noise.tree.as_ref().expect("a tree record");
        assert_eq!(
            (tree.tree, tree.position, tree.length),
            (0, t as u64 + 1, 8)
        );
        let measured = covariance_of(&running, &running).sqrt() / grid::GRID_UNITS_PER_CLIP as f64;
        assert!(
            (measured / tree.prefix_stddev_sum - 1.0).abs() < 0.02,
            "round {}: measured {measured}, recorded {}",
            t + 1,
            tree.prefix_stddev_sum
        );
        let release_sd = covariance_of(noise, noise).sqrt() / grid::GRID_UNITS_PER_CLIP as f64;
        assert!((release_sd / manifests[t].noise.stddev_sum - 1.0).abs() < 0.02);
        prefixes.push(running);
    }
    for a in 1..=8u64 {
        for b in a..=8u64 {
            let expected = node_variance
                * dp::tree::covariance(
                    &trees.prefix(0, a),
                    &trees.prefix(0, b),
                    trees.denominator(),
                );
            let measured = covariance_of(&prefixes[a as usize - 1], &prefixes[b as usize - 1]);
            let scale = node_variance * 2.0;
            assert!(
                (measured - expected).abs() < 0.03 * scale,
                "prefixes {a} and {b}: measured {measured}, expected {expected}"
            );
        }
    }
    // Round 9 opens tree 1: its noise is one fresh leaf, independent of tree 0's sums.
    let restart = &manifests[8].noise.tree.as_ref().unwrap();
    assert_eq!((restart.tree, restart.position, restart.nodes), (1, 1, 1));
    let cross = covariance_of(&noises[8], &prefixes[7]);
    assert!(cross.abs() < 0.03 * node_variance * 2.0, "{cross}");
    // Accounting: round 8 completes a full tree of depth 4; round 9 adds one leaf; round 7
    // completes no new level of tree 0 (depth(7) = depth(6) = 3) and costs nothing.
    let leaf = manifests[0].privacy.rho_round;
    for (round, cost) in [(8, leaf), (9, leaf), (7, 0.0), (3, 0.0)] {
        let got = manifests[round - 1].privacy.rho_round;
        assert!((got - cost).abs() < 1e-9 * leaf, "round {round}: {got}");
    }
    assert!(manifests[7].privacy.rho_spent > 3.99 * manifests[0].privacy.rho_round);
}

/// An operator who knows every other contribution of a tree (it filled those rounds) estimates
/// one device's contribution to round r from all the tree's releases with error variance
/// `1 / (Sigma^-1)_rr`, Sigma the covariance of the releases' noise. That beats the release's
/// own `stddev_sum` (which is why the manifest must not be read as the guarantee), and never
/// beats `accounted_stddev_sum`, the accounting's bound the manifest states.
#[test]
fn a_tree_manifest_states_no_more_noise_than_the_accounting_guarantees() {
    let (_, manifests) = tree_release_noises(16, 8, 9);
    let trees = dp::tree::Trees { length: 8 };
    let d = trees.denominator();
    let node_sd = manifests[0].noise.stddev_sum; // position 1: one raw node
    // Covariance of the increments (releases) 1..=8, in raw node variances.
    let prefix = |t: u64| trees.prefix(0, t);
    let cov = |a: u64, b: u64| {
        let p = |x: u64, y: u64| {
            if x == 0 || y == 0 {
                0.0
            } else {
                dp::tree::covariance(&prefix(x), &prefix(y), d)
            }
        };
        p(a, b) - p(a - 1, b) - p(a, b - 1) + p(a - 1, b - 1)
    };
    let sigma: Vec<Vec<f64>> = (1..=8)
        .map(|a| (1..=8).map(|b| cov(a, b)).collect())
        .collect();
    let inverse = invert(sigma);
    let mut beaten = 0;
    for r in 0..8 {
        let tree = manifests[r].noise.tree.as_ref().unwrap();
        assert_eq!(tree.accounted_depth, Some(4), "8 planned rounds: depth 4");
        let accounted = tree.accounted_stddev_sum.unwrap();
        assert!((accounted - node_sd / 2.0).abs() < 1e-12 * node_sd);
        let attack = node_sd / inverse[r][r].sqrt();
        assert!(
            attack >= accounted * (1.0 - 1e-9),
            "round {}: the attack's error {attack} is below the accounted {accounted}",
            r + 1
        );
        if attack < manifests[r].noise.stddev_sum * 0.99 {
            beaten += 1;
        }
    }
    assert!(
        beaten > 0,
        "the release's own stddev overstates the guarantee somewhere"
    );
}

/// A tree release of a server that did not record the accounted noise still parses.
#[test]
fn an_older_tree_record_without_the_accounted_noise_parses() {
    let record: crate::aggregate::TreeRecord = serde_json::from_value(serde_json::json!({
        "length": 8, "tree": 0, "position": 3, "nodes": 1, "prefix_stddev_sum": 1.0
    }))
    .unwrap();
    assert_eq!(record.accounted_stddev_sum, None);
    assert!(
        !serde_json::to_string(&record)
            .unwrap()
            .contains("accounted")
    );
}

/// Gauss-Jordan inverse of a small symmetric positive definite matrix.
pub(crate) fn invert(mut a: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
    let n = a.len();
    let mut inv: Vec<Vec<f64>> = (0..n)
        .map(|i| (0..n).map(|j| f64::from(u8::from(i == j))).collect())
        .collect();
    for col in 0..n {
        let pivot = a[col][col];
        for j in 0..n {
            a[col][j] /= pivot;
            inv[col][j] /= pivot;
        }
        for row in 0..n {
            if row != col {
                let factor = a[row][col];
                for j in 0..n {
                    a[row][j] -= factor * a[col][j];
                    inv[row][j] -= factor * inv[col][j];
                }
            }
        }
    }
    inv
}

/// A tree round's noise is a function of the task, its policy, the round and the key alone, so a
/// retried job reproduces it (and a new model version or input set does not change it: the
/// key services' ledger is what allows one release per round).
#[test]
fn a_tree_rounds_noise_is_reproduced_whatever_the_attempt() {
    let (first, _) = tree_release_noises(1000, 4, 3);
    let (again, _) = tree_release_noises(1000, 4, 3);
    // Each call seals under a fresh key pair: different keys, independent noise.
    assert_ne!(first[2], again[2]);
    let r = round(1000);
    let mechanism = crate::policy::Mechanism::Tree { min_separation: 4 };
    let release = |digest: &str| {
        let (id, bytes) = sealed(&r, "a", 3, &update(&vec![0.0; 1000]));
        let binding = Binding {
            context: context(3),
            key_id: KEY.into(),
            inputs_digest: digest.into(),
        };
        let agg = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private).unwrap();
        agg.add_batch(&[(id, Some(bytes))]);
        let params = PrivacyParams {
            mechanism,
            ..privacy()
        };
        agg.finish(&r.private, params).unwrap().values
    };
    assert_eq!(release(&"1".repeat(64)), release(&"2".repeat(64)));
}

/// Adaptive clipping on known data: update norms uniform on [0, 2] (median 1). From a clip norm
/// of 0.2, following each manifest's `next_clip_norm`, the clip norm converges to the median, and
/// the noised fraction of unclipped updates to the target quantile.
#[test]
fn the_adaptive_clip_norm_converges_to_the_target_quantile() {
    let r = round(4);
    let adaptive = crate::policy::AdaptiveClipping {
        target_quantile: 0.5,
        learning_rate: 0.6,
        count_stddev: 2.0,
    };
    let mut rng = Normal(7);
    let (rounds, per_round) = (24u64, 50);
    let mut clip = 0.2;
    let mut clips: Vec<f64> = Vec::new();
    let mut fractions = Vec::new();
    for round in 1..=rounds {
        let inputs: Vec<_> = (0..per_round)
            .map(|i| {
                let norm = 2.0 * rng.uniform() as f32;
                let (id, bytes) = sealed(
                    &r,
                    &format!("a{round}-{i}"),
                    round,
                    &update(&[norm, 0.0, 0.0, 0.0]),
                );
                (id, Some(bytes))
            })
            .collect();
        let binding = Binding {
            context: context(round),
            key_id: KEY.into(),
            inputs_digest: inputs::digest_of(&inputs),
        };
        let agg = Aggregator::new(binding, clip, r.schema.clone(), &r.private).unwrap();
        agg.add_batch(&inputs);
        let params = PrivacyParams {
            epsilon: 50.0,
            clip_norm: clip,
            rounds: rounds as u32,
            adaptive: Some(adaptive),
            evaluation: None,
            on_demand: false,
            ..privacy()
        };
        let manifest = agg.finish(&r.private, params).unwrap().manifest;
        let record = manifest.adaptive_clipping.expect("an adaptive record");
        assert_eq!(manifest.clip_norm, clip);
        // The integer variance is rounded up: 16 -> 17 on the count's doubled scale.
        assert!((2.0..2.1).contains(&record.count_stddev), "{record:?}");
        fractions.push(record.unclipped_fraction);
        clip = record.next_clip_norm;
        clips.push(clip);
    }
    // The last 10 rounds, averaged: each round's fraction is noised (sampling and count noise,
    // about 0.08 together), and the clip norm wanders by learning_rate times that.
    let late_clip = clips[14..].iter().sum::<f64>() / 10.0;
    assert!((late_clip - 1.0).abs() < 0.15, "clip norms: {clips:?}");
    let late: f64 = fractions[14..].iter().sum::<f64>() / 10.0;
    assert!(
        (late - 0.5).abs() < 0.1,
        "unclipped fractions: {fractions:?}"
    );
    assert!(
        fractions[0] < 0.3,
        "at 0.2 most updates are clipped: {fractions:?}"
    );
}

/// The round's clip norm comes from the job only under adaptive clipping, within the policy
/// limits; it is bound into the inputs digest (so into the release commitment and the noise).
#[test]
fn a_round_clip_norm_is_taken_only_under_adaptive_clipping_and_bound_into_the_digest() {
    let mut policy = crate::policy::TaskPolicy::sample("t", 3);
    assert!(PrivacyParams::for_round(&policy, None, false).is_ok());
    assert!(PrivacyParams::for_round(&policy, Some(2.0), false).is_err());
    policy.mechanism = "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1,5e0".into();
    assert!(PrivacyParams::for_round(&policy, None, false).is_err());
    assert!(PrivacyParams::for_round(&policy, Some(1e7), false).is_err());
    let params = PrivacyParams::for_round(&policy, Some(2.0), false).unwrap();
    assert_eq!(params.clip_norm, 2.0);
    assert!(params.adaptive.is_some());
    let digest = "e".repeat(64);
    assert_ne!(
        inputs::bind_clip_norm(&digest, 2.0),
        inputs::bind_clip_norm(&digest, 2.000001)
    );
    // What the worker commits to: the clip norm bound in.
    assert_eq!(
        params.bind_round_choices(digest.clone()),
        inputs::bind_clip_norm(&digest, 2.0)
    );
}
