//! The DP mechanism a task policy names (its `mechanism` line): the noise (independent Gaussian
//! per round, or DP-FTRL's tree aggregation) and, optionally, adaptive clipping.
//!
//! ```text
//! <noise>[;adaptive_clipping=<target_quantile>,<learning_rate>,<count_stddev>]
//! <noise> = discrete_gaussian_on_grid | tree_aggregation_on_grid;min_separation=<u32>
//! ```
//!
//! Floats are in the policy's `{:e}` form; only the canonical text parses.

use crate::policy::{MAX_MIN_SEPARATION, MECHANISM, TREE_MECHANISM};

const ADAPTIVE: &str = ";adaptive_clipping=";

/// Smallest noise on adaptive clipping's count: the sampler draws the count's noise at twice this
/// scale, and its exact range starts at 1.
pub const MIN_COUNT_STDDEV: f64 = 0.5;

/// The DP mechanism a policy names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    /// Independent discrete Gaussian noise on each round's sum (`discrete_gaussian_on_grid`).
    Gaussian,
    /// DP-FTRL with tree aggregation (`tree_aggregation_on_grid;min_separation=<b>`): the noise
    /// of the running sum of rounds comes from a binary tree restarted every `b` rounds, and a
    /// device serves at most one round of any `b` consecutive rounds (so at most one per tree).
    Tree { min_separation: u32 },
}

impl Mechanism {
    /// The noise of a policy's whole `mechanism` value (canonical form only).
    pub fn parse(text: &str) -> Result<Self, String> {
        DpMechanism::parse(text).map(|m| m.noise)
    }

    fn parse_noise(text: &str) -> Result<Self, String> {
        if text == MECHANISM {
            return Ok(Self::Gaussian);
        }
        let separation = text
            .strip_prefix(TREE_MECHANISM)
            .and_then(|rest| rest.strip_prefix(";min_separation="))
            .ok_or_else(|| {
                format!(
                    "mechanism {text:?} (this enclave runs {MECHANISM} or {TREE_MECHANISM};min_separation=<rounds>)"
                )
            })?;
        let min_separation = separation
            .parse::<u32>()
            .ok()
            .filter(|b| (1..=MAX_MIN_SEPARATION).contains(b) && b.to_string() == separation)
            .ok_or_else(|| {
                format!(
                    "min_separation {separation:?} (must be a decimal in 1..={MAX_MIN_SEPARATION})"
                )
            })?;
        Ok(Self::Tree { min_separation })
    }

    /// The policy's `mechanism` value without adaptive clipping.
    pub fn encode(&self) -> String {
        match self {
            Self::Gaussian => MECHANISM.to_string(),
            Self::Tree { min_separation } => {
                format!("{TREE_MECHANISM};min_separation={min_separation}")
            }
        }
    }

    /// Fewest rounds between two rounds one device serves (1: any rounds).
    pub fn min_separation(&self) -> u32 {
        match self {
            Self::Gaussian => 1,
            Self::Tree { min_separation } => *min_separation,
        }
    }

    /// Rounds that must share one encryption key, as an index (`None`: no constraint). Tree
    /// noise is derived from the round's private key and reused by every later round of the same
    /// tree, so the key services pin one key per tree (`keyservice/src/ledger.rs`).
    pub fn key_scope(&self, round: u64) -> Option<u64> {
        match self {
            Self::Gaussian => None,
            Self::Tree { min_separation } => {
                Some(round.saturating_sub(1) / u64::from(*min_separation))
            }
        }
    }
}

/// Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private Learning
/// with Adaptive Clipping"): each round's clip norm moves geometrically toward the norm below
/// which `target_quantile` of the updates fall, `C' = C * exp(-learning_rate * (b - q))`, where
/// `b` is the fraction of the round's updates at most `C`, released with Gaussian noise of
/// standard deviation `count_stddev` (in contributions) on the count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveClipping {
    pub target_quantile: f64,
    pub learning_rate: f64,
    pub count_stddev: f64,
}

impl AdaptiveClipping {
    /// Whether every parameter is in range: quantile in (0, 1), rate in (0, 10], the count's
    /// noise in [0.5, 1e6] contributions.
    fn check(&self) -> Result<(), String> {
        let ok = self.target_quantile > 0.0
            && self.target_quantile < 1.0
            && self.learning_rate > 0.0
            && self.learning_rate <= 10.0
            && (MIN_COUNT_STDDEV..=1e6).contains(&self.count_stddev);
        ok.then_some(()).ok_or_else(|| {
            format!(
                "adaptive_clipping {:e},{:e},{:e} (target_quantile in (0, 1), learning_rate in (0, 10], count_stddev in [0.5, 1e6])",
                self.target_quantile, self.learning_rate, self.count_stddev
            )
        })
    }

    /// The next round's clip norm after a round at `clip_norm` whose noised fraction of
    /// unclipped updates was `unclipped_fraction`, kept within the policy limits.
    pub fn next_clip_norm(&self, clip_norm: f64, unclipped_fraction: f64) -> f64 {
        let next =
            clip_norm * (-self.learning_rate * (unclipped_fraction - self.target_quantile)).exp();
        next.clamp(crate::policy::MIN_CLIP_NORM, crate::policy::MAX_CLIP_NORM)
    }
}

/// The whole mechanism value: the noise and the optional adaptive clipping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpMechanism {
    pub noise: Mechanism,
    pub adaptive_clipping: Option<AdaptiveClipping>,
}

impl DpMechanism {
    pub fn parse(text: &str) -> Result<Self, String> {
        let (base, adaptive) = match text.split_once(ADAPTIVE) {
            None => (text, None),
            Some((base, params)) => {
                let values: Vec<f64> = params
                    .split(',')
                    .map(|v| v.parse::<f64>().ok().filter(|x| x.is_finite()))
                    .collect::<Option<_>>()
                    .filter(|v: &Vec<f64>| v.len() == 3)
                    .ok_or_else(|| {
                        format!("adaptive_clipping {params:?} (three numbers: target_quantile,learning_rate,count_stddev)")
                    })?;
                let adaptive = AdaptiveClipping {
                    target_quantile: values[0],
                    learning_rate: values[1],
                    count_stddev: values[2],
                };
                adaptive.check()?;
                (base, Some(adaptive))
            }
        };
        let parsed = Self {
            noise: Mechanism::parse_noise(base)?,
            adaptive_clipping: adaptive,
        };
        if parsed.encode() != text {
            return Err(format!(
                "mechanism {text:?} is not in canonical form (numbers as `{{:e}}`)"
            ));
        }
        Ok(parsed)
    }

    pub fn encode(&self) -> String {
        let mut out = self.noise.encode();
        if let Some(a) = &self.adaptive_clipping {
            out.push_str(&format!(
                "{ADAPTIVE}{:e},{:e},{:e}",
                a.target_quantile, a.learning_rate, a.count_stddev
            ));
        }
        out
    }
}
