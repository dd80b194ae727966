//! `privacy`: a task's budget, its clip norm and its DP mechanism (Gaussian or tree aggregation,
//! optionally adaptive clipping), with their validation.

use confed_protocol::policy::{AdaptiveClipping, MAX_MIN_SEPARATION, Mechanism};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::problems::Problems;
use super::{MAX_CLIP_NORM, MAX_DELTA, MAX_EPSILON, MIN_CLIP_NORM};

/// The task's total differential-privacy budget over all its rounds, and the L2 clipping bound of
/// one device's update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrivacyBudget {
    /// Total over all rounds, (0, 100].
    #[schema(exclusive_minimum = 0.0, maximum = 100.0)]
    pub epsilon: f64,
    /// (0, 0.01].
    #[schema(exclusive_minimum = 0.0, maximum = 0.01)]
    pub delta: f64,
    /// L2 bound of one device's update, [1e-6, 1e6].
    #[schema(minimum = 0.000001, maximum = 1000000.0)]
    pub clip_norm: f64,
    /// `gaussian` (default: independent noise on every round) or `tree_aggregation` (DP-FTRL:
    /// correlated tree noise, devices serve rounds at least `min_separation` apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mechanism: Option<MechanismName>,
    /// `tree_aggregation` only: fewest rounds between two rounds one device serves, and the
    /// length of each noise tree, 1-1024 (default: the task's rounds, at most 1024).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1024)]
    pub min_separation: Option<u32>,
    /// Adaptive clipping (Andrew et al. 2021): `clip_norm` is the first round's, and each round's
    /// moves toward the `target_quantile` of the update norms. Every field is optional:
    /// `target_quantile` in (0, 0.99] (default 0.5), `learning_rate` in (0, 10] (default 0.2),
    /// `count_stddev` in [0.5, 1e6] (default report_goal / 20, at least 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_clipping: Option<AdaptiveClippingSpec>,
}

/// `privacy.adaptive_clipping`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveClippingSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 0.99)]
    pub target_quantile: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 10.0)]
    pub learning_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.5, maximum = 1000000.0)]
    pub count_stddev: Option<f64>,
}

/// The DP mechanisms a task may choose (docs/privacy.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MechanismName {
    Gaussian,
    TreeAggregation,
}

impl PrivacyBudget {
    /// The noise mechanism the task policy names.
    pub fn mechanism(&self) -> Mechanism {
        match self.mechanism {
            Some(MechanismName::TreeAggregation) => Mechanism::Tree {
                min_separation: self.min_separation.unwrap_or(MAX_MIN_SEPARATION),
            },
            _ => Mechanism::Gaussian,
        }
    }
}

impl AdaptiveClippingSpec {
    /// The policy's adaptive clipping (a validated spec has every field filled in).
    pub fn policy(&self) -> AdaptiveClipping {
        AdaptiveClipping {
            target_quantile: self.target_quantile.unwrap_or(0.5),
            learning_rate: self.learning_rate.unwrap_or(0.2),
            count_stddev: self.count_stddev.unwrap_or(1.0),
        }
    }
}

/// Checks `privacy`: every field in range, defaults filled in, every problem recorded.
pub(super) fn validate(
    p: &mut Problems,
    given: &PrivacyBudget,
    rounds: u32,
    report_goal: u32,
) -> PrivacyBudget {
    PrivacyBudget {
        epsilon: p.float("privacy.epsilon", given.epsilon, 0.0, true, MAX_EPSILON),
        delta: p.float("privacy.delta", given.delta, 0.0, true, MAX_DELTA),
        clip_norm: p.float(
            "privacy.clip_norm",
            given.clip_norm,
            MIN_CLIP_NORM,
            false,
            MAX_CLIP_NORM,
        ),
        mechanism: given.mechanism,
        min_separation: match given.mechanism {
            Some(MechanismName::TreeAggregation) => {
                let default = rounds.clamp(1, MAX_MIN_SEPARATION);
                let given = given.min_separation.unwrap_or(default);
                Some(p.int(
                    "privacy.min_separation",
                    i64::from(given),
                    1,
                    i64::from(MAX_MIN_SEPARATION),
                ))
            }
            _ => {
                if given.min_separation.is_some() {
                    p.add(
                        "privacy.min_separation",
                        "applies to `\"mechanism\": \"tree_aggregation\"` only; set the mechanism or leave it out",
                    );
                }
                None
            }
        },
        adaptive_clipping: given.adaptive_clipping.map(|a| AdaptiveClippingSpec {
            target_quantile: Some(p.float(
                "privacy.adaptive_clipping.target_quantile",
                a.target_quantile.unwrap_or(0.5),
                0.0,
                true,
                0.99,
            )),
            learning_rate: Some(p.float(
                "privacy.adaptive_clipping.learning_rate",
                a.learning_rate.unwrap_or(0.2),
                0.0,
                true,
                10.0,
            )),
            count_stddev: Some(
                p.float(
                    "privacy.adaptive_clipping.count_stddev",
                    a.count_stddev
                        .unwrap_or((f64::from(report_goal) / 20.0).max(0.5)),
                    0.5,
                    false,
                    1e6,
                ),
            ),
        }),
    }
}
