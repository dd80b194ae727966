//! Whether a task's planned rounds fit its privacy budget with a usable noise scale: checked when
//! a partner creates the task, so a plan that cannot work is refused before any device trains.
//!
//! "Usable" is a floor, not a guarantee of accuracy: the noise added to each coordinate of the
//! *averaged* update (sigma / report_goal, in units of the clip norm) must not exceed
//! `MAX_AVERAGE_NOISE_PER_CLIP`. Above it a single coordinate's noise is larger than the whole
//! of any device's clipped update, and no model learns from that.

use confed_protocol::policy::DpMechanism;

use super::accounting::max_noise_multiplier;
use super::calibrate::MAX_NOISE_MULTIPLIER;
use super::{Accountant, Calibration, DpError, calibrate_task};

/// Noise standard deviation per coordinate of the averaged update, in clip norms, at most.
pub const MAX_AVERAGE_NOISE_PER_CLIP: f64 = 1.0;

/// Why a plan cannot work, with what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanProblem {
    #[error("{0}")]
    Budget(#[from] DpError),
    #[error(
        "epsilon {epsilon} (delta {delta}) over {rounds} rounds needs noise of {noise_multiplier:.3} clip norms per round; averaged over report_goal {report_goal} devices that is {per_average:.3} clip norms on every coordinate, above the usable limit of {limit}. Raise report_goal to at least {needed_goal}, raise epsilon, or plan fewer rounds (clip_norm does not change this ratio; it sets the absolute scale of both updates and noise)"
    )]
    TooNoisy {
        epsilon: f64,
        delta: f64,
        rounds: u32,
        report_goal: u32,
        noise_multiplier: f64,
        per_average: f64,
        limit: f64,
        needed_goal: u64,
    },
}

/// The calibration a plan gets, or why it cannot work. For the tree mechanism the limit applies
/// to each node's noise (the running sum's noise is a few node scales; docs/privacy.md), for
/// BLT to each round's fresh noise `z_t`.
pub fn check_plan(
    accountant: &dyn Accountant,
    mechanism: DpMechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
    report_goal: u32,
) -> Result<Calibration, PlanProblem> {
    let calibration = calibrate_task(accountant, mechanism, epsilon, delta, rounds)?;
    let z = calibration.noise_multiplier;
    // A hair below the sampler's limit: accountants agree to 1e-9, not to the last bit, and a
    // plan the enclave could not sample for must be refused here, never accepted.
    let most = MAX_NOISE_MULTIPLIER.min(max_noise_multiplier(mechanism.noise));
    if z > most * (1.0 - 1e-6) {
        return Err(DpError::BudgetTooSmall { epsilon, delta }.into());
    }
    let per_average = z / f64::from(report_goal.max(1));
    if per_average > MAX_AVERAGE_NOISE_PER_CLIP {
        return Err(PlanProblem::TooNoisy {
            epsilon,
            delta,
            rounds,
            report_goal,
            noise_multiplier: z,
            per_average,
            limit: MAX_AVERAGE_NOISE_PER_CLIP,
            needed_goal: (z / MAX_AVERAGE_NOISE_PER_CLIP).ceil() as u64,
        });
    }
    Ok(calibration)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClosedForm;

    const GAUSSIAN: DpMechanism = DpMechanism {
        noise: confed_protocol::policy::Mechanism::Gaussian,
        adaptive_clipping: None,
        evaluation: None,
        health: None,
        weighting: None,
    };

    #[test]
    fn a_plan_with_too_few_reports_names_the_report_goal_it_needs() {
        // epsilon 1 over 10 rounds: sigma ~ 14.3 clip norms per round.
        let err = check_plan(&ClosedForm, GAUSSIAN, 1.0, 1e-6, 10, 5).unwrap_err();
        let PlanProblem::TooNoisy { needed_goal, .. } = &err else {
            panic!("{err}")
        };
        assert_eq!(*needed_goal, 15);
        assert!(err.to_string().contains("Raise report_goal to at least 15"));
        assert!(check_plan(&ClosedForm, GAUSSIAN, 1.0, 1e-6, 10, 15).is_ok());
    }
}
