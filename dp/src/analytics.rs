//! What an analytics query's budget buys (docs/analytics.md, "Mechanisms and accounting"): the
//! noise on each released count, the zCDP rho each round spends, and for open domains the
//! partition-selection threshold and the delta it adds.
//!
//! One round releases the query's histogram (or quantile tree) with discrete Gaussian noise of
//! integer variance `v` on every key; one device changes it by at most `Δ₂` in L2, so a round
//! is `Δ₂² / (2v)`-zCDP and rounds compose by adding rho, as training rounds do. An open domain
//! releases only keys whose noised count reaches `τ`; a key only one device holds (its count at
//! most `c`) is then released with probability at most `P[Z ≥ τ − c]`, so over its `k` keys a
//! round adds `δ_thr = 1 − (1 − P[Z ≥ τ − c])^k` (Rogers 2023, Theorem 7; OpenDP's
//! `make_gaussian_threshold` map). Of the task's delta, half goes to the thresholds (`δ/(2R)`
//! per round, as Google's `GaussianPartitionSelection` splits its delta) and half to the zCDP
//! conversion; `τ` is the smallest integer whose exact discrete `δ_thr` fits.

use confed_protocol::analytics::AnalyticsQuery;

use super::calibrate::{calibrate, epsilon_of_rho};
use super::grid::MAX_SCALE_GRID;
use super::tails::{DiscreteGaussianTail, normal_upper_quantile};
use super::{Accountant, DpError};

/// The share of a thresholded query's delta spent on its thresholds.
pub const THRESHOLD_DELTA_SHARE: f64 = 0.5;

/// Largest noise standard deviation an open-domain query may be calibrated to: its threshold
/// would then be above a million devices per key, more than any round has.
pub const MAX_THRESHOLD_STDDEV: f64 = (1u64 << 18) as f64;

/// Most distinct keys an open-domain round may hold: the enclave's table is this large at most.
pub const MAX_OPEN_KEYS: u64 = 1 << 22;
/// An open-domain round releases nothing when its noised count of distinct keys exceeds this:
/// below the table's size by more than 14 standard deviations of that count's noise, so the
/// table fills (and the round stops at once) only with probability `DistinctCheck::delta`.
pub const OPEN_KEYS_CHECKED_AT: u64 = MAX_OPEN_KEYS - (1 << 19);
/// The count of distinct keys is noised with `DISTINCT_STDDEV_PER_KEY` times the query's
/// `keys_per_device` (one device changes it by at most that many): rho `1 / (2 · 512²)` a round.
pub const DISTINCT_STDDEV_PER_KEY: u64 = 512;

/// The open domain's check of its distinct keys against the table (docs/privacy.md, "Analytics"):
/// a Gaussian threshold on a count of sensitivity `k`, whose outcome (release or not) is the
/// only thing it reveals, accounted like any other release.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DistinctCheck {
    /// The integer variance of the count's noise.
    pub variance: u64,
    pub rho: f64,
    /// The chance the table fills although the noised count would have passed.
    pub delta: f64,
}

/// The check of an open-domain query with `k` keys per device.
pub fn distinct_check(k: u32) -> DistinctCheck {
    let stddev = DISTINCT_STDDEV_PER_KEY * u64::from(k.max(1));
    // A round one device short of a full table holds at most `MAX_OPEN_KEYS - k` keys more than
    // the check allows minus its `k`: the noise must exceed `margin - k + 1` for it to pass.
    let margin = i64::try_from(MAX_OPEN_KEYS - OPEN_KEYS_CHECKED_AT).unwrap_or(i64::MAX)
        - i64::from(k.max(1))
        + 1;
    DistinctCheck {
        variance: stddev * stddev,
        rho: 1.0 / (2.0 * (DISTINCT_STDDEV_PER_KEY as f64).powi(2)),
        delta: DiscreteGaussianTail::new(stddev * stddev).at_least(margin),
    }
}

/// A round's partition-selection threshold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Threshold {
    /// A key is released when its noised count is at least `tau`.
    pub tau: u64,
    /// `δ_thr` at `tau`: the most one device's keys add to a round's delta.
    pub delta_per_round: f64,
    /// The per-round share of the task's delta `tau` was chosen to fit.
    pub delta_budget_per_round: f64,
    /// The threshold of the continuous Gaussian at the same noise and budget,
    /// `c + σ Φ⁻¹((1 − δ)^(1/k))` (Google's and PipelineDP's formula), for comparison.
    pub continuous: f64,
}

