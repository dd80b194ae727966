//! `confed privacy plan`: what a privacy budget buys, computed by the same OpenDP calibration and
//! accounting the enclave runs (confed-dp over `confed_enclave::dp::OpenDp`), as JSON. For partners choosing a budget,
//! and for the independent check of the accounting (`tests/privacy/`).

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use confed_dp::accounting::{EVALUATION_UNITS_PER_EXAMPLE, SideScales};
use confed_dp::blt::{Blt, ErrorKind, Setting};
use confed_dp::running_sum::{max_and_mean, running_sum_noise};
use confed_dp::{self as dp, Accountant, grid::GRID_UNITS_PER_CLIP};
use confed_enclave::dp::{DiscreteGaussian, OpenDp};
use confed_protocol::blt_noise::{BltNoise, DEFAULT_BLT_MAX_VALUES};
use confed_protocol::policy::{AdaptiveClipping, DpMechanism, Evaluation, Health, Mechanism};
use serde::Serialize;

#[derive(Subcommand)]
pub(crate) enum PrivacyCommand {
    /// The noise a task's budget buys and the epsilon spent after each round, as the enclave
    /// will calibrate and account them (Gaussian, tree aggregation or BLT; zCDP, OpenDP).
    Plan(PlanArgs),
    /// What an analytics query's budget buys: the noise on each released value, rho per
    /// round and, for open domains, the partition-selection threshold (docs/analytics.md).
    Analytics(super::privacy_analytics::AnalyticsArgs),
    /// The partition-selection threshold a noise needs for a delta: confed's exact discrete
    /// one, and the continuous Gaussian's formula at the same noise.
    Threshold(super::privacy_analytics::ThresholdArgs),
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// The task's total epsilon over all rounds.
    #[arg(long)]
    epsilon: f64,
    /// The task's delta.
    #[arg(long)]
    delta: f64,
    /// Planned rounds.
    #[arg(long)]
    rounds: u32,
    /// Reports per round: also checks the plan is usable, as task creation does.
    #[arg(long)]
    report_goal: Option<u32>,
    /// The noise: `gaussian` (independent per round), `tree` (DP-FTRL with tree aggregation) or
    /// `blt` (DP-FTRL with buffered linear Toeplitz noise). Default: `tree` with
    /// --min-separation, else `gaussian`.
    #[arg(long, value_enum)]
    mechanism: Option<MechanismArg>,
    /// DP-FTRL (tree or BLT): each device serves rounds at least this far apart; under tree
    /// aggregation also the trees' length. Default for BLT: the rounds (one participation).
    #[arg(long)]
    min_separation: Option<u32>,
    /// BLT: the error its matrix is optimized for, the running sums' largest (`max`) or mean
    /// (`mean`) variance (jax_privacy's `buffered_toeplitz.optimize`).
    #[arg(long, value_enum)]
    blt_error: Option<BltErrorArg>,
    /// BLT: the strategy matrix given instead of optimized, as `THETA:OMEGA,...` (decays in
    /// decreasing order, scales; rounded to multiples of 2^-52).
    #[arg(long, value_name = "THETA:OMEGA,...")]
    blt_buffers: Option<String>,
    /// BLT: the most model values a release noises (the rounding to the noise lattice is
    /// charged for this many; the enclave refuses larger models).
    /// Default 2^24.
    #[arg(long)]
    max_values: Option<u64>,
    /// Adaptive clipping with this noise (standard deviation, in contributions) on each round's
    /// count of unclipped updates (the target quantile and learning rate cost no privacy).
    #[arg(long)]
    adaptive_count_stddev: Option<f64>,
    /// Evaluation every `EVERY` rounds (0: none scheduled) with per-example loss bound
    /// `MAX_LOSS`, at most `MAX_EXAMPLES` examples per device, noise `STDDEV` (in examples) on each
    /// sum and up to `ON_DEMAND` evaluations on demand (default 0), as
    /// `EVERY,MAX_LOSS,MAX_EXAMPLES,STDDEV[,ON_DEMAND]` (docs/privacy.md, "Evaluation").
    #[arg(long, value_name = "EVERY,MAX_LOSS,MAX_EXAMPLES,STDDEV[,ON_DEMAND]")]
    evaluation: Option<String>,
    /// The noised health signal with this noise (standard deviation, in devices) on each
    /// round's count of devices that sent zeros (docs/privacy.md, "Health").
    #[arg(long)]
    health_stddev: Option<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum MechanismArg {
    Gaussian,
    Tree,
    Blt,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BltErrorArg {
    Max,
    Mean,
}

/// The standard deviation of the noise on the released running sum, in clip norms, over the
/// rounds.
#[derive(Serialize)]
struct RunningSumNoise {
    max: f64,
    /// The mean over rounds 1..=rounds of each round's standard deviation.
    mean: f64,
}

/// What a BLT plan's matrix is and costs.
#[derive(Serialize)]
struct BltPlan {
    /// `[theta, omega]` of each buffer of the strategy matrix `C`, as the policy has them.
    buffers: Vec<[f64; 2]>,
    /// The error it was optimized for (`given`: --blt-buffers).
    optimized_for: &'static str,
    /// Its loss (the optimized-for error of the running sums, in noise variances, times its
    /// squared sensitivity) for the max and the mean error: jax_privacy's `LossFn.loss`.
    loss_max: f64,
    loss_mean: f64,
    /// Min-separation sensitivity of `C` over the planned rounds, in clip norms.
    sensitivity: f64,
    /// The rounding to the noise lattice's share of the sensitivity, in clip norms.
    rounding_slack: f64,
    /// The noise lattice: 2^lattice_bits units per grid unit.
    lattice_bits: u32,
    max_values: u64,
}

#[derive(Serialize)]
struct Plan {
    epsilon: f64,
    delta: f64,
    rounds: u32,
    /// The task policy's `mechanism` value.
    mechanism: String,
    /// Noise standard deviation in clip norms (sigma / C) on the sum: per round (Gaussian), per
    /// tree node (tree aggregation) or per round before correlation (BLT's `z_t`).
    noise_multiplier: f64,
    /// zCDP rho of one Gaussian release at that scale: one round's (Gaussian), one node's (tree).
    rho_per_round: f64,
    /// Adaptive clipping: the standard deviation of the noise on `sum(2 b_i - 1)` the enclave
    /// samples (twice the count_stddev, its variance rounded up).
    #[serde(skip_serializing_if = "Option::is_none")]
    count_noise_scale: Option<f64>,
    /// Evaluation: the standard deviation of the noise on each of its sums the enclave samples,
    /// in examples (its variance rounded up on the 1/1024-example grid).
    #[serde(skip_serializing_if = "Option::is_none")]
    evaluation_noise_stddev: Option<f64>,
    /// Health signal: the standard deviation of the noise on each round's count of devices
    /// that sent zeros, as the enclave samples it (its variance rounded up).
    #[serde(skip_serializing_if = "Option::is_none")]
    health_noise_stddev: Option<f64>,
    /// Epsilon at `delta` spent through round 1, 2, ..., `rounds`.
    epsilon_spent: Vec<f64>,
    /// zCDP rho spent through round 1, 2, ..., `rounds`.
    rho_spent: Vec<f64>,
    /// The noise on the released running sum (what DP-FTRL's model carries), in clip norms.
    running_sum_noise: RunningSumNoise,
    #[serde(skip_serializing_if = "Option::is_none")]
    blt: Option<BltPlan>,
    /// With --report-goal: the noise on each coordinate of the average, in clip norms.
    #[serde(skip_serializing_if = "Option::is_none")]
    average_noise_per_clip: Option<f64>,
}

pub(super) fn run(command: PrivacyCommand) -> Result<()> {
    let args = match command {
        PrivacyCommand::Plan(args) => args,
        PrivacyCommand::Analytics(args) => return super::privacy_analytics::run_analytics(args),
        PrivacyCommand::Threshold(args) => return super::privacy_analytics::run_threshold(args),
    };
    let chosen = args.mechanism.unwrap_or(match args.min_separation {
        Some(_) => MechanismArg::Tree,
        None => MechanismArg::Gaussian,
    });
    let blt_only =
        args.blt_error.is_some() || args.blt_buffers.is_some() || args.max_values.is_some();
    if blt_only && chosen != MechanismArg::Blt {
        return Err(anyhow!(
            "--blt-error, --blt-buffers and --max-values apply to --mechanism blt only"
        ));
    }
    let noise = match chosen {
        MechanismArg::Gaussian => {
            if args.min_separation.is_some() {
                return Err(anyhow!(
                    "--min-separation applies to --mechanism tree or blt, not gaussian"
                ));
            }
            Mechanism::Gaussian
        }
        MechanismArg::Tree => Mechanism::Tree {
            min_separation: args.min_separation.ok_or_else(|| {
                anyhow!("--mechanism tree needs --min-separation (the trees' length)")
            })?,
        },
        MechanismArg::Blt => Mechanism::Blt(
            check_blt_shape(args.rounds, args.min_separation.unwrap_or(args.rounds)).and_then(
                |()| {
                    dp::blt_accounting::task_blt(
                        &OpenDp,
                        args.epsilon,
                        args.delta,
                        args.rounds,
                        args.min_separation.unwrap_or(args.rounds),
                        blt_error(args.blt_error.unwrap_or(BltErrorArg::Max)),
                        args.blt_buffers
                            .as_deref()
                            .map(parse_buffers)
                            .transpose()?
                            .as_ref(),
                        args.max_values.unwrap_or(DEFAULT_BLT_MAX_VALUES),
                    )
                    .map_err(|e| anyhow!("{e}"))
                },
            )?,
        ),
    };
    let adaptive_clipping = args
        .adaptive_count_stddev
        .map(|count_stddev| AdaptiveClipping {
            target_quantile: 0.5,
            learning_rate: 0.2,
            count_stddev,
        });
    let evaluation = match &args.evaluation {
        None => None,
        Some(text) => Some(parse_evaluation(text)?),
    };
    // Parsed back from its policy text: the same checks a task's policy gets.
    let whole = DpMechanism::parse(
        &DpMechanism {
            noise,
            adaptive_clipping,
            evaluation,
            health: args.health_stddev.map(|stddev| Health { stddev }),
            weighting: None,
        }
        .encode(),
    )
    .map_err(|e| anyhow!("{e}"))?;
    let whole =
        dp::blt_accounting::fit_lattice(&OpenDp, whole, args.epsilon, args.delta, args.rounds)
            .map_err(|e| anyhow!("{e}"))?;
    let mechanism = whole.noise;
    let calibration = match args.report_goal {
        Some(goal) => dp::check_plan(&OpenDp, whole, args.epsilon, args.delta, args.rounds, goal)
            .map_err(|e| anyhow!("{e}"))?,
        None => dp::calibrate_task(&OpenDp, whole, args.epsilon, args.delta, args.rounds)
            .map_err(|e| anyhow!("{e}"))?,
    };
    // The side releases' scales as the enclave samples them (variance rounded up).
    let sampled = |scale: f64| -> Result<f64> {
        Ok(DiscreteGaussian::at_least(scale)
            .map_err(|e| anyhow!("{e}"))?
            .scale())
    };
    let planned = SideScales::planned(&whole);
    let side = SideScales {
        count: planned.count.map(sampled).transpose()?,
        evaluation: match planned.evaluation {
            Some((e, scale)) => Some((e, sampled(scale)?)),
            None => None,
        },
        health: planned.health.map(sampled).transpose()?,
    };
    // The scale the enclave samples at: the calibrated one on the mechanism's lattice, its
    // integer variance rounded up; then as the same ratio on the grid.
    let lattice = dp::accounting::units_per_clip(mechanism);
    let noise_multiplier = DiscreteGaussian::at_least(calibration.noise_multiplier * lattice)
        .map_err(|e| anyhow!("{e}"))?
        .scale()
        / lattice;
    let scale_grid = noise_multiplier * GRID_UNITS_PER_CLIP as f64;
    let spent = (1..=args.rounds)
        .map(|k| {
            dp::spent_task(
                &OpenDp,
                mechanism,
                scale_grid,
                &side,
                u64::from(k),
                args.delta,
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    let noise_on_sums = running_sum_noise(mechanism, noise_multiplier, args.rounds);
    let (max, mean) = max_and_mean(&noise_on_sums);
    let blt = match mechanism {
        Mechanism::Blt(noise) => Some(blt_plan(&noise, args.rounds, &args)),
        _ => None,
    };
    let plan = Plan {
        epsilon: args.epsilon,
        delta: args.delta,
        rounds: args.rounds,
        mechanism: whole.encode(),
        noise_multiplier,
        count_noise_scale: side.count,
        evaluation_noise_stddev: side
            .evaluation
            .map(|(_, scale)| scale / EVALUATION_UNITS_PER_EXAMPLE as f64),
        health_noise_stddev: side.health,
        rho_per_round: OpenDp.rho_at(scale_grid).map_err(|e| anyhow!("{e}"))?,
        epsilon_spent: spent.iter().map(|(_, epsilon)| *epsilon).collect(),
        rho_spent: spent.iter().map(|(rho, _)| *rho).collect(),
        running_sum_noise: RunningSumNoise { max, mean },
        blt,
        average_noise_per_clip: args
            .report_goal
            .map(|goal| noise_multiplier / f64::from(goal.max(1))),
    };
    println!("{}", serde_json::to_string_pretty(&plan)?);
    Ok(())
}

/// The shape a BLT plan needs, checked before the optimizer runs.
fn check_blt_shape(rounds: u32, min_separation: u32) -> Result<()> {
    confed_protocol::blt_noise::check_shape(rounds, min_separation)
        .map_err(|why| anyhow!("--rounds {rounds} --min-separation {min_separation}: {why}"))
}

fn blt_error(arg: BltErrorArg) -> ErrorKind {
    match arg {
        BltErrorArg::Max => ErrorKind::Max,
        BltErrorArg::Mean => ErrorKind::Mean,
    }
}

/// `THETA:OMEGA,...` as a BLT (checked when it becomes the policy's; spaces are ignored).
fn parse_buffers(text: &str) -> Result<Blt> {
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let (decays, scales) = confed_protocol::blt_noise::parse_buffer_pairs(&compact)
        .map_err(|why| anyhow!("--blt-buffers {text:?}: {why}"))?;
    Ok(Blt::new(decays, scales))
}

fn blt_plan(noise: &BltNoise, rounds: u32, args: &PlanArgs) -> BltPlan {
    let matrix = Blt::new(noise.decays(), noise.scales());
    let setting = |error| Setting::new(rounds, noise.min_separation, error);
    BltPlan {
        buffers: matrix
            .decays
            .iter()
            .zip(&matrix.scales)
            .map(|(t, w)| [*t, *w])
            .collect(),
        optimized_for: match (&args.blt_buffers, args.blt_error) {
            (Some(_), _) => "given",
            (None, Some(BltErrorArg::Mean)) => "mean",
            (None, _) => "max",
        },
        loss_max: setting(ErrorKind::Max).loss(&matrix),
        loss_mean: setting(ErrorKind::Mean).loss(&matrix),
        sensitivity: dp::blt_accounting::sensitivity_through(noise, u64::from(rounds)),
        rounding_slack: dp::blt_accounting::rounding_slack(noise, u64::from(rounds)),
        lattice_bits: noise.lattice_bits,
        max_values: noise.max_values,
    }
}

/// `EVERY,MAX_LOSS,MAX_EXAMPLES,STDDEV[,ON_DEMAND]` as plain numbers (the policy's canonical
/// form is made from them).
fn parse_evaluation(text: &str) -> Result<Evaluation> {
    let parts: Vec<&str> = text.split(',').collect();
    let (every, max_loss, max_examples, stddev, on_demand) = match parts[..] {
        [a, b, c, d] => (a, b, c, d, "0"),
        [a, b, c, d, e] => (a, b, c, d, e),
        _ => {
            return Err(anyhow!(
                "--evaluation {text:?}: four or five numbers EVERY,MAX_LOSS,MAX_EXAMPLES,STDDEV[,ON_DEMAND]"
            ));
        }
    };
    let bad = |what: &str| anyhow!("--evaluation {text:?}: {what} is not a number");
    Ok(Evaluation {
        every: every.parse().map_err(|_| bad("EVERY"))?,
        max_loss: max_loss.parse().map_err(|_| bad("MAX_LOSS"))?,
        max_examples: max_examples.parse().map_err(|_| bad("MAX_EXAMPLES"))?,
        stddev: stddev.parse().map_err(|_| bad("STDDEV"))?,
        on_demand: on_demand.parse().map_err(|_| bad("ON_DEMAND"))?,
    })
}
