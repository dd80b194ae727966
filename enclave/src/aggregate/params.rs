//! The privacy parameters of one round, as the enclave applies them: all from the task policy the
//! contributions are bound to, and the round's choices the store may make (adaptive clipping's
//! clip norm, an on-demand evaluation), checked before any key is asked for.

use super::inputs;
use crate::dp::{self, DiscreteGaussian, DpError};
use crate::policy::TaskPolicy;
use crate::policy::{AdaptiveClipping, DpMechanism, Evaluation, Health, Mechanism, Weighting};

/// The privacy parameters of the task, as the enclave applies them: taken from the task policy
/// the contributions are bound to, never from anywhere else.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrivacyParams {
    pub epsilon: f64,
    pub delta: f64,
    pub clip_norm: f64,
    pub rounds: u32,
    /// Fewest included contributions a release may average.
    pub min_reports: u32,
    pub mechanism: Mechanism,
    /// Adaptive clipping's parameters (then `clip_norm` is this round's, not the policy's).
    pub adaptive: Option<AdaptiveClipping>,
    /// Evaluation's parameters (whether this round evaluates: `evaluation_in`).
    pub evaluation: Option<Evaluation>,
    /// The partner asked to evaluate this round on demand.
    pub on_demand: bool,
    /// The health signal's parameters: every update carries the flag, the count is released.
    pub health: Option<Health>,
    /// Example-weighted averaging: every update carries its example count, and the sum adds each
    /// clipped update times its weight in [0, 1] (the sensitivity is unchanged).
    pub weighting: Option<Weighting>,
}

impl PrivacyParams {
    /// The parameters of one round: all from the policy, except that under adaptive clipping the
    /// clip norm is the round's (`round_clip_norm`, from the job: what the previous release's
    /// manifest gave as `next_clip_norm`). Who chooses it does not matter for privacy (the noise
    /// scales with it and the sensitivity on the grid is one clip norm whatever it is); it is
    /// bound into the release commitment and the noise (`inputs::bind_clip_norm`). A round clip
    /// norm for a policy without adaptive clipping, or none for one with it, is refused.
    ///
    /// `on_demand` (the job's, so the store's word) asks for an evaluation outside the policy's
    /// schedule. The store may ask in any round: what bounds the privacy cost is each device,
    /// which sends metrics in at most `on_demand` such rounds of the task, and the accounting
    /// charges that many (`Evaluation::on_demand_through`). A policy that allows none refuses it.
    pub fn for_round(
        policy: &TaskPolicy,
        round_clip_norm: Option<f64>,
        on_demand: bool,
    ) -> Result<Self, crate::policy::PolicyError> {
        let DpMechanism {
            noise,
            adaptive_clipping,
            evaluation,
            health,
            weighting,
        } = policy.dp_mechanism()?;
        let limits = crate::policy::PolicyError::Limits;
        let clip_norm = match (adaptive_clipping, round_clip_norm) {
            (None, None) => policy.clip_norm,
            (Some(_), Some(c))
                if (crate::policy::MIN_CLIP_NORM..=crate::policy::MAX_CLIP_NORM).contains(&c) =>
            {
                c
            }
            (Some(_), Some(c)) => {
                return Err(limits(format!(
                    "the round's clip norm {c} is outside the policy limits"
                )));
            }
            (Some(_), None) => {
                return Err(limits(
                    "an adaptive-clipping round needs its clip norm in the job".into(),
                ));
            }
            (None, Some(c)) => {
                return Err(limits(format!(
                    "the job names a round clip norm {c}, but the policy does not clip adaptively"
                )));
            }
        };
        // Refused before any key is asked for, like every check here: a BLT lattice too fine
        // for the noise the budget needs would leave the sampler out of its exact range, and a
        // round that could not noise would have its commitment recorded and never release.
        let calibrated_scale = || {
            let mechanism = DpMechanism {
                noise,
                adaptive_clipping,
                evaluation,
                health,
                weighting,
            };
            dp::calibrated_scale(
                &dp::OpenDp,
                mechanism,
                policy.epsilon,
                policy.delta,
                policy.rounds,
            )
        };
        if let Mechanism::Blt(_) = noise {
            let scale = calibrated_scale().map_err(|e| limits(format!("BLT noise: {e}")))?;
            DiscreteGaussian::at_least(scale)
                .map_err(|e| limits(format!("BLT noise on its lattice: {e}")))?;
        }
        // Distributed noise below what the budget calibrates would release a masked round with
        // less noise than its accounting states: refused before any key is asked for.
        if let Some(variance) = policy.masking.as_ref().and_then(|m| m.noise_variance) {
            let calibrated = calibrated_scale()
                .and_then(DiscreteGaussian::at_least)
                .map_err(|e| limits(format!("distributed noise: {e}")))?;
            if variance < calibrated.variance() {
                return Err(limits(format!(
                    "the masking line's distributed noise has variance {variance} per group; the budget needs at least {}",
                    calibrated.variance()
                )));
            }
        }
        // The count's sampler must exist before any key is asked for: a round that could not
        // noise its count would have its commitment recorded and never release.
        if let Some(a) = adaptive_clipping {
            DiscreteGaussian::at_least(2.0 * a.count_stddev)
                .map_err(|e| limits(format!("adaptive clipping's count noise: {e}")))?;
        }
        if on_demand && evaluation.is_none_or(|e| e.on_demand == 0) {
            return Err(limits(
                "the job asks for an on-demand evaluation, but the policy allows none".into(),
            ));
        }
        if let Some(e) = evaluation {
            DiscreteGaussian::at_least(
                e.stddev * dp::accounting::EVALUATION_UNITS_PER_EXAMPLE as f64,
            )
            .map_err(|e| limits(format!("evaluation's noise: {e}")))?;
        }
        if let Some(h) = health {
            DiscreteGaussian::at_least(h.stddev)
                .map_err(|e| limits(format!("the health count's noise: {e}")))?;
        }
        Ok(Self {
            epsilon: policy.epsilon,
            delta: policy.delta,
            clip_norm,
            rounds: policy.rounds,
            min_reports: policy.min_reports,
            mechanism: noise,
            adaptive: adaptive_clipping,
            evaluation,
            on_demand,
            health,
            weighting,
        })
    }

