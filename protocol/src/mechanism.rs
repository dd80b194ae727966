//! The DP mechanism a task policy names (its `mechanism` line): the noise (independent Gaussian
//! per round, or DP-FTRL's tree aggregation) and, optionally, adaptive clipping and evaluation.
//!
//! ```text
//! <noise>[;adaptive_clipping=<target_quantile>,<learning_rate>,<count_stddev>]
//!        [;evaluation=<every>,<max_loss>,<max_examples>,<stddev>,<on_demand>]
//!        [;health=<stddev>]
//!        [;weighting=examples,<max_examples>]
//! <noise> = discrete_gaussian_on_grid | tree_aggregation_on_grid;min_separation=<u32>
//!         | blt_on_grid;min_separation=<u32>;buffers=...;max_values=<u64>;lattice_bits=<u32>
//! ```
//!
//! (`blt_noise` describes the BLT's fields.)
//!
//! Floats are in the policy's `{:e}` form, integers decimal; only the canonical text parses.

use crate::blt_noise::BLT_MECHANISM;
pub use crate::blt_noise::BltNoise;
use crate::policy::{MAX_MIN_SEPARATION, MECHANISM, TREE_MECHANISM};

const ADAPTIVE: &str = ";adaptive_clipping=";
const EVALUATION: &str = ";evaluation=";
const HEALTH: &str = ";health=";
const WEIGHTING: &str = ";weighting=examples,";

/// Name of the tensor that carries a device's example count in every update of a task whose
/// policy names `weighting`: F32, shape `[1]`, the number of examples its update trained on (0
/// when it sent zeros). The enclave weighs the clipped update by `min(examples, max_examples) /
/// max_examples` (docs/protocol.md, "Weighting").
pub const EXAMPLES_TENSOR: &str = "confed.examples";
/// Most examples a weighting policy may cap a device's weight at: F32 holds every integer up to
/// it exactly.
pub const MAX_WEIGHTING_EXAMPLES: u32 = 1_000_000;

/// Name of the tensor that carries a device's health flag in every update of a task whose policy
/// names `health`: F32, shape `[1]`, `1` when the device sent zeros in place of its trained update
/// (training failed, ran past the send instant or went non-finite), else `0` (docs/protocol.md,
/// "Health").
pub const HEALTH_TENSOR: &str = "confed.health";
/// The range of the health count's noise, in devices: the sampler is exact from 1.
pub const MIN_HEALTH_STDDEV: f64 = 1.0;
pub const MAX_HEALTH_STDDEV: f64 = 1e6;

