//! `confed privacy analytics` and `confed privacy threshold`: what an analytics query's budget
//! buys (the noise on each released value, rho per round, the partition-selection threshold)
//! and the threshold a given noise needs, from the same confed-dp code the enclave will
//! calibrate with (over OpenDP's accountant), as JSON. For partners choosing a budget, and for
//! the independent check against OpenDP and PyDP (`tests/privacy/test_analytics.py`).

use anyhow::{Result, anyhow};
use clap::Args;
use confed_dp::analytics::{self as analytics, AnalyticsPlan};
use confed_enclave::dp::OpenDp;
use confed_protocol::analytics::AnalyticsQuery;
use serde::Serialize;

#[derive(Args)]
pub(crate) struct AnalyticsArgs {
    /// The query as the task definition's `analytics` object, e.g. `{"query": "open_histogram",
    /// "max_key_bytes": 32, "keys_per_device": 16}` (docs/analytics.md).
    #[arg(long)]
    query: String,
    /// The task's total epsilon over all rounds.
    #[arg(long)]
    epsilon: f64,
    /// The task's total delta (open domains spend half of it on their thresholds).
    #[arg(long)]
    delta: f64,
    /// Planned rounds (releases).
    #[arg(long)]
    rounds: u32,
    /// Reports per round: also checks the plan is usable, as task creation will.
    #[arg(long)]
    report_goal: Option<u32>,
}

#[derive(Args)]
pub(crate) struct ThresholdArgs {
    /// The noise's standard deviation on each count.
    #[arg(long)]
    stddev: f64,
    /// The delta one round's thresholding may add.
    #[arg(long)]
    delta: f64,
    /// Keys one device contributes (the L0 bound).
    #[arg(long)]
    keys: u32,
    /// Most one device adds to one key's count.
    #[arg(long, default_value_t = 1)]
    max_value: u64,
}

#[derive(Serialize)]
struct ThresholdOut {
    /// The smallest integer threshold whose exact discrete-Gaussian delta fits.
    tau: u64,
    /// That delta, and the one a threshold one lower would add.
    delta_at_tau: f64,
    delta_below_tau: f64,
    /// The delta it was chosen to fit.
    delta_budget: f64,
    /// `max_value + stddev * Φ⁻¹((1 − delta)^(1/keys))`: the continuous Gaussian's threshold
    /// (Google's and PipelineDP's formula) at exactly `stddev`.
    continuous: f64,
}

/// The open domain's check of its distinct keys (docs/privacy.md, "Analytics").
#[derive(Serialize)]
struct DistinctCheckOut {
    /// The noised count must stay at most this.
    checked_at: u64,
    /// Keys the enclave's table holds at most.
    table_keys: u64,
    noise_stddev: f64,
    rho: f64,
    delta: f64,
}

#[derive(Serialize)]
struct AnalyticsOut {
    /// The task policy's `analytics` line.
    query: String,
    epsilon: f64,
    delta: f64,
    rounds: u32,
    /// L2 sensitivity of one round's release, and its square.
    sensitivity: f64,
    squared_sensitivity: u128,
    /// The integer variance the enclave samples each value's noise with, and its square root.
    noise_variance: u64,
    noise_stddev: f64,
    /// zCDP rho of one round's histogram, and of the round in all (with the open domain's
    /// check of its distinct keys).
    rho_histogram: f64,
    rho_per_round: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    distinct_check: Option<DistinctCheckOut>,
    /// The delta the zCDP conversion is charged at.
    conversion_delta: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    threshold: Option<ThresholdOut>,
    /// Through round 1, 2, ..., `rounds`.
    rho_spent: Vec<f64>,
    epsilon_spent: Vec<f64>,
    threshold_delta_spent: Vec<f64>,
}

pub(super) fn run_analytics(args: AnalyticsArgs) -> Result<()> {
    let query: AnalyticsQuery =
        serde_json::from_str(&args.query).map_err(|e| anyhow!("--query: {e}"))?;
    // The line parses back with every cap checked, as a task policy's would.
    let query = AnalyticsQuery::parse(&query.encode()).map_err(|e| anyhow!("--query: {e}"))?;
    let plan = match args.report_goal {
        Some(goal) => analytics::check_analytics_plan(
            &OpenDp,
            &query,
            args.epsilon,
            args.delta,
            args.rounds,
            goal,
        )
        .map_err(|e| anyhow!("{e}"))?,
        None => analytics::plan_analytics(&OpenDp, &query, args.epsilon, args.delta, args.rounds)
            .map_err(|e| anyhow!("{e}"))?,
    };
    let spent = (1..=args.rounds)
        .map(|r| plan.spent(&OpenDp, r))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    let out = AnalyticsOut {
        query: query.encode(),
        epsilon: args.epsilon,
        delta: args.delta,
        rounds: args.rounds,
        sensitivity: plan.sensitivity(),
        squared_sensitivity: plan.squared_sensitivity,
        noise_variance: plan.variance,
        noise_stddev: plan.stddev(),
        rho_histogram: plan.rho_histogram,
        rho_per_round: plan.rho_per_round,
        distinct_check: plan.distinct_check.map(|c| DistinctCheckOut {
            checked_at: analytics::OPEN_KEYS_CHECKED_AT,
            table_keys: analytics::MAX_OPEN_KEYS,
            noise_stddev: (c.variance as f64).sqrt(),
            rho: c.rho,
            delta: c.delta,
        }),
        conversion_delta: plan.conversion_delta,
        threshold: threshold_out(&plan, &query),
        rho_spent: spent.iter().map(|s| s.rho).collect(),
        epsilon_spent: spent.iter().map(|s| s.epsilon).collect(),
        threshold_delta_spent: spent.iter().map(|s| s.threshold_delta).collect(),
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn threshold_out(plan: &AnalyticsPlan, query: &AnalyticsQuery) -> Option<ThresholdOut> {
    let t = plan.threshold?;
    let (c, k) = (query.largest_change(), query.keys_changed());
    Some(ThresholdOut {
        tau: t.tau,
        delta_at_tau: t.delta_per_round,
        delta_below_tau: analytics::threshold_delta(plan.variance, t.tau.saturating_sub(1), c, k),
        delta_budget: t.delta_budget_per_round,
        continuous: t.continuous,
    })
}

pub(super) fn run_threshold(args: ThresholdArgs) -> Result<()> {
    let valid = args.stddev.is_finite()
        && (1.0..=analytics::MAX_THRESHOLD_STDDEV).contains(&args.stddev)
        && args.delta > 0.0
        && args.delta < 1.0
        && (1..=64).contains(&args.keys)
        && args.max_value >= 1;
    if !valid {
        return Err(anyhow!(
            "--stddev must be in [1, {}], --delta in (0, 1), --keys in 1..=64 and --max-value at least 1",
            analytics::MAX_THRESHOLD_STDDEV
        ));
    }
    let variance = analytics::sampled_variance(args.stddev * args.stddev)
        .ok_or_else(|| anyhow!("--stddev {} is outside the sampler's range", args.stddev))?;
    let t = analytics::choose_threshold(variance, args.max_value, args.keys, args.delta);
    let below = t.tau.saturating_sub(1);
    let out = ThresholdOut {
        tau: t.tau,
        delta_at_tau: t.delta_per_round,
        delta_below_tau: analytics::threshold_delta(variance, below, args.max_value, args.keys),
        delta_budget: args.delta,
        // At exactly --stddev (the discrete threshold is at the variance rounded up).
        continuous: analytics::continuous_threshold(
            args.stddev,
            args.max_value,
            args.keys,
            args.delta,
        ),
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
