//! `privacy`: a task's budget, its clip norm and its DP mechanism (Gaussian, tree aggregation or
//! BLT, optionally adaptive clipping), with their validation.

use confed_protocol::blt_noise::{
    BltNoise, DEFAULT_BLT_MAX_VALUES, MAX_BLT_BUFFERS, MAX_BLT_MIN_SEPARATION, MAX_BLT_ROUNDS,
    MAX_BLT_VALUES,
};
use confed_protocol::policy::{
    AdaptiveClipping, DpMechanism, Health, MAX_HEALTH_STDDEV, MAX_MIN_SEPARATION,
    MAX_WEIGHTING_EXAMPLES, MIN_HEALTH_STDDEV, Mechanism, Weighting,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::problems::Problems;
use super::{MAX_CLIP_NORM, MAX_DELTA, MAX_EPSILON, MIN_CLIP_NORM};

/// The task's total differential-privacy budget over all its rounds, and the L2 clipping bound of
/// one device's update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrivacyBudget {
    /// Total over all rounds, (0, 100].
    #[schema(exclusive_minimum = 0.0, maximum = 100.0)]
    pub epsilon: f64,
    /// (0, 0.01].
    #[schema(exclusive_minimum = 0.0, maximum = 0.01)]
    pub delta: f64,
    /// L2 bound of one device's update, [1e-6, 1e6]: required for a training task, refused for
    /// an analytics task (its query's bounds take its place; stored as 1).
    #[serde(default = "no_clip_norm")]
    #[schema(minimum = 0.000001, maximum = 1000000.0)]
    pub clip_norm: f64,
    /// `gaussian` (default: independent noise on every round), `tree_aggregation` (DP-FTRL:
    /// correlated tree noise, devices serve rounds at least `min_separation` apart) or `blt`
    /// (DP-FTRL with buffered linear Toeplitz noise, the same separation; at most 10,000 rounds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mechanism: Option<MechanismName>,
    /// `tree_aggregation` and `blt` only: fewest rounds between two rounds one device serves
    /// (and, for the tree, the length of each noise tree), 1-1024 for the tree, 1-10,000 for BLT
    /// (default: the task's rounds, at most that).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 10000)]
    pub min_separation: Option<u32>,
    /// `blt` only: the noise-correlating matrix and what its rounding is charged for. Every field
    /// is optional; the task as created shows them all as the server resolved them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blt: Option<BltSpec>,
    /// Adaptive clipping (Andrew et al. 2021): `clip_norm` is the first round's, and each round's
    /// moves toward the `target_quantile` of the update norms. Every field is optional:
    /// `target_quantile` in (0, 0.99] (default 0.5), `learning_rate` in (0, 10] (default 0.2),
    /// `count_stddev` in [0.5, 1e6] (default report_goal / 20, at least 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_clipping: Option<AdaptiveClippingSpec>,
    /// The noised health signal (docs/privacy.md, "Health"): every round's release says about
    /// how many devices sent zeros (training failed, ran past its send instant or went
    /// non-finite), with Gaussian noise of `stddev` devices, charged to this budget. Off unless
    /// given; `{}` turns it on with the default `stddev`: the least noise whose counts cost at
    /// most 5 % of the budget, and no less than report_goal / 10 (at least 1). In [1, 1e6].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthSpec>,
    /// Example-weighted averaging (docs/privacy.md, "Weighted averaging"): each device's clipped
    /// update counts `min(examples, max_examples) / max_examples` times, and the noised sum is
    /// divided by the number of included devices as always. The weight is at most 1, so the
    /// noise and the accounting are those of uniform averaging. Off (uniform) unless given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weighting: Option<WeightingSpec>,
}

/// `privacy.clip_norm` left out: a NaN the validation refuses for training tasks (an analytics
/// task's is set to 1 before anything reads it).
fn no_clip_norm() -> f64 {
    f64::NAN
}

/// `privacy.weighting`: `{"by": "examples", "max_examples": <1-1000000>}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WeightingSpec {
    /// What a device's weight counts: `examples` (the examples its update trained on).
    pub by: WeightBy,
    /// Examples at which a device's weight reaches 1 (devices with more count as this many),
    /// 1-1000000. Choose about the typical device's count: the release's scale is the mean
    /// weight times the example-weighted average (docs/privacy.md, "Weighted averaging").
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub max_examples: i64,
}