/// Name of the tensor that carries a device's evaluation metrics in an evaluation round's update:
/// F32, shape `[3]`, `[loss_sum, correct, examples]` (docs/protocol.md, "Evaluation").
pub const EVALUATION_TENSOR: &str = "confed.evaluation";
/// Longest evaluation period, largest per-example loss bound, most examples per device and the
/// range of the evaluation noise (in examples): within them the enclave's grid and sampler are
/// exact (`enclave/src/aggregate/evaluation.rs`).
pub const MAX_EVALUATION_EVERY: u32 = 10_000;
/// Most on-demand evaluations a policy may allow each device.
pub const MAX_ON_DEMAND_EVALUATIONS: u32 = 1000;
pub const MAX_EVALUATION_LOSS: f64 = 1e6;
pub const MAX_EVALUATION_EXAMPLES: u32 = 1_000_000;
pub const MIN_EVALUATION_STDDEV: f64 = 1.0;
pub const MAX_EVALUATION_STDDEV: f64 = 1e6;

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
    /// DP-FTRL with buffered linear Toeplitz noise (`blt_on_grid;...`, `blt_noise`): the noise
    /// of the running sum is correlated across all rounds by a BLT, and a device serves rounds
    /// at least `min_separation` apart.
    Blt(BltNoise),
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
        if let Some(rest) = text
            .strip_prefix(BLT_MECHANISM)
            .and_then(|rest| rest.strip_prefix(';'))
        {
            return BltNoise::parse_params(rest).map(Self::Blt);
        }
        let separation = text
            .strip_prefix(TREE_MECHANISM)
            .and_then(|rest| rest.strip_prefix(";min_separation="))
            .ok_or_else(|| {
                format!(
                    "mechanism {text:?} (this enclave runs {MECHANISM}, {TREE_MECHANISM};min_separation=<rounds> or {BLT_MECHANISM};...)"
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
            Self::Blt(blt) => blt.encode(),
        }
    }

    /// Fewest rounds between two rounds one device serves (1: any rounds).
    pub fn min_separation(&self) -> u32 {
        match self {
            Self::Gaussian => 1,
            Self::Tree { min_separation } => *min_separation,
            Self::Blt(blt) => blt.min_separation,
        }
    }

    /// Rounds that must share one encryption key, as an index (`None`: no constraint). Tree
    /// noise is derived from the round's private key and reused by every later round of the same
    /// tree, so the key services pin one key per tree (`keyservice/src/ledger.rs`). BLT noise is
    /// derived from the task's one key for all its rounds (the noise lattice's state runs
    /// through them all), so every round of a BLT task shares scope 0.
    pub fn key_scope(&self, round: u64) -> Option<u64> {
        match self {
            Self::Gaussian => None,
            Self::Tree { min_separation } => {
                Some(round.saturating_sub(1) / u64::from(*min_separation))
            }
            Self::Blt(_) => Some(0),
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

/// Federated evaluation: in every `every`-th round (rounds 1, 1 + every, 1 + 2 every, ...; none
/// when `every` is 0) each device also measures the model version the round trains from on its
/// own held-out examples and adds `[loss_sum, correct, examples]` to its update
/// (`EVALUATION_TENSOR`); so it does in rounds the partner asks to evaluate on demand, at most
/// `on_demand` of them per device (the device counts). The enclave bounds each device's part (at
/// most `max_examples` examples, a mean loss in `[0, max_loss]`), sums the three over the round's
/// included contributions and releases the sums with discrete Gaussian noise of standard
/// deviation `stddev` (in examples; the loss sum in units of `max_loss`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Evaluation {
    pub every: u32,
    pub max_loss: f64,
    pub max_examples: u32,
    pub stddev: f64,
    pub on_demand: u32,
}

impl Evaluation {
    /// Whether round `round` (1-based) is a scheduled evaluation round: it evaluates the model
    /// version it trains from, `round - 1`.
    pub fn evaluates(&self, round: u64) -> bool {
        self.every > 0 && round >= 1 && (round - 1).is_multiple_of(u64::from(self.every))
    }

    /// Scheduled evaluation rounds among rounds `1..=round`.
    pub fn rounds_through(&self, round: u64) -> u64 {
        if round == 0 || self.every == 0 {
            0
        } else {
            (round - 1) / u64::from(self.every) + 1
        }
    }

    /// On-demand evaluations one device can have made through `round`: at most `on_demand`, and
    /// at most one per round that is not a scheduled evaluation round.
    pub fn on_demand_through(&self, round: u64) -> u64 {
        u64::from(self.on_demand).min(round - self.rounds_through(round))
    }

    fn check(&self) -> Result<(), String> {
        let ok = self.every <= MAX_EVALUATION_EVERY
            && self.on_demand <= MAX_ON_DEMAND_EVALUATIONS
            && (self.every > 0 || self.on_demand > 0)
            && self.max_loss > 0.0
            && self.max_loss <= MAX_EVALUATION_LOSS
            && (1..=MAX_EVALUATION_EXAMPLES).contains(&self.max_examples)
            && (MIN_EVALUATION_STDDEV..=MAX_EVALUATION_STDDEV).contains(&self.stddev);
        ok.then_some(()).ok_or_else(|| {
            format!(
                "evaluation {},{:e},{},{:e},{} (every in 0..={MAX_EVALUATION_EVERY}, max_loss in (0, {MAX_EVALUATION_LOSS:e}], max_examples in 1..={MAX_EVALUATION_EXAMPLES}, stddev in [{MIN_EVALUATION_STDDEV:e}, {MAX_EVALUATION_STDDEV:e}], on_demand in 0..={MAX_ON_DEMAND_EVALUATIONS}, not both 0)",
                self.every, self.max_loss, self.max_examples, self.stddev, self.on_demand
            )
        })
    }

    fn parse(params: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "evaluation {params:?} (five numbers: every,max_loss,max_examples,stddev,on_demand)"
            )
        };
        let parts: Vec<&str> = params.split(',').collect();
        let [every, max_loss, max_examples, stddev, on_demand] = parts[..] else {
            return Err(bad());
        };
        let real = |v: &str| v.parse::<f64>().ok().filter(|x| x.is_finite());
        let evaluation = Self {
            every: every.parse().map_err(|_| bad())?,
            max_loss: real(max_loss).ok_or_else(bad)?,
            max_examples: max_examples.parse().map_err(|_| bad())?,
            stddev: real(stddev).ok_or_else(bad)?,
            on_demand: on_demand.parse().map_err(|_| bad())?,
        };
        evaluation.check()?;
        Ok(evaluation)
    }

    fn encode(&self) -> String {
        format!(
            "{EVALUATION}{},{:e},{},{:e},{}",
            self.every, self.max_loss, self.max_examples, self.stddev, self.on_demand
        )
    }
}