/// An analytics task's noise, fixed from its budget and planned rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnalyticsPlan {
    /// `Δ₂²`, exactly.
    pub squared_sensitivity: u128,
    /// The integer variance the enclave samples each released value's noise with.
    pub variance: u64,
    /// zCDP rho of one round's histogram (or tree).
    pub rho_histogram: f64,
    /// zCDP rho of one round in all: the histogram's and, for open domains, the distinct-key
    /// check's.
    pub rho_per_round: f64,
    /// The delta the zCDP conversion is charged at.
    pub conversion_delta: f64,
    /// Open domains: the threshold every round releases keys at.
    pub threshold: Option<Threshold>,
    /// Open domains: the check of the round's distinct keys against the table.
    pub distinct_check: Option<DistinctCheck>,
}

/// What the rounds released so far have spent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnalyticsSpent {
    pub rho: f64,
    /// The thresholds' deltas added up.
    pub threshold_delta: f64,
    /// Epsilon at `conversion_delta + threshold_delta`.
    pub epsilon: f64,
}

impl AnalyticsPlan {
    /// The noise's standard deviation on each released value.
    pub fn stddev(&self) -> f64 {
        (self.variance as f64).sqrt()
    }

    /// The L2 sensitivity `Δ₂`.
    pub fn sensitivity(&self) -> f64 {
        (self.squared_sensitivity as f64).sqrt()
    }

    /// What `rounds` released rounds spend.
    pub fn spent(
        &self,
        accountant: &dyn Accountant,
        rounds: u32,
    ) -> Result<AnalyticsSpent, DpError> {
        let rho = self.rho_per_round * f64::from(rounds);
        Ok(AnalyticsSpent {
            rho,
            threshold_delta: (self.threshold.map_or(0.0, |t| t.delta_per_round)
                + self.distinct_check.map_or(0.0, |c| c.delta))
                * f64::from(rounds),
            epsilon: epsilon_of_rho(accountant, rho, self.conversion_delta)?,
        })
    }
}

