//! A round under BLT noise (docs/privacy.md, "DP-FTRL with BLT noise"): what is checked before
//! the key is asked for, and the release itself, which continues the sealed state round `t - 1`
//! left (`blt_state`) and seals the one round `t + 1` continues.

use confed_dp::blt::{Blt, running_sum_variances};
use confed_dp::blt_accounting;
use confed_protocol::blt_noise::BltNoise;

use super::blt_state::{self, Continuing, StateHeader};
use super::manifest::{BltRecord, NoiseRecord};
use super::{AggregateError, Binding, hex, noise};
use crate::dp::blt::BltKernel;
use crate::dp::{DiscreteGaussian, grid};
use crate::envelope::RoundContext;
use crate::hpke::PrivateKey;

/// Most contributions a BLT release sums. It bounds the sums whatever the devices' data: each
/// value of a clipped update is at most 2^16 grid units, so a sum is below 2^48 grid units, 2^62
/// lattice units (at most 14 lattice bits), 2^102 in the strategy buffers' fixed point, and a
/// buffer (a decayed sum of at most 10,000 rounds, decays below 1) below 2^116: the kernel's i128
/// never overflows. Its overflow error is therefore unreachable, and the only refusal here is
/// on the count, which the manifest publishes anyway (`included`), never on the data.
pub const MAX_BLT_INCLUDED: u64 = 1 << 32;

/// The matrices of `blt`: `C` exactly as the policy gives it, `C^-1` computed from it.
fn kernel(blt: &BltNoise) -> Result<(BltKernel, Blt), AggregateError> {
    let matrix = Blt::new(blt.decays(), blt.scales());
    let inverse = matrix.inverse();
    let kernel = BltKernel::new(
        &matrix.decays,
        &matrix.scales,
        (&inverse.decays, &inverse.scales),
        blt.lattice_bits,
    )?;
    Ok((kernel, inverse))
}

fn continuing<'a>(
    context: &'a RoundContext,
    kernel: &BltKernel,
    inverse: &Blt,
    values: usize,
) -> Continuing<'a> {
    Continuing {
        task_id: &context.task_id,
        policy_sha256: &context.policy_sha256,
        round: context.round,
        values: values as u64,
        buffers: kernel.buffers() as u32,
        inverse_buffers: inverse.buffers() as u32,
    }
}

/// Everything about a BLT round that can be checked before the key is asked for: the model fits
/// the policy's `max_values` (what the rounding is charged for), the state is round `t - 1`'s of
/// this task and policy with the model's shape (round 1 takes none), by its public header. Returns
/// the BLAKE3 of the sealed state (`None` in round 1), which the release commitment binds
/// (`inputs::bind_blt_state`). The AEAD is checked when the state is opened, after the key: a
/// state that fails it then fails the round for good, since the commitment naming it is recorded.
pub fn check_before_key(
    blt: &BltNoise,
    context: &RoundContext,
    values: usize,
    sealed: Option<&[u8]>,
) -> Result<Option<[u8; 32]>, AggregateError> {
    if values as u64 > blt.max_values {
        return Err(AggregateError::Unsupported(format!(
            "the model has {values} values, more than the BLT policy's max_values {} that its rounding is charged for",
            blt.max_values
        )));
    }
    let (kernel, inverse) = kernel(blt)?;
    match (context.round, sealed) {
        (1, None) => Ok(None),
        (1, Some(_)) => Err(blt_state::StateError::Mismatch(
            "round 1 starts from zero buffers, and the job names a state".into(),
        )
        .into()),
        (round, None) => Err(blt_state::StateError::Mismatch(format!(
            "round {round} continues round {}'s state, and the job names none",
            round - 1
        ))
        .into()),
        (_, Some(sealed)) => {
            let (header, _) = blt_state::read_header(sealed)?;
            header.check_continues(&continuing(context, &kernel, &inverse, values))?;
            Ok(Some(*blake3::hash(sealed).as_bytes()))
        }
    }
}

