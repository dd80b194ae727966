//! Builds the noise part of a release's manifest (the manifest's format is the worker API's,
//! `confed_worker_api::manifest`).

pub use confed_worker_api::manifest::{
    AdaptiveRecord, BltRecord, EvaluationRecord, FORMAT, HealthRecord, Manifest, NoiseRecord,
    PrivacyRecord, TreeRecord,
};

use crate::dp::{DiscreteGaussian, grid};

/// The record of a plain Gaussian release of `count` contributions.
pub fn noise_record(noise: &DiscreteGaussian, clip_norm: f64, count: u64) -> NoiseRecord {
    let stddev_sum = noise.scale() * clip_norm / grid::GRID_UNITS_PER_CLIP as f64;
    NoiseRecord {
        mechanism: "discrete_gaussian_on_grid".into(),
        grid_units_per_clip: grid::GRID_UNITS_PER_CLIP,
        variance_grid: noise.variance(),
        stddev_sum,
        stddev_average: stddev_sum / count as f64,
        tree: None,
        blt: None,
    }
}

/// The record of a tree release of `shape`.
pub fn tree_noise_record(
    noise: &DiscreteGaussian,
    clip_norm: f64,
    count: u64,
    mechanism: String,
    shape: &TreeShape,
) -> NoiseRecord {
    let node_stddev_sum = noise.scale() * clip_norm / grid::GRID_UNITS_PER_CLIP as f64;
    let stddev_sum = node_stddev_sum * shape.release_variance.sqrt();
    NoiseRecord {
        mechanism,
        grid_units_per_clip: grid::GRID_UNITS_PER_CLIP,
        variance_grid: noise.variance(),
        stddev_sum,
        stddev_average: stddev_sum / count as f64,
        tree: Some(TreeRecord {
            length: shape.length,
            tree: shape.tree,
            position: shape.position,
            nodes: shape.nodes,
            prefix_stddev_sum: node_stddev_sum * shape.prefix_variance.sqrt(),
            accounted_stddev_sum: Some(node_stddev_sum / f64::from(shape.accounted_depth).sqrt()),
            accounted_depth: Some(shape.accounted_depth),
        }),
        blt: None,
    }
}

/// Where a tree release sits and how much noise it carries, in raw node variances.
#[derive(Debug, Clone, PartialEq)]
pub struct TreeShape {
    pub length: u32,
    pub tree: u64,
    pub position: u64,
    pub nodes: u64,
    pub release_variance: f64,
    pub prefix_variance: f64,
    /// `dp::tree::depth` of the tree's planned rounds (at least 1).
    pub accounted_depth: u32,
}
