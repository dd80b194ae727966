//! Central differential privacy inside the enclave: the accounting is confed-dp's (composition,
//! calibration, the grid, DP-FTRL's trees), over OpenDP's privacy maps (`opendp`); the noise
//! itself is sampled here, exactly: in machine words (`sampler`: tree nodes, scalar and analytics
//! draws) or from a step envelope (`sampler_steps`: a Gaussian or BLT round's release), and BLT
//! noise's rounds run here (`blt`).

pub mod blt;
mod exp_bounds;
pub mod opendp;
pub mod sampler;
pub mod sampler_bits;
pub mod sampler_steps;

pub use confed_dp::{
    Calibration, DpError, SideScales, accounting, calibrate_task, calibrated_scale, grid, rho_task,
    spent_task, tree,
};
pub use opendp::OpenDp;
pub use sampler::DiscreteGaussian;