/// `privacy.weighting.by`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightBy {
    Examples,
}

impl WeightingSpec {
    /// The policy's weighting (a validated spec's `max_examples` is in range).
    pub fn policy(&self) -> Weighting {
        Weighting {
            max_examples: u32::try_from(self.max_examples).unwrap_or(1),
        }
    }
}

/// `privacy.health`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1.0, maximum = 1000000.0)]
    pub stddev: Option<f64>,
}

impl HealthSpec {
    /// The policy's health signal (a validated spec has its stddev filled in).
    pub fn policy(&self) -> Health {
        Health {
            stddev: self.stddev.unwrap_or(MIN_HEALTH_STDDEV),
        }
    }
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

/// `privacy.blt` (docs/privacy.md, "DP-FTRL with BLT noise").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BltSpec {
    /// The running-sum error the server's matrix minimizes: `max` over the rounds (default) or
    /// `mean`. Ignored when `buffers` are given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<BltErrorName>,
    /// The matrix `C` as `[decay, scale]` pairs, 0-10 of them: decays in (0, 1) decreasing,
    /// scales positive with sum at most 1 and `sum(scale / decay) < 1`. Absent: optimized by the
    /// server for the task's rounds and min_separation (as jax_privacy's
    /// `buffered_toeplitz.optimize`). Stored rounded to multiples of 2^-52.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_items = 10)]
    pub buffers: Option<Vec<[f64; 2]>>,
    /// Most values the task's model may have, 1 to 2^32 (default 2^24): the accounting charges
    /// the release's rounding for this many, and the enclave refuses a larger model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 4294967296_u64)]
    pub max_values: Option<u64>,
    /// Set by the server (refused in a request): the noise lattice, `2^lattice_bits` units per
    /// grid unit, the finest the budget's noise allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lattice_bits: Option<u32>,
}

/// `privacy.blt.error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BltErrorName {
    Max,
    Mean,
}

/// The DP mechanisms a task may choose (docs/privacy.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MechanismName {
    Gaussian,
    TreeAggregation,
    Blt,
}

impl PrivacyBudget {
    /// The noise mechanism the task policy names. A BLT spec is resolved at creation
    /// (`resolve_blt`); one that does not make a valid BLT (a stored spec rewritten in the
    /// database) names the Gaussian mechanism instead, logged: still private at the budget, and
    /// its policy is not the one devices agreed to, so nothing they sealed opens under it.
    pub fn mechanism(&self) -> Mechanism {
        match self.mechanism {
            Some(MechanismName::TreeAggregation) => Mechanism::Tree {
                min_separation: self.min_separation.unwrap_or(MAX_MIN_SEPARATION),
            },
            Some(MechanismName::Blt) => match self.blt_noise() {
                Ok(blt) => Mechanism::Blt(blt),
                Err(why) => {
                    tracing::error!(%why, "a stored BLT spec is not valid");
                    Mechanism::Gaussian
                }
            },
            _ => Mechanism::Gaussian,
        }
    }

    /// Whether the task's policy runs BLT noise: what the store goes by (a stored spec that
    /// names BLT but does not make one names the Gaussian mechanism, `mechanism`).
    pub fn is_blt(&self) -> bool {
        matches!(self.mechanism(), Mechanism::Blt(_))
    }

    /// Whether the request names BLT (before its matrix is resolved).
    pub fn names_blt(&self) -> bool {
        self.mechanism == Some(MechanismName::Blt)
    }