/// The plan of `query` over `rounds` rounds within (`epsilon`, `delta`).
pub fn plan_analytics(
    accountant: &dyn Accountant,
    query: &AnalyticsQuery,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<AnalyticsPlan, DpError> {
    let thresholded = query.has_threshold();
    let conversion_delta = match thresholded {
        true => delta * (1.0 - THRESHOLD_DELTA_SHARE),
        false => delta,
    };
    // `calibrate` gives the noise per unit of L2 sensitivity for `rounds` releases, that is
    // rho `1 / (2 z²)` a round; the distinct-key check's rho comes out of it first.
    let multiplier = calibrate(accountant, epsilon, conversion_delta, rounds)?.noise_multiplier;
    let check = thresholded.then(|| distinct_check(query.keys_changed()));
    let rho_left = 1.0 / (2.0 * multiplier * multiplier) - check.map_or(0.0, |c| c.rho);
    if rho_left <= 0.0 {
        return Err(DpError::BudgetTooSmall { epsilon, delta });
    }
    let squared_sensitivity = query.squared_sensitivity();
    let wanted = squared_sensitivity as f64 / (2.0 * rho_left);
    let variance = sampled_variance(wanted).ok_or(DpError::ScaleOutOfRange(wanted.sqrt()))?;
    let threshold = match thresholded {
        false => None,
        true => {
            if (variance as f64).sqrt() > MAX_THRESHOLD_STDDEV {
                return Err(DpError::BudgetTooSmall { epsilon, delta });
            }
            let check = check.map_or(0.0, |c| c.delta);
            let budget = delta * THRESHOLD_DELTA_SHARE / f64::from(rounds.max(1)) - check;
            // A budget the check's delta used up leaves no threshold (and the walk below
            // would never find one).
            if !(budget.is_finite() && budget > 0.0) {
                return Err(DpError::BudgetTooSmall { epsilon, delta });
            }
            Some(choose_threshold(
                variance,
                query.largest_change(),
                query.keys_changed(),
                budget,
            ))
        }
    };
    let rho_histogram = squared_sensitivity as f64 / (2.0 * variance as f64);
    Ok(AnalyticsPlan {
        squared_sensitivity,
        variance,
        rho_histogram,
        rho_per_round: rho_histogram + check.map_or(0.0, |c| c.rho),
        conversion_delta,
        threshold,
        distinct_check: check,
    })
}

/// The sampler's integer variance for a wanted variance, rounded up (more noise, never less):
/// one part in 2^40 absorbs the float rounding of the product, as the enclave's
/// `DiscreteGaussian::at_least`. `None` outside the sampler's range.
pub fn sampled_variance(wanted: f64) -> Option<u64> {
    let variance = (wanted * (1.0 + 1e-12)).ceil().max(1.0);
    let most = (MAX_SCALE_GRID as f64).powi(2);
    (variance.is_finite() && variance <= most).then_some(variance as u64)
}

/// The continuous Gaussian's threshold at standard deviation `stddev`:
/// `c + stddev Φ⁻¹((1 − budget)^(1/k))`, Google's `GaussianPartitionSelection` and PipelineDP's
/// formula (reported beside confed's discrete threshold, never used to release).
pub fn continuous_threshold(stddev: f64, c: u64, k: u32, budget: f64) -> f64 {
    // The per-key tail the budget allows: 1 − (1 − budget)^(1/k), without cancellation.
    let per_key = -((-budget).ln_1p() / f64::from(k.max(1))).exp_m1();
    c as f64 + stddev * normal_upper_quantile(per_key)
}

/// `δ_thr` of a round released at threshold `tau` (`tau >= c`): one device's `k` keys, each
/// with a count of at most `c`, any of them released.
pub fn threshold_delta(variance: u64, tau: u64, c: u64, k: u32) -> f64 {
    let tail = DiscreteGaussianTail::new(variance);
    let offset = i64::try_from(tau.saturating_sub(c)).unwrap_or(i64::MAX);
    joint_delta(tail.at_least(offset), k)
}

/// `1 − (1 − p)^k`, without cancellation for small `p`.
fn joint_delta(single: f64, k: u32) -> f64 {
    (-(f64::from(k) * (-single).ln_1p()).exp_m1()).min(1.0)
}

/// The smallest integer threshold `tau >= c` whose `δ_thr` is within `budget` (positive: the
/// discrete tail reaches 0 some 40 standard deviations out, so a threshold always exists).
pub fn choose_threshold(variance: u64, c: u64, k: u32, budget: f64) -> Threshold {
    let budget = if budget > 0.0 {
        budget
    } else {
        f64::MIN_POSITIVE
    };
    let tail = DiscreteGaussianTail::new(variance);
    let continuous = continuous_threshold((variance as f64).sqrt(), c, k, budget);
    // Start a little below the continuous answer (the discrete tail is within a unit of it)
    // and walk: each step moves the tail by one term.
    let mut offset = ((continuous - c as f64).floor() as i64 - 2).max(0);
    let mut at = tail.at_least(offset);
    while joint_delta(at, k) > budget {
        at -= tail.mass(offset);
        offset += 1;
    }
    while offset > 0 && joint_delta(at + tail.mass(offset - 1), k) <= budget {
        offset -= 1;
        at += tail.mass(offset);
    }
    // Settled on tails computed from scratch: the walk's running sum is only a guide.
    let mut tau = c + offset.unsigned_abs();
    while threshold_delta(variance, tau, c, k) > budget {
        tau += 1;
    }
    while tau > c && threshold_delta(variance, tau - 1, c, k) <= budget {
        tau -= 1;
    }
    Threshold {
        tau,
        delta_per_round: threshold_delta(variance, tau, c, k),
        delta_budget_per_round: budget,
        continuous,
    }
}

/// Why an analytics plan cannot give a usable answer, with what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AnalyticsProblem {
    #[error("{0}")]
    Budget(#[from] DpError),
    #[error(
        "the noise on each released value (standard deviation {stddev:.1}) is larger than the most any key can reach in a round ({largest}: report_goal {report_goal} devices each adding at most {per_device}). Raise report_goal to at least {needed_goal}, raise epsilon, or plan fewer rounds"
    )]
    TooNoisy {
        stddev: f64,
        largest: u64,
        report_goal: u32,
        per_device: u64,
        needed_goal: u64,
    },
    #[error(
        "a key is released only when at least about {tau} devices of a round hold it (the partition-selection threshold for this budget), and a round has report_goal {report_goal} devices. Raise report_goal to at least {tau}, raise epsilon or delta, lower keys_per_device, or plan fewer rounds"
    )]
    ThresholdUnreachable { tau: u64, report_goal: u32 },
}

