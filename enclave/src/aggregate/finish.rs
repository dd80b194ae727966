//! The end of a round inside the enclave: the collection checked against the policy, the sum
//! noised once by the policy's mechanism and averaged, the side releases (adaptive clipping's
//! count, evaluation, health) noised, the privacy spent accounted, and the manifest written. The
//! noise is keyed from the private key and everything the release depends on, so the same
//! inputs give the same bytes and any other inputs give independent noise.

use std::sync::atomic::Ordering;

use sha2::{Digest, Sha256};

use super::accumulator::Accumulator;
use super::{
    AdaptiveRecord, AggregateError, Aggregator, Binding, DistributedNoise, Manifest, NoiseRecord,
    Outcome, PrivacyParams, PrivacyRecord, Release, TreeShape, blt_round, digest, encode,
    evaluation, health, hex, manifest, noise, noise_record, tree_noise_record,
};
use crate::dp::{self, DiscreteGaussian, grid};
use crate::hpke::PrivateKey;
use crate::policy::{AdaptiveClipping, Evaluation, Mechanism};

impl Aggregator {
    /// Noises the sum once and releases the average. The noise is keyed from `private_key` and
    /// everything the release depends on (see `noise`; the caller states the inputs' digest in
    /// the binding and must add exactly those inputs), so the same inputs give the same bytes and
    /// any other inputs give independent noise.
    pub fn finish(
        self,
        private_key: &PrivateKey,
        privacy: PrivacyParams,
    ) -> Result<Release, AggregateError> {
        let outcome = self.checked_outcome(&privacy)?;
        let count = outcome.included.len() as u64;
        let round = self.binding.context.round;
        let included_digest = digest(&outcome.included);
        let inputs_digest = self.binding.inputs_digest.clone();
        let calibration = privacy.calibration()?;
        let unclipped = self.unclipped.load(Ordering::Relaxed);
        // On the grid, or on a BLT's finer lattice.
        let units_per_clip = dp::accounting::units_per_clip(privacy.mechanism);
        let calibrated = DiscreteGaussian::at_least(calibration.noise_multiplier * units_per_clip)?;
        // Distributed noise: one honest group's draw is the guarantee, and it must be at least
        // what the budget calibrates (the policy's variance, checked again here).
        let noise = match self.distributed_noise {
            None => calibrated,
            Some(distributed) => distributed_scale(distributed, calibrated, privacy.mechanism)?,
        };
        // The scale in grid units, what the accounting takes (exact: a power of two apart).
        let scale_grid = noise.scale() * grid::GRID_UNITS_PER_CLIP as f64 / units_per_clip;
        let Aggregator {
            binding,
            schema,
            sum,
            evaluation,
            health,
            device_auth,
            blt_state,
            distributed_noise,
            ..
        } = self;
        let noised = match distributed_noise {
            Some(distributed) => distributed_average(&privacy, sum, &noise, distributed, count),
            None => noised_average(
                &privacy,
                sum,
                &noise,
                private_key,
                &binding,
                blt_state.as_deref(),
                count,
            )?,
        };
        let average = encode(&schema, &noised.values)?;
        let adaptive = match privacy.adaptive {
            None => None,
            Some(params) => Some(adaptive_count(
                &params,
                private_key,
                &binding,
                privacy.clip_norm,
                unclipped,
                count,
            )?),
        };
        let evaluated = match evaluation {
            None => None,
            Some((params, sums)) => Some(
                // Outside the schedule, this round evaluates because the job asked on demand.
                evaluation::release(
                    &params,
                    !params.evaluates(round),
                    sums,
                    private_key,
                    &binding,
                )?
                .0,
            ),
        };
        let evaluation_scale = evaluation_scale(privacy.evaluation)?;
        let health = match health {
            None => None,
            Some(watch) => {
                let params = watch.params;
                Some(health::release(
                    &params,
                    watch.take(),
                    private_key,
                    &binding,
                )?)
            }
        };
        let side = dp::SideScales {
            count: adaptive.as_ref().map(|(_, scale)| *scale),
            evaluation: evaluation_scale,
            health: health.as_ref().map(|(_, scale)| *scale),
        };
        let (rho_spent, epsilon_spent) = dp::spent_task(
            &dp::OpenDp,
            privacy.mechanism,
            scale_grid,
            &side,
            round,
            privacy.delta,
        )?;
        let rho_round = rho_spent
            - dp::rho_task(
                &dp::OpenDp,
                privacy.mechanism,
                scale_grid,
                &side,
                round.saturating_sub(1),
            )?;
        let manifest = Manifest {
            format: manifest::FORMAT.to_string(),
            task_id: binding.context.task_id.clone(),
            round: binding.context.round,
            key_id: binding.key_id.clone(),
            policy_sha256: binding.context.policy_sha256.clone(),
            model_sha256: binding.context.model_sha256.clone(),
            included: count,
            authenticated: device_auth.is_some().then_some(count),
            included_digest,
            inputs_digest,
            excluded: outcome.excluded_counts(),
            excluded_refs: outcome.listed_exclusions(),
            clip_norm: privacy.clip_norm,
            noise: noised.record,
            privacy: PrivacyRecord {
                epsilon_budget: privacy.epsilon,
                delta: privacy.delta,
                rounds_planned: privacy.rounds,
                noise_multiplier: calibration.noise_multiplier,
                rho_round,
                rho_spent,
                epsilon_spent,
            },
            adaptive_clipping: adaptive.map(|(record, _)| record),
            evaluation: evaluated,
            health: health.map(|(record, _)| record),
            analytics: None,
            masking: None,
            average_sha256: hex(Sha256::digest(&average)),
        };
        Ok(Release {
            average,
            manifest,
            values: noised.values,
            blt_state: noised.blt_state_out,
        })
    }