/// The noised health signal (`;health=<stddev>`): every update carries the device's "I sent
/// zeros" flag (`HEALTH_TENSOR`), and the enclave releases the round's count of included
/// contributions that carried it (or were non-finite, and so summed as zeros) with discrete
/// Gaussian noise of standard deviation `stddev` (in devices). Each device adds 0 or 1:
/// sensitivity 1, charged like adaptive clipping's count in every round a device may serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Health {
    pub stddev: f64,
}

impl Health {
    fn parse(params: &str) -> Result<Self, String> {
        let stddev = params
            .parse::<f64>()
            .ok()
            .filter(|s| (MIN_HEALTH_STDDEV..=MAX_HEALTH_STDDEV).contains(s))
            .ok_or_else(|| {
                format!(
                    "health {params:?} (one number: stddev, in [{MIN_HEALTH_STDDEV:e}, {MAX_HEALTH_STDDEV:e}] devices)"
                )
            })?;
        Ok(Self { stddev })
    }

    fn encode(&self) -> String {
        format!("{HEALTH}{:e}", self.stddev)
    }
}

/// Example-weighted averaging (`;weighting=examples,<max_examples>`): every update carries the
/// device's example count (`EXAMPLES_TENSOR`), and the enclave adds the clipped update times
/// `w = min(examples, max_examples) / max_examples` (a NaN, an infinity or a negative count
/// weighs 0), then divides the noised sum by the number of included contributions as always.
/// With `w <= 1` a device still adds at most the clip norm to the sum: the sensitivity, the
/// noise and the accounting are those of uniform averaging (docs/privacy.md, "Weighted
/// averaging").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Weighting {
    pub max_examples: u32,
}

impl Weighting {
    fn parse(params: &str) -> Result<Self, String> {
        params
            .parse::<u32>()
            .ok()
            .filter(|m| (1..=MAX_WEIGHTING_EXAMPLES).contains(m) && m.to_string() == params)
            .map(|max_examples| Self { max_examples })
            .ok_or_else(|| {
                format!(
                    "weighting examples,{params:?} (max_examples: a decimal in 1..={MAX_WEIGHTING_EXAMPLES})"
                )
            })
    }

    fn encode(&self) -> String {
        format!("{WEIGHTING}{}", self.max_examples)
    }

    /// The weight of an update that trained on `examples` (as the device sent it): in [0, 1].
    pub fn weight(&self, examples: f32) -> f64 {
        let examples = f64::from(examples);
        if !examples.is_finite() || examples <= 0.0 {
            return 0.0;
        }
        examples.min(f64::from(self.max_examples)) / f64::from(self.max_examples)
    }
}

/// The whole mechanism value: the noise, the optional adaptive clipping, evaluation, health and
/// weighting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpMechanism {
    pub noise: Mechanism,
    pub adaptive_clipping: Option<AdaptiveClipping>,
    pub evaluation: Option<Evaluation>,
    pub health: Option<Health>,
    pub weighting: Option<Weighting>,
}

impl DpMechanism {
    /// The noise alone: no adaptive clipping, no evaluation, no health signal, uniform
    /// averaging.
    pub fn plain(noise: Mechanism) -> Self {
        Self {
            noise,
            adaptive_clipping: None,
            evaluation: None,
            health: None,
            weighting: None,
        }
    }

