//! `confed privacy plan`: what a privacy budget buys, computed by the same OpenDP calibration and
//! accounting the enclave runs (confed-dp over `confed_enclave::dp::OpenDp`), as JSON. For partners choosing a budget,
//! and for the independent check of the accounting (`tests/privacy/`).

use anyhow::{Result, anyhow};
use clap::{Args, Subcommand};
use confed_dp::accounting::{EVALUATION_UNITS_PER_EXAMPLE, SideScales};
use confed_dp::{self as dp, Accountant, grid::GRID_UNITS_PER_CLIP};
use confed_enclave::dp::{DiscreteGaussian, OpenDp};
use confed_protocol::policy::{AdaptiveClipping, DpMechanism, Evaluation, Mechanism};
use serde::Serialize;

#[derive(Subcommand)]
pub enum PrivacyCommand {
    /// The noise a task's budget buys and the epsilon spent after each round, as the enclave
    /// will calibrate and account them (Gaussian or tree aggregation, zCDP, OpenDP).
    Plan(PlanArgs),
}

#[derive(Args)]
pub struct PlanArgs {
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
    /// DP-FTRL with tree aggregation, trees of this many rounds, each device serving rounds at
    /// least this far apart (without it: the Gaussian mechanism).
    #[arg(long)]
    min_separation: Option<u32>,
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
}

#[derive(Serialize)]
struct Plan {
    epsilon: f64,
    delta: f64,
    rounds: u32,
    /// The task policy's `mechanism` value.
    mechanism: String,
    /// Noise standard deviation in clip norms (sigma / C) on the sum: per round (Gaussian) or
    /// per tree node (tree aggregation).
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
    /// Epsilon at `delta` spent through round 1, 2, ..., `rounds`.
    epsilon_spent: Vec<f64>,
    /// With --report-goal: the noise on each coordinate of the average, in clip norms.
    #[serde(skip_serializing_if = "Option::is_none")]
    average_noise_per_clip: Option<f64>,
}

pub fn run(command: PrivacyCommand) -> Result<()> {
    let PrivacyCommand::Plan(args) = command;
    let noise = match args.min_separation {
        None => Mechanism::Gaussian,
        Some(min_separation) => Mechanism::Tree { min_separation },
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
        }
        .encode(),
    )
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
    };
    // The scale the enclave samples at: the calibrated one, its integer variance rounded up.
    let scale_grid =
        DiscreteGaussian::at_least(calibration.noise_multiplier * GRID_UNITS_PER_CLIP as f64)
            .map_err(|e| anyhow!("{e}"))?
            .scale();
    let noise_multiplier = scale_grid / GRID_UNITS_PER_CLIP as f64;
    let epsilon_spent = (1..=args.rounds)
        .map(|k| {
            dp::spent_task(
                &OpenDp,
                mechanism,
                scale_grid,
                &side,
                u64::from(k),
                args.delta,
            )
            .map(|(_, epsilon)| epsilon)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow!("{e}"))?;
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
        rho_per_round: OpenDp.rho_at(scale_grid).map_err(|e| anyhow!("{e}"))?,
        epsilon_spent,
        average_noise_per_clip: args
            .report_goal
            .map(|goal| noise_multiplier / f64::from(goal.max(1))),
    };
    println!("{}", serde_json::to_string_pretty(&plan)?);
    Ok(())
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
