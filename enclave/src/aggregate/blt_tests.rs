//! BLT rounds through the aggregator: the state carried from round to round, sealed; what the
//! running sum of releases carries; and every way a store could hand a round the wrong state.

use super::tests::{KEY, Round, context, privacy, round, sealed, update};
use super::*;
use crate::policy::Mechanism;
use confed_dp::blt::{Blt, ErrorKind};
use confed_protocol::blt_noise::BltNoise;

const VALUES: usize = 2000;
const ROUNDS: u32 = 6;

fn blt(rounds: u32) -> BltNoise {
    let q = confed_protocol::blt_noise::quantize;
    let matrix = Blt::new(vec![q(0.95), q(0.5)], vec![q(0.3), q(0.2)]);
    confed_dp::blt_accounting::task_blt(
        &confed_dp::ClosedForm,
        8.0,
        1e-6,
        rounds,
        2,
        ErrorKind::Max,
        Some(&matrix),
        1 << 20,
    )
    .unwrap()
}

fn params(blt: BltNoise) -> PrivacyParams {
    PrivacyParams {
        epsilon: 8.0,
        rounds: ROUNDS,
        mechanism: Mechanism::Blt(blt),
        ..privacy()
    }
}

type Inputs = Vec<(String, Option<Vec<u8>>)>;

/// `devices` updates of 0.01 on every value, sealed for round `round`.
fn inputs_for(r: &Round, round: u64, devices: usize) -> Inputs {
    (0..devices)
        .map(|i| {
            let (id, bytes) = sealed(
                r,
                &format!("a{round}-{i}"),
                round,
                &update(&vec![0.01; VALUES]),
            );
            (id, Some(bytes))
        })
        .collect()
}

/// Round `round` over `inputs`, continuing `state`, as the worker runs it.
fn run_with(
    r: &Round,
    blt: BltNoise,
    round: u64,
    inputs: &Inputs,
    state: Option<Vec<u8>>,
) -> Result<Release, AggregateError> {
    let state_digest =
        blt_round::check_before_key(&blt, &context(round), VALUES, state.as_deref())?;
    let binding = Binding {
        context: context(round),
        key_id: KEY.into(),
        inputs_digest: inputs::bind_blt_state(&inputs::digest_of(inputs), state_digest.as_ref()),
    };
    let agg = Aggregator::new(binding, 1.0, r.schema.clone(), &r.private)?.continuing(state);
    agg.add_batch(inputs);
    agg.finish(&r.private, params(blt))
}

/// Round `round` over `devices` fresh updates, continuing `state`.
fn run(
    r: &Round,
    blt: BltNoise,
    round: u64,
    devices: usize,
    state: Option<Vec<u8>>,
) -> Result<Release, AggregateError> {
    run_with(r, blt, round, &inputs_for(r, round, devices), state)
}

#[test]
fn a_blt_task_carries_its_sealed_state_and_its_running_sum_is_within_the_recorded_noise() {
    let r = round(VALUES);
    let blt = blt(ROUNDS);
    let devices = 20;
    let mut state = None;
    let mut previous_out: Option<String> = None;
    let mut running = vec![0f64; VALUES];
    let mut rho = 0.0;
    for round in 1..=u64::from(ROUNDS) {
        let release = run(&r, blt, round, devices, state.take()).unwrap();
        if round == u64::from(ROUNDS) {
            // The whole budget, no more: calibrated for all the rounds with the rounding charged,
            // and the variance rounded up to an integer only adds noise.
            let spent = release.manifest.privacy.epsilon_spent;
            assert!((7.9..=8.0 + 1e-9).contains(&spent), "{spent}");
        }
        let record = release.manifest.noise.blt.clone().expect("a BLT record");
        assert_eq!(record.state_in_blake3, previous_out, "round {round}");
        let sealed = release.blt_state.clone().expect("a sealed state");
        assert_eq!(
            record.state_out_blake3,
            hex(blake3::hash(&sealed).as_bytes())
        );
        assert!(release.manifest.noise.mechanism.starts_with("blt_on_grid;"));
        assert!(release.manifest.privacy.rho_spent > rho);
        rho = release.manifest.privacy.rho_spent;
        // The running sum of the releases (as sums: average x count) against the true running
        // sum (0.01 x devices x rounds): its noise is the recorded prefix deviation.
        for (total, value) in running.iter_mut().zip(&release.values) {
            *total += f64::from(*value) * devices as f64;
        }
        let truth = 0.01 * devices as f64 * round as f64;
        let errors: Vec<f64> = running.iter().map(|t| t - truth).collect();
        let variance = errors.iter().map(|e| e * e).sum::<f64>() / VALUES as f64;
        let ratio = variance.sqrt() / record.prefix_stddev_sum;
        assert!(
            (0.9..1.1).contains(&ratio),
            "round {round}: running-sum error {} against recorded {}",
            variance.sqrt(),
            record.prefix_stddev_sum
        );
        previous_out = Some(record.state_out_blake3);
        state = Some(sealed);
    }
}

