//! The manifest released with every round's noised average: what went in, what was left out and
//! why, and what the release cost in privacy. Stored next to the average, never overwritten.
//! The enclave writes it (`confed_enclave::aggregate`); the front end stores, shows and checks it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const FORMAT: &str = "confed-release/v2";

/// `NoiseRecord::mechanism` of a masked round with distributed noise: the key services drew it
/// (docs/secure-aggregation.md, "Distributed noise"), the enclave none.
pub const DISTRIBUTED_MECHANISM: &str = "distributed_discrete_gaussian_on_grid";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub task_id: String,
    pub round: u64,
    pub key_id: String,
    /// SHA-256 (hex) of the task policy text the contributions were sealed under.
    pub policy_sha256: String,
    /// SHA-256 (hex) of the model version the round trained from.
    pub model_sha256: String,
    /// Contributions in the sum (the average's denominator).
    pub included: u64,
    /// Tasks requiring device tokens only: the included contributions whose token the enclave
    /// verified (all of them: an unauthenticated one is excluded as `unauthenticated`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authenticated: Option<u64>,
    /// SHA-256 (hex) over the sorted refs of the included contributions, one per line.
    pub included_digest: String,
    /// BLAKE3 (hex) over the stored bytes of every contribution the job was given, valid or not
    /// (see `confed_enclave::aggregate::inputs`): what the noise and the release commitment are keyed by.
    pub inputs_digest: String,
    /// Excluded contributions per reason.
    pub excluded: BTreeMap<String, u64>,
    /// (assignment ref, reason) of the first 1000 excluded contributions.
    pub excluded_refs: Vec<(String, String)>,
    pub clip_norm: f64,
    pub noise: NoiseRecord,
    pub privacy: PrivacyRecord,
    /// Adaptive clipping only: the round's noised fraction of unclipped updates and the clip
    /// norm it gives the next round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_clipping: Option<AdaptiveRecord>,
    /// Evaluation rounds only: the noised metrics of the model version the round trained from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationRecord>,
    /// Tasks whose policy names `health` only: how many of the round's devices sent zeros, noised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthRecord>,
    /// Analytics tasks only: the query and what its release carries (the released histogram or
    /// quantiles are the release's bytes, in the average's place: `AnalyticsRecord`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub analytics: Option<AnalyticsRecord>,
    /// Masked rounds only (docs/secure-aggregation.md): the enclave held masked updates only and
    /// removed the masks with the key services' mask sums.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masking: Option<MaskingRecord>,
    /// SHA-256 (hex) of the released average's bytes (an analytics task's: of its result).
    pub average_sha256: String,
}

/// How a masked round's masks were removed (docs/secure-aggregation.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaskingRecord {
    /// `confed-masking/v1`.
    pub scheme: String,
    /// The key services `n`, their threshold `t` and the quorum `q` of the layout.
    pub services: u8,
    pub threshold: u8,
    pub quorum: u8,
    /// The layout's groups: seeds per device.
    pub groups: u32,
    /// The key services whose mask sums were removed (1-based, ascending).
    pub answered: Vec<u8>,
    /// Distributed noise only: the integer variance (grid units squared) of the discrete
    /// Gaussian each group's holders added. The release carries `groups` such draws; the
    /// accounting rests on one, which no `q - 1` key services and the enclave together know.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_variance_grid: Option<u64>,
}

/// The analytics part of a release's manifest (docs/analytics.md): the query the task policy
/// names, and the noise and threshold its result was released with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AnalyticsRecord {
    /// The task policy's `analytics=` value.
    pub query: String,
    /// L2 sensitivity of one device's answer to the round's histogram (or tree).
    pub sensitivity: f64,
    /// The integer variance of the noise on every released value, and its square root.
    pub noise_variance: u64,
    pub noise_stddev: f64,
    /// Open domains: keys are released when their noised count is at least `threshold`; the
    /// delta that adds to the round (with the distinct-key check's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold_delta: Option<f64>,
    /// Open domains: the round's count of distinct keys, noised (standard deviation
    /// `distinct_keys_stddev`), and how many keys passed the threshold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct_keys: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distinct_keys_stddev: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_keys: Option<u64>,
}