    pub(super) fn dp_mechanism(&self) -> DpMechanism {
        DpMechanism {
            noise: self.mechanism,
            adaptive_clipping: self.adaptive,
            evaluation: self.evaluation,
            health: self.health,
            weighting: self.weighting,
        }
    }

    /// The task's noise calibration: a function of the policy alone, worked out once per
    /// process and policy (`confed_dp`'s cache), so the worker can have it ready before the
    /// round's contributions are in.
    pub fn calibration(&self) -> Result<dp::Calibration, DpError> {
        dp::calibrate_task(
            &dp::OpenDp,
            self.dp_mechanism(),
            self.epsilon,
            self.delta,
            self.rounds,
        )
    }

    /// `inputs_digest` with the round's parameters the store chose bound in (docs/protocol.md,
    /// `inputs_digest`): adaptive clipping's clip norm, an on-demand evaluation. The release
    /// commitment and the noise then differ with either, so a second release of the same inputs
    /// under other choices needs a second commitment, which the key services' ledger refuses.
    pub fn bind_round_choices(&self, inputs_digest: String) -> String {
        let digest = match self.adaptive {
            Some(_) => inputs::bind_clip_norm(&inputs_digest, self.clip_norm),
            None => inputs_digest,
        };
        match self.on_demand {
            true => inputs::bind_on_demand_evaluation(&digest),
            false => digest,
        }
    }

    /// The evaluation round `round` runs, if it is one: scheduled, or asked for on demand.
    pub fn evaluation_in(&self, round: u64) -> Option<Evaluation> {
        self.evaluation
            .filter(|e| e.evaluates(round) || (self.on_demand && e.on_demand > 0))
    }
}
