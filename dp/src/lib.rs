//! Differential-privacy accounting of confed: what a task's plan costs one device, the noise that
//! fits its budget, and whether a plan is usable (`plan`), on the fixed-point grid the enclave sums
//! on (`grid`) and with DP-FTRL's trees (`tree`).
//!
//! Every figure is built from two privacy maps, an `Accountant`'s: the zCDP rho of one grid
//! release and its (epsilon, delta) conversion. The enclave, which calibrates the noise it adds and
//! records what each release spent, uses OpenDP's (`confed_enclave::dp::OpenDp`). The front end,
//! which only refuses a plan that cannot work before any device trains, uses `ClosedForm`, the same
//! published conversion (Canonne, Kamath and Steinke 2020) in plain f64, so that it links no
//! OpenDP; the enclave's tests hold the two to 1e-9 of each other over a grid of budgets
//! (docs/privacy.md, "Accounting").
//!
//! Two parts, behind the feature `noise` (the enclave's and the key services', never the front
//! ends'), sample noise: `exact_sampler`, the exact discrete Gaussian the enclave and the key
//! services draw with, and `distributed`, a masked round's noise that every holder of a mask
//! group adds to that group's mask sums (docs/secure-aggregation.md, "Distributed noise").

#![forbid(unsafe_code)]

pub mod accounting;
pub mod analytics;
pub mod blt;
pub mod blt_accounting;
pub mod blt_optimize;
pub mod calibrate;
pub mod closed_form;
#[cfg(feature = "noise")]
pub mod distributed;
#[cfg(feature = "noise")]
pub mod exact_sampler;
pub mod grid;
pub mod plan;
pub mod running_sum;
pub mod tails;
pub mod tree;

use thiserror::Error;

pub use accounting::{
    SideScales, calibrate_task, calibrated_scale, default_evaluation_stddev, default_health_stddev,
    evaluation_too_noisy, rho_task, spent_task, units_through,
};
pub use calibrate::{
    Calibration, MAX_NOISE_MULTIPLIER, calibrate, calibrate_units, search_scale, spent,
};
pub use closed_form::ClosedForm;
pub use plan::{PlanProblem, check_plan};

/// The two privacy maps of one release of the grid mechanism: discrete Gaussian noise of
/// standard deviation `scale_grid` on a sum of L2 sensitivity `grid::GRID_UNITS_PER_CLIP`.
pub trait Accountant: Sync {
    /// Names the implementation in errors, and keeps calibrations cached apart.
    fn name(&self) -> &'static str;
    /// zCDP rho of one release.
    fn rho_at(&self, scale_grid: f64) -> Result<f64, DpError>;
    /// The smallest epsilon such that one release is (epsilon, `delta`)-DP.
    fn epsilon_at(&self, scale_grid: f64, delta: f64) -> Result<f64, DpError>;
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
    #[error("{accountant} refused: {reason}")]
    Accountant {
        accountant: &'static str,
        reason: String,
    },
}