    fn blt_noise(&self) -> Result<BltNoise, String> {
        let spec = self.blt.as_ref().ok_or("no `blt` parameters")?;
        let buffers = spec.buffers.as_ref().ok_or("no `blt.buffers`")?;
        let (decays, scales): (Vec<f64>, Vec<f64>) = buffers.iter().map(|[t, w]| (*t, *w)).unzip();
        BltNoise::new(
            self.min_separation.ok_or("no `min_separation`")?,
            &decays,
            &scales,
            spec.max_values.unwrap_or(DEFAULT_BLT_MAX_VALUES),
            spec.lattice_bits.ok_or("no `blt.lattice_bits`")?,
        )
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
    let mut validated = PrivacyBudget {
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
            Some(name @ (MechanismName::TreeAggregation | MechanismName::Blt)) => {
                let most = match name {
                    MechanismName::Blt => MAX_BLT_MIN_SEPARATION,
                    _ => MAX_MIN_SEPARATION,
                };
                let given = given.min_separation.unwrap_or(rounds.clamp(1, most));
                Some(p.int(
                    "privacy.min_separation",
                    i64::from(given),
                    1,
                    i64::from(most),
                ))
            }
            _ => {
                if given.min_separation.is_some() {
                    p.add(
                        "privacy.min_separation",
                        "applies to `\"mechanism\": \"tree_aggregation\"` and `\"blt\"` only; set the mechanism or leave it out",
                    );
                }
                None
            }
        },
        blt: validate_blt(p, given, rounds),
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
        health: None,
        weighting: given.weighting.map(|w| WeightingSpec {
            by: w.by,
            max_examples: i64::from(p.int(
                "privacy.weighting.max_examples",
                w.max_examples,
                1,
                i64::from(MAX_WEIGHTING_EXAMPLES),
            )),
        }),
    };
    // After the rest: the default noise depends on the validated separation.
    validated.health = given.health.map(|h| HealthSpec {
        stddev: Some(
            p.float(
                "privacy.health.stddev",
                h.stddev
                    .unwrap_or_else(|| default_health_stddev(&validated, rounds, report_goal)),
                MIN_HEALTH_STDDEV,
                false,
                MAX_HEALTH_STDDEV,
            ),
        ),
    });
    validated
}

/// `evaluation.stddev` when not given: `confed_dp::default_evaluation_stddev` for the validated
/// budget and the evaluations a device may be in through the task's rounds (`schedule`: every,
/// on_demand, max_examples; as the enclave charges them); a budget that does not calibrate
/// (refused elsewhere) gets report_goal x max_examples / 100.
pub(super) fn default_evaluation_stddev(
    validated: &PrivacyBudget,
    rounds: u32,
    report_goal: u32,
    (every, on_demand, max_examples): (u32, u32, u32),
) -> f64 {
    let noise = separation_noise(validated, rounds);
    let schedule = confed_protocol::policy::Evaluation {
        every,
        max_loss: 1.0,
        max_examples,
        stddev: 1.0,
        on_demand,
    };
    let evaluations =
        confed_dp::accounting::evaluations_through(noise, &schedule, u64::from(rounds.max(1)));
    confed_dp::default_evaluation_stddev(
        &confed_dp::ClosedForm,
        validated.epsilon,
        validated.delta,
        evaluations,
        max_examples,
        report_goal,
    )
    .unwrap_or(f64::from(report_goal) * f64::from(max_examples) / 100.0)
}

/// The noise whose separation the side releases' defaults count with: the tree's for DP-FTRL
/// (the BLT's matrix is not resolved yet, and only its separation counts here), else Gaussian.
fn separation_noise(validated: &PrivacyBudget, rounds: u32) -> Mechanism {
    match validated.mechanism {
        Some(MechanismName::TreeAggregation | MechanismName::Blt) => Mechanism::Tree {
            min_separation: validated.min_separation.unwrap_or(rounds).max(1),
        },
        _ => Mechanism::Gaussian,
    }
}

/// `privacy.health.stddev` when not given: `confed_dp::default_health_stddev` for the validated
/// budget and the counts a device may be in through the task's rounds (one per round, one per
/// `min_separation` rounds begun under DP-FTRL: `counts_through`, as the enclave charges); a
/// budget that does not calibrate (refused elsewhere) gets report_goal / 10.
fn default_health_stddev(validated: &PrivacyBudget, rounds: u32, report_goal: u32) -> f64 {
    let noise = separation_noise(validated, rounds);
    let counts = confed_dp::accounting::counts_through(noise, u64::from(rounds.max(1)));
    confed_dp::default_health_stddev(
        &confed_dp::ClosedForm,
        validated.epsilon,
        validated.delta,
        counts,
        report_goal,
    )
    .unwrap_or((f64::from(report_goal) / 10.0).max(MIN_HEALTH_STDDEV))
    .min(MAX_HEALTH_STDDEV)
}