impl Manifest {
    /// A stored manifest read back whole (the demo's summary), or why it is not one.
    pub fn from_json(json: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// The next round's clip norm a stored manifest names (adaptive clipping), read on its
    /// own: a field elsewhere that does not parse (a number the enclave wrote as null) does
    /// not hide it.
    pub fn next_clip_norm_of(json: &str) -> Option<f64> {
        #[derive(Deserialize)]
        struct Adaptive {
            next_clip_norm: f64,
        }
        #[derive(Deserialize)]
        struct Parts {
            adaptive_clipping: Option<Adaptive>,
        }
        let parts: Parts = serde_json::from_str(json).ok()?;
        Some(parts.adaptive_clipping?.next_clip_norm)
    }

    /// The BLAKE3 (hex, as written) of the sealed BLT state a stored manifest says its round
    /// left, read on its own like `next_clip_norm_of`.
    pub fn blt_state_out_of(json: &str) -> Option<String> {
        #[derive(Deserialize)]
        struct Blt {
            state_out_blake3: String,
        }
        #[derive(Deserialize)]
        struct Noise {
            blt: Option<Blt>,
        }
        #[derive(Deserialize)]
        struct Parts {
            noise: Noise,
        }
        let parts: Parts = serde_json::from_str(json).ok()?;
        Some(parts.noise.blt?.state_out_blake3)
    }

    /// The evaluation a stored manifest records, if its round evaluated, read on its own like
    /// `next_clip_norm_of`.
    pub fn evaluation_of(json: &str) -> Option<EvaluationRecord> {
        #[derive(Deserialize)]
        struct Parts {
            evaluation: Option<EvaluationRecord>,
        }
        let parts: Parts = serde_json::from_str(json).ok()?;
        parts.evaluation
    }

    /// The manifest file's bytes (pretty JSON, fields in declaration order): what the enclave
    /// signs (by SHA-256) and what the store writes, byte for byte.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("a manifest serializes")
    }
}

/// The noised health signal of a round (docs/privacy.md, "Health"): the count of included
/// contributions whose device sent zeros in place of its trained update (its health flag, or
/// values that were not finite), plus discrete Gaussian noise. Never exact: whether one device's
/// training failed is a bit its data can decide.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthRecord {
    /// The noised count, in devices. Unbiased, so it may lie below 0 or above `included`: read
    /// it as `zeroed +- 2 stddev`, or sum it over rounds.
    pub zeroed: i64,
    /// Standard deviation of its noise, in devices (the sampler's, at least the policy's).
    pub stddev: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoiseRecord {
    /// `discrete_gaussian_on_grid`: integer noise on the fixed-point grid;
    /// `DISTRIBUTED_MECHANISM`: the same, drawn by the key services of a masked round (then
    /// `variance_grid` is one group's draw, `stddev_sum` all of them).
    pub mechanism: String,
    /// Grid units per clip norm.
    pub grid_units_per_clip: i64,
    /// The integer variance of the noise, in grid units squared.
    pub variance_grid: u64,
    /// Standard deviation of the noise on each coordinate of the sum, in update units.
    pub stddev_sum: f64,
    /// ... and on each coordinate of the released average.
    pub stddev_average: f64,
    /// The tree mechanism only: where this release sits in its tree, and the noise of the running
    /// sum it completes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree: Option<TreeRecord>,
    /// BLT noise only (docs/privacy.md, "DP-FTRL with BLT noise"): the lattice, the state the
    /// round continued and the one it left, and the noise of the running sum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blt: Option<BltRecord>,
}

/// BLT noise's record of a release. `variance_grid` is then the variance of the fresh noise
/// `z_t` in lattice units squared (`2^lattice_bits` lattice units per grid unit); `stddev_sum`
/// is the noise this release carries, `C^-1 z` at this round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BltRecord {
    /// Buffers of the noise-correlating matrix `C` (`[decay, scale]` pairs, the policy's).
    pub buffers: u32,
    /// Lattice units per grid unit, as a power of two.
    pub lattice_bits: u32,
    /// Most values a model of the task may have (what the rounding is charged for).
    pub max_values: u64,
    /// BLAKE3 (hex) of the sealed state this round continued: round `round - 1`'s
    /// `state_out_blake3`; absent in round 1, which starts from zero buffers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_in_blake3: Option<String>,
    /// BLAKE3 (hex) of the sealed state this round left for round `round + 1`.
    pub state_out_blake3: String,
    /// Standard deviation of the noise of the released running sum through this round (the sum
    /// of every release so far), on each coordinate of the sum, in update units, at this
    /// round's clip norm.
    pub prefix_stddev_sum: f64,
    /// Min-separation sensitivity of `C`'s first `round` rows, in clip norms: the accounting
    /// charges `(sensitivity + rounding)^2` Gaussian releases through this round.
    pub sensitivity: f64,
    /// What the accounting guarantees, per coordinate of the sum, in update units: the error
    /// below which no unbiased estimate of one device's contribution to this round gets, even
    /// knowing every other contribution of the task and every release of all its planned rounds
    /// (Cramer-Rao). The
    /// fresh noise's standard deviation over `accounted_sensitivity` (`clip_norm / sqrt(2 rho)`
    /// for the rho the whole task charges its value noise). `stddev_sum` is only what this one
    /// release carries; an operator who fills the other rounds gets closer than it (round 1's
    /// by the factor `||C e_1||`). Absent in releases of servers before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounted_stddev_sum: Option<f64>,
    /// The sensitivity the accounting charges one device over the task's planned rounds, in clip
    /// norms, margins and rounding included: `sqrt(units_through(rounds_planned))`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounted_sensitivity: Option<f64>,
}