    /// The round's outcome, sorted, once the collection is known to be releasable: enough
    /// included contributions, and collected as the policy says (evaluation, health signal,
    /// weighting), since the release binds the policy.
    fn checked_outcome(&self, privacy: &PrivacyParams) -> Result<Outcome, AggregateError> {
        let outcome = std::mem::take(&mut *self.outcome.lock().expect("aggregation outcome"))
            .releasable(privacy.min_reports)?;
        let round = self.binding.context.round;
        let expected = privacy.evaluation_in(round);
        if expected.is_some() != self.evaluation.is_some() {
            return Err(AggregateError::EvaluationMismatch {
                collected: self.evaluation.is_some(),
                round,
            });
        }
        let counted = self.health.as_ref().map(|watch| watch.params);
        if privacy.health != counted {
            return Err(AggregateError::Unsupported(format!(
                "the aggregator counted the health signal as {counted:?}, but the policy names {:?}",
                privacy.health
            )));
        }
        if privacy.weighting != self.weighting {
            return Err(AggregateError::Unsupported(format!(
                "the aggregator weighed updates as {:?}, but the policy names {:?}",
                self.weighting, privacy.weighting
            )));
        }
        Ok(outcome)
    }
}

/// The noised average and what the manifest records of its noise.
struct Noised {
    values: Vec<f32>,
    record: NoiseRecord,
    /// BLT noise only: the sealed state the round leaves for the next.
    blt_state_out: Option<Vec<u8>>,
}

/// The sum noised once by the policy's mechanism and divided by `count`: Gaussian noise keyed by
/// the round's inputs; DP-FTRL's tree nodes, keyed by task and node and shared across rounds;
/// or BLT's correlated noise, which continues the sealed state `blt_state`.
fn noised_average(
    privacy: &PrivacyParams,
    sum: Accumulator,
    noise: &DiscreteGaussian,
    private_key: &PrivateKey,
    binding: &Binding,
    blt_state: Option<&[u8]>,
    count: u64,
) -> Result<Noised, AggregateError> {
    let round = binding.context.round;
    match privacy.mechanism {
        Mechanism::Gaussian => {
            let seed = noise::seed(
                private_key,
                &noise::NoiseBinding {
                    context: &binding.context,
                    inputs_digest: &binding.inputs_digest,
                },
            );
            let mut sum = sum.into_sum();
            // Drawn with the sampler the round's inputs digest names
            // (`inputs::bind_gaussian_sampler`).
            noise::add_steps(&mut sum, noise, &seed);
            let values: Vec<f32> = sum
                .iter()
                .map(|&units| grid::to_average(units, privacy.clip_norm, count))
                .collect();
            Ok(Noised {
                values,
                record: noise_record(noise, privacy.clip_norm, count),
                blt_state_out: None,
            })
        }
        Mechanism::Tree { min_separation } => {
            let trees = dp::tree::Trees {
                length: min_separation,
            };
            let (tree, position) = trees.locate(round);
            let weights = trees.release(round);
            let seeded: Vec<_> = weights
                .iter()
                .map(|(node, weight)| {
                    let context = &binding.context;
                    let seed = noise::node_seed(
                        private_key,
                        &context.task_id,
                        &context.policy_sha256,
                        node,
                    );
                    (*weight, seed)
                })
                .collect();
            // Exactly, over the weights' common denominator; then one fixed function of the
            // exact value (to f64, divided, to f32).
            let denominator = trees.denominator();
            let sum = sum.into_sum();
            let values = noise::tree_values(&sum, denominator, noise, &seeded, |exact| {
                let units = exact as f64 / denominator as f64;
                grid::to_average_f64(units, privacy.clip_norm, count)
            });
            drop(sum);
            let shape = TreeShape {
                length: min_separation,
                tree,
                position,
                nodes: weights.len() as u64,
                release_variance: dp::tree::variance(
                    weights.iter().map(|(_, w)| w),
                    trees.denominator(),
                ),
                prefix_variance: dp::tree::variance(
                    trees.prefix(tree, position).values(),
                    trees.denominator(),
                ),
                accounted_depth: dp::tree::depth(trees.planned_rounds(tree, privacy.rounds)).max(1),
            };
            let record = tree_noise_record(
                noise,
                privacy.clip_norm,
                count,
                privacy.mechanism.encode(),
                &shape,
            );
            Ok(Noised {
                values,
                record,
                blt_state_out: None,
            })
        }
        Mechanism::Blt(blt) => {
            let sum = sum.into_sum();
            let (values, record, sealed) = blt_round::release(
                &blt,
                blt_state,
                private_key,
                binding,
                &sum,
                noise,
                privacy.clip_norm,
                count,
                privacy.rounds,
            )?;
            Ok(Noised {
                values,
                record,
                blt_state_out: Some(sealed),
            })
        }
    }
}