/// The release of a BLT round: `r_t = C^-1 y` for the round's exact `sum` (grid units), noised
/// on the lattice by `noise` (lattice units) keyed from the private key and the binding,
/// continuing `sealed` (checked again, then opened). Returns the average's values, the noise
/// record and the sealed state the round leaves.
#[allow(clippy::too_many_arguments)]
pub fn release(
    blt: &BltNoise,
    sealed: Option<&[u8]>,
    private_key: &PrivateKey,
    binding: &Binding,
    sum: &[i64],
    noise: &DiscreteGaussian,
    clip_norm: f64,
    count: u64,
    rounds_planned: u32,
) -> Result<(Vec<f32>, NoiseRecord, Vec<u8>), AggregateError> {
    if count > MAX_BLT_INCLUDED {
        return Err(AggregateError::Unsupported(format!(
            "a BLT release sums at most {MAX_BLT_INCLUDED} contributions (this round includes {count})"
        )));
    }
    let context = &binding.context;
    let state_in = check_before_key(blt, context, sum.len(), sealed)?;
    let (kernel, inverse) = kernel(blt)?;
    let expected = continuing(context, &kernel, &inverse, sum.len());
    let mut state = match sealed {
        Some(sealed) => blt_state::open(private_key, sealed, &expected)?,
        None => kernel.initial_state(sum.len()),
    };
    let seed = noise::blt_seed(
        private_key,
        &noise::NoiseBinding {
            context,
            inputs_digest: &binding.inputs_digest,
        },
    );
    let released = kernel.step(&mut state, sum, noise, &seed)?;
    let lattice = f64::from(1u32 << blt.lattice_bits);
    // Dividing by a power of two is exact: the same f64 grid units a tree release converts.
    let values = released
        .iter()
        .map(|&r| grid::to_average_f64(r / lattice, clip_norm, count))
        .collect();
    drop(released);
    let header = StateHeader {
        task_id: context.task_id.clone(),
        policy_sha256: context.policy_sha256.clone(),
        round: context.round,
        inputs_digest: binding.inputs_digest.clone(),
        values: expected.values,
        buffers: expected.buffers,
        inverse_buffers: expected.inverse_buffers,
    };
    let sealed_out = blt_state::seal(private_key, &header, &state)?;
    drop(state);
    let record = record(
        blt,
        &inverse,
        noise,
        clip_norm,
        count,
        (context.round, rounds_planned),
        state_in,
        &sealed_out,
    );
    Ok((values, record, sealed_out))
}

/// The manifest's noise record of round `round`.
#[allow(clippy::too_many_arguments)]
fn record(
    blt: &BltNoise,
    inverse: &Blt,
    noise: &DiscreteGaussian,
    clip_norm: f64,
    count: u64,
    (round, rounds_planned): (u64, u32),
    state_in: Option<[u8; 32]>,
    sealed_out: &[u8],
) -> NoiseRecord {
    // One lattice unit of noise in update units on the sum.
    let unit = clip_norm / blt_accounting::units_per_clip(blt);
    let inverse_coefficients = inverse.coefficients(round as usize);
    let own: f64 = inverse_coefficients.iter().map(|c| c * c).sum();
    let prefix = running_sum_variances(&inverse_coefficients)
        .last()
        .copied()
        .unwrap_or(0.0);
    let stddev_sum = noise.scale() * unit * own.sqrt();
    // The whole task's accounted sensitivity bounds every single round's ||C e_t|| (one
    // participation is one of the patterns it maximises over): docs/privacy.md, "Reading a BLT
    // manifest".
    let accounted_sensitivity =
        blt_accounting::units_through(blt, u64::from(rounds_planned).max(round)).sqrt();
    NoiseRecord {
        mechanism: blt.encode(),
        grid_units_per_clip: grid::GRID_UNITS_PER_CLIP,
        variance_grid: noise.variance(),
        stddev_sum,
        stddev_average: stddev_sum / count as f64,
        tree: None,
        blt: Some(BltRecord {
            buffers: blt.decays().len() as u32,
            lattice_bits: blt.lattice_bits,
            max_values: blt.max_values,
            state_in_blake3: state_in.map(hex),
            state_out_blake3: hex(blake3::hash(sealed_out).as_bytes()),
            prefix_stddev_sum: noise.scale() * unit * prefix.sqrt(),
            sensitivity: blt_accounting::sensitivity_through(blt, round),
            accounted_stddev_sum: Some(noise.scale() * unit / accounted_sensitivity),
            accounted_sensitivity: Some(accounted_sensitivity),
        }),
    }
}
