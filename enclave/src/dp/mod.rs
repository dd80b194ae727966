//! Central differential privacy inside the enclave: calibration and accounting with OpenDP
//! (`calibrate`), the fixed-point grid updates are summed on (`grid`), and a fast exact discrete
//! Gaussian sampler in machine words (`sampler`).

pub mod accounting;
pub mod calibrate;
pub mod grid;
pub mod plan;
pub mod sampler;
pub mod tree;

use thiserror::Error;

pub use calibrate::{Calibration, calibrate, spent};
pub use plan::{PlanProblem, check_plan};
pub use sampler::DiscreteGaussian;

pub use accounting::{SideScales, calibrate_task, releases_through, spent_task};

/// The calibration of a task's planned rounds under a noise mechanism without adaptive clipping.
pub fn calibrate_mechanism(
    mechanism: confed_protocol::policy::Mechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<Calibration, DpError> {
    calibrate_task(
        confed_protocol::policy::DpMechanism::plain(mechanism),
        epsilon,
        delta,
        rounds,
    )
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