/// The plan, or why it cannot work: refused when the noise on a value exceeds the largest
/// value a round can reach, or when no key could pass the threshold.
pub fn check_analytics_plan(
    accountant: &dyn Accountant,
    query: &AnalyticsQuery,
    epsilon: f64,
    delta: f64,
    rounds: u32,
    report_goal: u32,
) -> Result<AnalyticsPlan, AnalyticsProblem> {
    let plan = plan_analytics(accountant, query, epsilon, delta, rounds)?;
    if let Some(threshold) = plan.threshold {
        if threshold.tau > u64::from(report_goal) {
            return Err(AnalyticsProblem::ThresholdUnreachable {
                tau: threshold.tau,
                report_goal,
            });
        }
        return Ok(plan);
    }
    let per_device = query.largest_change();
    let largest = u64::from(report_goal) * per_device;
    if plan.stddev() > largest as f64 {
        return Err(AnalyticsProblem::TooNoisy {
            stddev: plan.stddev(),
            largest,
            report_goal,
            per_device,
            needed_goal: (plan.stddev() / per_device as f64).ceil() as u64,
        });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClosedForm;

    fn open(k: u32) -> AnalyticsQuery {
        AnalyticsQuery::OpenHistogram {
            max_key_bytes: 32,
            keys_per_device: k,
        }
    }

    #[test]
    fn one_round_spends_the_budget_at_the_conversions_delta() {
        let query = AnalyticsQuery::Histogram {
            domain_size: 1000,
            keys_per_device: 4,
            max_value: 1,
        };
        let plan = plan_analytics(&ClosedForm, &query, 1.0, 1e-6, 4).unwrap();
        assert_eq!(plan.squared_sensitivity, 4);
        assert_eq!(plan.conversion_delta, 1e-6);
        assert!(plan.threshold.is_none());
        let spent = plan.spent(&ClosedForm, 4).unwrap();
        // The variance is rounded up: the whole plan spends at most the budget, and nearly it.
        assert!(spent.epsilon <= 1.0 && spent.epsilon > 0.97, "{spent:?}");
        assert!((plan.rho_per_round - 4.0 / (2.0 * plan.variance as f64)).abs() < 1e-15);
        assert_eq!(plan.rho_per_round, plan.rho_histogram);
        assert!(plan.distinct_check.is_none());
    }

    #[test]
    fn the_threshold_is_the_smallest_integer_whose_delta_fits() {
        let plan = plan_analytics(&ClosedForm, &open(16), 2.0, 1e-6, 3).unwrap();
        let t = plan.threshold.unwrap();
        assert_eq!(plan.conversion_delta, 5e-7);
        assert!((t.delta_budget_per_round - 1e-6 / 6.0).abs() < 1e-20);
        assert!(t.delta_per_round <= t.delta_budget_per_round);
        assert!(threshold_delta(plan.variance, t.tau - 1, 1, 16) > t.delta_budget_per_round);
        // The discrete threshold is within a unit or so of the continuous formula's.
        assert!((t.tau as f64 - t.continuous).abs() < 1.5, "{t:?}");
        let spent = plan.spent(&ClosedForm, 3).unwrap();
        assert!(spent.threshold_delta <= 5e-7 * (1.0 + 1e-12));
        assert!(spent.epsilon <= 2.0 && spent.epsilon > 1.95, "{spent:?}");
        // The distinct-key check is charged: a millionth of rho, a negligible delta.
        let check = plan.distinct_check.unwrap();
        assert!((plan.rho_per_round - plan.rho_histogram - check.rho).abs() < 1e-18);
        assert!(check.rho < 2e-6 && check.delta < 1e-40, "{check:?}");
    }

    #[test]
    fn a_delta_the_distinct_check_uses_up_is_refused_not_looped_on() {
        // k = 64: the check's delta (about 1e-58) exceeds the thresholds' share of 1e-60.
        let refused = plan_analytics(&ClosedForm, &open(64), 100.0, 1e-60, 1);
        assert!(
            matches!(refused, Err(DpError::BudgetTooSmall { .. })),
            "{refused:?}"
        );
    }

    #[test]
    fn more_keys_per_device_need_a_higher_threshold() {
        let taus: Vec<u64> = [1, 4, 16, 64]
            .iter()
            .map(|k| choose_threshold(400, 1, *k, 1e-7).tau)
            .collect();
        assert!(taus.windows(2).all(|w| w[0] < w[1]), "{taus:?}");
    }

    #[test]
    fn a_threshold_above_the_report_goal_is_refused_saying_what_to_raise() {
        let err = check_analytics_plan(&ClosedForm, &open(16), 1.0, 1e-8, 10, 50).unwrap_err();
        let AnalyticsProblem::ThresholdUnreachable { tau, .. } = err else {
            panic!("{err}")
        };
        assert!(
            err.to_string().contains(&format!("at least {tau}")),
            "{err}"
        );
        assert!(check_analytics_plan(&ClosedForm, &open(16), 1.0, 1e-8, 10, tau as u32).is_ok());
    }

    #[test]
    fn a_histogram_noisier_than_its_largest_count_is_refused() {
        let query = AnalyticsQuery::Histogram {
            domain_size: 10,
            keys_per_device: 64,
            max_value: 1,
        };
        let err = check_analytics_plan(&ClosedForm, &query, 0.1, 1e-6, 100, 10).unwrap_err();
        assert!(matches!(err, AnalyticsProblem::TooNoisy { .. }), "{err}");
        assert!(err.to_string().contains("Raise report_goal to at least"));
    }
}