/// The noise a distributed round is accounted at: one group's, which must be per-round Gaussian
/// noise of at least the calibrated variance.
fn distributed_scale(
    distributed: DistributedNoise,
    calibrated: DiscreteGaussian,
    mechanism: Mechanism,
) -> Result<DiscreteGaussian, AggregateError> {
    if mechanism != Mechanism::Gaussian {
        return Err(AggregateError::Unsupported(format!(
            "distributed noise is per-round Gaussian noise, not {}",
            mechanism.encode()
        )));
    }
    if distributed.variance < calibrated.variance() {
        return Err(AggregateError::Unsupported(format!(
            "the policy's distributed noise has variance {} per group, below the {} the budget calibrates",
            distributed.variance,
            calibrated.variance()
        )));
    }
    Ok(DiscreteGaussian::with_variance(distributed.variance))
}

/// A distributed round's average: the sum already carries every group's noise (the key services
/// drew it), so the enclave adds none. The record names the mechanism, the variance one group
/// adds (what the accounting rests on) and the standard deviation the release carries (all
/// `groups` draws).
fn distributed_average(
    privacy: &PrivacyParams,
    sum: Accumulator,
    noise: &DiscreteGaussian,
    distributed: DistributedNoise,
    count: u64,
) -> Noised {
    let values: Vec<f32> = sum
        .into_sum()
        .iter()
        .map(|&units| grid::to_average(units, privacy.clip_norm, count))
        .collect();
    let mut record = noise_record(noise, privacy.clip_norm, count);
    let carried = f64::from(distributed.groups).sqrt();
    record.mechanism = confed_worker_api::manifest::DISTRIBUTED_MECHANISM.into();
    record.stddev_sum *= carried;
    record.stddev_average *= carried;
    Noised {
        values,
        record,
        blt_state_out: None,
    }
}

/// The scale every evaluation round of the task is charged at: the one the sampler draws at (the
/// same for every round), whether or not this round evaluates.
fn evaluation_scale(
    evaluation: Option<Evaluation>,
) -> Result<Option<(Evaluation, f64)>, AggregateError> {
    Ok(match evaluation {
        None => None,
        Some(e) => Some((
            e,
            DiscreteGaussian::at_least(
                e.stddev * dp::accounting::EVALUATION_UNITS_PER_EXAMPLE as f64,
            )?
            .scale(),
        )),
    })
}

/// Excluded contributions counted by reason.
/// Adaptive clipping's noised count of the round: `sum(2 b_i - 1) = 2 * unclipped - count` plus
/// discrete Gaussian noise of standard deviation `2 count_stddev` (sensitivity 1), keyed like the
/// round's value noise but under its own label; the fraction it gives and the next round's clip
/// norm. Returns the record and the count noise's scale.
fn adaptive_count(
    params: &AdaptiveClipping,
    private_key: &PrivateKey,
    binding: &Binding,
    clip_norm: f64,
    unclipped: u64,
    count: u64,
) -> Result<(AdaptiveRecord, f64), AggregateError> {
    let noise = DiscreteGaussian::at_least(2.0 * params.count_stddev)?;
    let seed = noise::count_seed(
        private_key,
        &noise::NoiseBinding {
            context: &binding.context,
            inputs_digest: &binding.inputs_digest,
        },
    );
    let signed = 2 * unclipped as i64 - count as i64 + noise::samples(1, &noise, &seed)[0];
    let fraction = ((signed as f64 / count as f64 + 1.0) / 2.0).clamp(0.0, 1.0);
    let record = AdaptiveRecord {
        target_quantile: params.target_quantile,
        learning_rate: params.learning_rate,
        count_stddev: noise.scale() / 2.0,
        unclipped_fraction: fraction,
        next_clip_norm: params.next_clip_norm(clip_norm, fraction),
    };
    Ok((record, noise.scale()))
}