#[test]
fn a_retried_round_reproduces_its_release_from_the_same_state() {
    let r = round(VALUES);
    let blt = blt(ROUNDS);
    let first = run(&r, blt, 1, 5, None).unwrap();
    let state = first.blt_state.clone();
    let inputs = inputs_for(&r, 2, 5);
    let a = run_with(&r, blt, 2, &inputs, state.clone()).unwrap();
    let b = run_with(&r, blt, 2, &inputs, state.clone()).unwrap();
    // Byte for byte, state and manifest included: a release staged before a crash (write-once
    // names) is what the retry commits.
    assert!(a.values == b.values && a.average == b.average);
    assert_eq!(a.blt_state, b.blt_state);
    assert_eq!(a.manifest.to_json(), b.manifest.to_json());
    let next = inputs_for(&r, 3, 5);
    let c = run_with(&r, blt, 3, &next, a.blt_state.clone()).unwrap();
    let d = run_with(&r, blt, 3, &next, b.blt_state).unwrap();
    assert!(c.values == d.values && c.blt_state == d.blt_state);
    // Another state for round 3 (a fork of round 2 over other inputs, which the key services
    // would refuse to release): the commitment names the state, so it is another commitment.
    let fork = run_with(&r, blt, 2, &inputs_for(&r, 2, 5), state.clone()).unwrap();
    let forked = run_with(&r, blt, 3, &next, fork.blt_state).unwrap();
    assert_ne!(forked.manifest.inputs_digest, c.manifest.inputs_digest);
    // Other inputs to the same round (one more device): independent noise, not the same noise
    // over a different sum (which would show that device's update exactly).
    let more = inputs_for(&r, 2, 6);
    let e = run_with(&r, blt, 2, &more, state).unwrap();
    let moved: Vec<f64> = a
        .values
        .iter()
        .zip(&e.values)
        .map(|(a, e)| f64::from(a - e))
        .collect();
    let spread = moved.iter().map(|m| m * m).sum::<f64>() / moved.len() as f64;
    assert!(spread.sqrt() > 0.1, "{}", spread.sqrt());
}

#[test]
fn a_state_from_another_round_task_or_key_or_none_is_refused() {
    let r = round(VALUES);
    let blt = blt(ROUNDS);
    let one = run(&r, blt, 1, 3, None).unwrap().blt_state;
    let two = run(&r, blt, 2, 3, one.clone()).unwrap().blt_state;
    let refused = |result: Result<Release, AggregateError>| match result {
        Err(AggregateError::BltState(e)) => e,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a release"),
    };
    // Rolled back: round 3 given round 1's state; round 2 given its own output (a fork).
    assert!(matches!(
        refused(run(&r, blt, 3, 3, one.clone())),
        blt_state::StateError::Mismatch(_)
    ));
    assert!(matches!(
        refused(run(&r, blt, 2, 3, two.clone())),
        blt_state::StateError::Mismatch(_)
    ));
    // Dropped: round 3 without a state; round 1 with one.
    assert!(matches!(
        refused(run(&r, blt, 3, 3, None)),
        blt_state::StateError::Mismatch(_)
    ));
    assert!(matches!(
        refused(run(&r, blt, 1, 3, one)),
        blt_state::StateError::Mismatch(_)
    ));
    // Sealed by another task's enclave (another key), with a header that would fit.
    let other = round(VALUES);
    let foreign = run(&other, blt, 1, 3, None).unwrap().blt_state;
    assert_eq!(
        refused(run(&r, blt, 2, 3, foreign)),
        blt_state::StateError::Unauthentic
    );
}