/// The tree mechanism's record of a release (docs/privacy.md, "DP-FTRL"). `variance_grid` is each
/// raw node's variance; `stddev_sum` is this release's (an increment of the running sum).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TreeRecord {
    /// Rounds per tree (the policy's minimum separation).
    pub length: u32,
    /// 0-based tree of this round, and the round's 1-based position in it.
    pub tree: u64,
    pub position: u64,
    /// Raw nodes whose noise this release's increment combines.
    pub nodes: u64,
    /// Standard deviation of the noise of the tree's running sum through this round, on each
    /// coordinate of the sum, in update units.
    pub prefix_stddev_sum: f64,
    /// What the accounting guarantees, per coordinate of the sum, in update units: the error
    /// below which nobody can estimate one device's contribution to this round, even knowing
    /// every other contribution of the task and every release of its tree (the whole tree, as
    /// planned). A device's round is in `accounted_depth` complete nodes of its tree, each
    /// noised at the node scale, so this is the node scale over `sqrt(accounted_depth)`:
    /// `clip_norm / sqrt(2 rho)` for the tree's rho. `stddev_sum` is only what this one release
    /// carries, and an operator who fills the tree's other rounds gets closer than it. Absent in
    /// releases of servers before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounted_stddev_sum: Option<f64>,
    /// Complete nodes over one round of the tree as planned (`ceil(log2(rounds + 1))` for the
    /// tree's planned rounds): what the accounting charges one device per tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounted_depth: Option<u32>,
}

/// Adaptive clipping's part of a release (docs/privacy.md, "Adaptive clipping").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveRecord {
    pub target_quantile: f64,
    pub learning_rate: f64,
    /// Standard deviation of the noise on the count of unclipped updates, in contributions (the
    /// sampled scale on `sum(2 b_i - 1)`, halved).
    pub count_stddev: f64,
    /// The noised fraction of included updates whose norm was at most `clip_norm`, in [0, 1].
    pub unclipped_fraction: f64,
    /// `clip_norm * exp(-learning_rate * (unclipped_fraction - target_quantile))`, within the
    /// policy limits: the next round's clip norm.
    pub next_clip_norm: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivacyRecord {
    pub epsilon_budget: f64,
    pub delta: f64,
    pub rounds_planned: u32,
    /// Calibrated per-round noise in clip norms (before rounding the variance up).
    pub noise_multiplier: f64,
    /// zCDP rho of this release.
    pub rho_round: f64,
    /// rho spent by the task through this round (one release per round number).
    pub rho_spent: f64,
    /// ... as epsilon at `delta` (OpenDP's zCDP -> approximate-DP conversion).
    pub epsilon_spent: f64,
}

/// The evaluation part of a release's manifest: the model version measured and the noised
/// sums, with what follows from them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvaluationRecord {
    /// The model version the round trained from and its devices evaluated (`round - 1`).
    pub model_version: u64,
    /// Asked for on demand (the store's word: only devices that granted one of their on-demand
    /// evaluations sent metrics, so the sums may hold few or none), not a scheduled round.
    #[serde(default)]
    pub on_demand: bool,
    pub max_loss: f64,
    pub max_examples: u32,
    /// Standard deviation of the noise on each sum, in examples (the loss sum's in units of
    /// `max_loss`): the sampled scale over 1024.
    pub stddev: f64,
    /// Noised sums over the included contributions: examples, correct answers, and the loss
    /// (in loss units).
    pub examples: f64,
    pub correct: f64,
    pub loss_sum: f64,
    /// `correct / examples` within [0, 1], and `loss_sum / examples` within [0, max_loss]; null
    /// when the noised example count is not positive.
    pub accuracy: Option<f64>,
    pub loss: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stored manifest whose other fields do not parse (a number written as null, a field
    /// missing) still gives each part the front end reads back.
    #[test]
    fn each_part_is_read_back_on_its_own() {
        let json = serde_json::json!({
            "format": "confed-release/v9",
            "privacy": {"epsilon_spent": null},
            "adaptive_clipping": {"next_clip_norm": 0.75, "unclipped_fraction": null},
            "noise": {"blt": {"state_out_blake3": "ab".repeat(32)}},
            "evaluation": {
                "model_version": 2, "max_loss": 4.0, "max_examples": 100, "stddev": 3.0,
                "examples": 900.0, "correct": 700.0, "loss_sum": 300.0,
                "accuracy": 0.77, "loss": 0.33
            }
        })
        .to_string();
        assert!(Manifest::from_json(&json).is_err(), "not a whole manifest");
        assert_eq!(Manifest::next_clip_norm_of(&json), Some(0.75));
        assert_eq!(Manifest::blt_state_out_of(&json), Some("ab".repeat(32)));
        let evaluation = Manifest::evaluation_of(&json).unwrap();
        assert_eq!((evaluation.model_version, evaluation.on_demand), (2, false));
        let bare = r#"{"noise": {"mechanism": "gaussian"}}"#;
        assert_eq!(Manifest::next_clip_norm_of(bare), None);
        assert_eq!(Manifest::blt_state_out_of(bare), None);
        assert!(Manifest::evaluation_of(bare).is_none());
        assert_eq!(Manifest::next_clip_norm_of("not json"), None);
    }
}