    pub fn parse(full: &str) -> Result<Self, String> {
        let (text, weighting) = match full.split_once(WEIGHTING) {
            None => (full, None),
            Some((before, params)) => (before, Some(Weighting::parse(params)?)),
        };
        let (text_rest, health) = match text.split_once(HEALTH) {
            None => (text, None),
            Some((before, params)) => (before, Some(Health::parse(params)?)),
        };
        let (text_before, evaluation) = match text_rest.split_once(EVALUATION) {
            None => (text_rest, None),
            Some((before, params)) => (before, Some(Evaluation::parse(params)?)),
        };
        let (base, adaptive) = match text_before.split_once(ADAPTIVE) {
            None => (text_before, None),
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
            evaluation,
            health,
            weighting,
        };
        if parsed.encode() != full {
            return Err(format!(
                "mechanism {full:?} is not in canonical form (numbers as `{{:e}}`)"
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
        if let Some(e) = &self.evaluation {
            out.push_str(&e.encode());
        }
        if let Some(h) = &self.health {
            out.push_str(&h.encode());
        }
        if let Some(w) = &self.weighting {
            out.push_str(&w.encode());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighting_comes_after_health_and_caps_a_devices_weight_at_one() {
        let m = DpMechanism {
            health: Some(Health { stddev: 2.0 }),
            weighting: Some(Weighting { max_examples: 64 }),
            ..DpMechanism::plain(Mechanism::Gaussian)
        };
        let text = m.encode();
        assert_eq!(
            text,
            "discrete_gaussian_on_grid;health=2e0;weighting=examples,64"
        );
        assert_eq!(DpMechanism::parse(&text), Ok(m));
        for bad in [
            "discrete_gaussian_on_grid;weighting=examples,0",
            "discrete_gaussian_on_grid;weighting=examples,064",
            "discrete_gaussian_on_grid;weighting=examples,1000001",
            "discrete_gaussian_on_grid;weighting=examples,6.4e1",
            "discrete_gaussian_on_grid;weighting=examples,",
            "discrete_gaussian_on_grid;weighting=rows,64",
            "discrete_gaussian_on_grid;weighting=examples,64;health=2e0",
            "discrete_gaussian_on_grid;weighting=examples,64;weighting=examples,64",
        ] {
            assert!(DpMechanism::parse(bad).is_err(), "{bad} was accepted");
        }
        let w = Weighting { max_examples: 64 };
        assert_eq!(w.weight(16.0), 0.25);
        assert_eq!(w.weight(64.0), 1.0);
        assert_eq!(w.weight(1e9), 1.0);
        for zero in [0.0, -3.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(w.weight(zero), 0.0, "{zero}");
        }
    }

    #[test]
    fn health_comes_last_in_canonical_form_and_refuses_noise_the_sampler_cannot_draw() {
        let m = DpMechanism {
            evaluation: Some(Evaluation {
                every: 3,
                max_loss: 10.0,
                max_examples: 50,
                stddev: 25.0,
                on_demand: 0,
            }),
            health: Some(Health { stddev: 2.5 }),
            ..DpMechanism::plain(Mechanism::Tree { min_separation: 4 })
        };
        let text = m.encode();
        assert_eq!(
            text,
            "tree_aggregation_on_grid;min_separation=4;evaluation=3,1e1,50,2.5e1,0;health=2.5e0"
        );
        assert_eq!(DpMechanism::parse(&text), Ok(m));
        let alone = DpMechanism {
            health: Some(Health { stddev: 1.0 }),
            ..DpMechanism::plain(Mechanism::Gaussian)
        };
        assert_eq!(
            DpMechanism::parse("discrete_gaussian_on_grid;health=1e0"),
            Ok(alone)
        );
        for bad in [
            "discrete_gaussian_on_grid;health=5e-1",
            "discrete_gaussian_on_grid;health=2e6",
            "discrete_gaussian_on_grid;health=2",
            "discrete_gaussian_on_grid;health=NaN",
            "discrete_gaussian_on_grid;health=",
            "discrete_gaussian_on_grid;health=2e0;evaluation=3,1e1,50,2.5e1,0",
            "discrete_gaussian_on_grid;health=2e0;health=2e0",
        ] {
            assert!(DpMechanism::parse(bad).is_err(), "{bad} was accepted");
        }
    }
}
