//! Central differential privacy inside the enclave: calibration and accounting with OpenDP
//! (`calibrate`), the fixed-point grid updates are summed on (`grid`), and a fast exact discrete
//! Gaussian sampler in machine words (`sampler`).

pub mod calibrate;
pub mod grid;
pub mod plan;
pub mod sampler;
pub mod tree;

use thiserror::Error;

pub use calibrate::{Calibration, calibrate, spent};
pub use plan::{PlanProblem, check_plan};
pub use sampler::DiscreteGaussian;

use confed_protocol::policy::Mechanism;

/// Gaussian releases at the mechanism's noise scale (one per round for `Gaussian`, one per
/// complete node over a device's round for `Tree`) that rounds `1..=round` cost one device at
/// most: what calibration and accounting compose in zCDP.
pub fn releases_through(mechanism: Mechanism, round: u64) -> u64 {
    match mechanism {
        Mechanism::Gaussian => round,
        Mechanism::Tree { min_separation } => tree::Trees {
            length: min_separation,
        }
        .releases_through(round),
    }
}

/// The calibration of a task's planned rounds under `mechanism`.
pub fn calibrate_mechanism(
    mechanism: Mechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<Calibration, DpError> {
    let releases = u32::try_from(releases_through(mechanism, u64::from(rounds)))
        .map_err(|_| DpError::InvalidBudget(format!("{rounds} rounds are too many")))?;
    calibrate(epsilon, delta, releases)
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum DpError {
    #[error("invalid privacy budget: {0}")]
    InvalidBudget(String),
    #[error(
        "epsilon {epsilon} at delta {delta} needs more noise than the exact sampler supports; raise epsilon or delta, or plan fewer rounds"
    )]
    BudgetTooSmall { epsilon: f64, delta: f64 },
    #[error("noise scale {0} (grid units) is outside the sampler's exact range")]
    ScaleOutOfRange(f64),
    #[error("OpenDP refused: {0}")]
    OpenDp(String),
}