/// Checks `privacy.blt` as given (the matrix is resolved later, `resolve_blt`, once the whole
/// request is valid).
fn validate_blt(p: &mut Problems, given: &PrivacyBudget, rounds: u32) -> Option<BltSpec> {
    if !given.names_blt() {
        if given.blt.is_some() {
            p.add(
                "privacy.blt",
                "applies to `\"mechanism\": \"blt\"` only; set the mechanism or leave it out",
            );
        }
        return None;
    }
    if rounds > MAX_BLT_ROUNDS {
        p.add(
            "rounds",
            format!(
                "a BLT task plans at most {MAX_BLT_ROUNDS} rounds; plan fewer or use tree_aggregation"
            ),
        );
    }
    let spec = given.blt.clone().unwrap_or(BltSpec {
        error: None,
        buffers: None,
        max_values: None,
        lattice_bits: None,
    });
    if spec.lattice_bits.is_some() {
        p.add(
            "privacy.blt.lattice_bits",
            "is chosen by the server for the budget; leave it out",
        );
    }
    if let Some(buffers) = &spec.buffers {
        let (decays, scales): (Vec<f64>, Vec<f64>) = buffers.iter().map(|[t, w]| (*t, *w)).unzip();
        let quantize = confed_protocol::blt_noise::quantize;
        let decays: Vec<f64> = decays.into_iter().map(quantize).collect();
        let scales: Vec<f64> = scales.into_iter().map(quantize).collect();
        if buffers.len() > MAX_BLT_BUFFERS {
            p.add(
                "privacy.blt.buffers",
                format!("at most {MAX_BLT_BUFFERS} [decay, scale] pairs"),
            );
        } else if let Err(why) = BltNoise::new(1, &decays, &scales, 1, 0) {
            p.add("privacy.blt.buffers", why);
        }
    }
    let max_values = spec.max_values.unwrap_or(DEFAULT_BLT_MAX_VALUES);
    if !(1..=MAX_BLT_VALUES).contains(&max_values) {
        p.add(
            "privacy.blt.max_values",
            format!("must be between 1 and {MAX_BLT_VALUES} (got {max_values})"),
        );
    }
    Some(BltSpec {
        error: Some(spec.error.unwrap_or(BltErrorName::Max)),
        buffers: spec.buffers,
        max_values: Some(max_values),
        lattice_bits: None,
    })
}

/// Fills in a valid BLT request's matrix (given, rounded to 2^-52, or optimized: up to seconds
/// the first time for a shape, so task creation runs on a blocking thread) and its lattice:
/// the finest for the budget's nominal noise, coarsened until the whole calibration (rounding,
/// adaptive clipping's and evaluation's shares included) fits the exact sampler. The calibration
/// is the closed form's, which OpenDP's maps in the enclave match to 1e-9 (the lattice leaves
/// 1e-6 of room).
pub(super) fn resolve_blt(
    privacy: &mut PrivacyBudget,
    mechanism: DpMechanism,
    rounds: u32,
) -> Result<(), String> {
    use confed_dp::blt::{Blt, ErrorKind};
    use confed_dp::blt_accounting::{fit_lattice, task_blt};
    let Some(spec) = privacy.blt.as_mut() else {
        return Ok(());
    };
    let explicit = spec.buffers.as_ref().map(|buffers| {
        let (decays, scales) = buffers.iter().map(|[t, w]| (*t, *w)).unzip();
        Blt::new(decays, scales)
    });
    let error = match spec.error {
        Some(BltErrorName::Mean) => ErrorKind::Mean,
        _ => ErrorKind::Max,
    };
    let min_separation = privacy.min_separation.unwrap_or(rounds);
    let accountant = confed_dp::ClosedForm;
    let blt = task_blt(
        &accountant,
        privacy.epsilon,
        privacy.delta,
        rounds,
        min_separation,
        error,
        explicit.as_ref(),
        spec.max_values.unwrap_or(DEFAULT_BLT_MAX_VALUES),
    )
    .map_err(|e| e.to_string())?;
    let fitted = fit_lattice(
        &accountant,
        DpMechanism {
            noise: Mechanism::Blt(blt),
            ..mechanism
        },
        privacy.epsilon,
        privacy.delta,
        rounds,
    )
    .map_err(|e| e.to_string())?;
    let Mechanism::Blt(blt) = fitted.noise else {
        return Err("the BLT was lost fitting its lattice (a bug)".into());
    };
    spec.buffers = Some(
        blt.decays()
            .into_iter()
            .zip(blt.scales())
            .map(|(t, w)| [t, w])
            .collect(),
    );
    spec.lattice_bits = Some(blt.lattice_bits);
    Ok(())
}
