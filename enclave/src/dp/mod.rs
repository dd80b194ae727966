//! Central differential privacy inside the enclave: calibration and accounting with OpenDP
//! (`calibrate`), the fixed-point grid updates are summed on (`grid`), and a fast exact discrete
//! Gaussian sampler in machine words (`sampler`).

pub mod calibrate;
pub mod grid;
pub mod plan;
pub mod sampler;

use thiserror::Error;

pub use calibrate::{Calibration, calibrate, spent};
pub use plan::{PlanProblem, check_plan};
pub use sampler::DiscreteGaussian;

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