#[test]
fn a_model_larger_than_the_policys_max_values_is_refused_before_the_key() {
    let small = confed_dp::blt_accounting::task_blt(
        &confed_dp::ClosedForm,
        8.0,
        1e-6,
        ROUNDS,
        2,
        ErrorKind::Max,
        None,
        (VALUES - 1) as u64,
    )
    .unwrap();
    let error = blt_round::check_before_key(&small, &context(1), VALUES, None).unwrap_err();
    assert!(error.to_string().contains("max_values"), "{error}");
}

#[test]
fn a_blt_policy_runs_and_a_lattice_too_fine_for_its_noise_is_refused_before_the_key() {
    let mut policy = crate::policy::TaskPolicy::sample("t", ROUNDS);
    let fitted = blt(ROUNDS);
    policy.mechanism = Mechanism::Blt(fitted).encode();
    policy.epsilon = 8.0;
    let params = PrivacyParams::for_round(&policy, None, false).unwrap();
    assert_eq!(params.mechanism, Mechanism::Blt(fitted));
    // The finest lattice at a budget that needs a hundred times the noise: out of range.
    policy.epsilon = 0.05;
    let fine = BltNoise::new(
        2,
        &fitted.decays(),
        &fitted.scales(),
        fitted.max_values,
        confed_protocol::blt_noise::MAX_LATTICE_BITS,
    )
    .unwrap();
    policy.mechanism = Mechanism::Blt(fine).encode();
    let error = PrivacyParams::for_round(&policy, None, false).unwrap_err();
    assert!(error.to_string().contains("lattice"), "{error}");
}

/// Issue 45: an operator who knows every other contribution of the task (it filled those rounds)
/// estimates one device's contribution to round t from all the planned rounds' releases
/// `r = x + C^-1 z` with error variance `sigma^2 / (Sigma^-1)_tt`, Sigma = `C^-1 C^-T` the
/// releases' noise covariance in units of the fresh noise's variance. That beats round 1's own
/// `stddev_sum` (so the release's noise must not be read as the guarantee) and never beats
/// `accounted_stddev_sum`, the accounting's bound the manifest states.
#[test]
fn a_blt_manifest_states_no_more_noise_than_the_accounting_guarantees() {
    let r = round(VALUES);
    let blt = blt(ROUNDS);
    let n = ROUNDS as usize;
    let mut state = None;
    let mut records = Vec::new();
    for round in 1..=u64::from(ROUNDS) {
        let release = run(&r, blt, round, 20, state.take()).unwrap();
        state = release.blt_state.clone();
        records.push((
            release.manifest.noise.stddev_sum,
            release.manifest.noise.blt.clone().expect("a BLT record"),
        ));
    }
    // The fresh noise's standard deviation: round 1's release carries exactly it (C^-1 has a
    // unit diagonal).
    let fresh = records[0].0;
    let inverse = Blt::new(blt.decays(), blt.scales())
        .inverse()
        .coefficients(n);
    let c_inverse = |i: usize, j: usize| if i >= j { inverse[i - j] } else { 0.0 };
    let sigma: Vec<Vec<f64>> = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| (0..n).map(|k| c_inverse(a, k) * c_inverse(b, k)).sum())
                .collect()
        })
        .collect();
    let precision = super::tests::invert(sigma);
    let mut beaten = 0;
    for (t, (stddev_sum, record)) in records.iter().enumerate() {
        let accounted = record.accounted_stddev_sum.expect("the accounted bound");
        let sensitivity = record.accounted_sensitivity.expect("its sensitivity");
        assert!((accounted * sensitivity - fresh).abs() < 1e-9 * fresh);
        let attack = fresh / precision[t][t].sqrt();
        assert!(
            attack >= accounted * (1.0 - 1e-9),
            "round {}: the attack's error {attack} is below the accounted {accounted}",
            t + 1
        );
        if attack < stddev_sum * 0.99 {
            beaten += 1;
        }
    }
    assert!(
        records[0].0 > fresh / precision[0][0].sqrt() * 1.01,
        "round 1's own noise overstates what a device keeps once later rounds are out"
    );
    assert!(beaten > 0);
}
