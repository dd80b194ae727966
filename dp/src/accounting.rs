//! What a task's mechanism costs one device, in zCDP, and the noise that fits its budget: the
//! Gaussian mechanism (one release per round), DP-FTRL's trees (`tree`: the depth of each tree
//! begun) or BLT (`blt_accounting`: its squared min-separation sensitivity), adaptive clipping's noised count on top of either (one count per round the device
//! may serve) and evaluation's noised sums (one per evaluation round the device may serve), all
//! composed by adding rho and converted to (epsilon, delta) by the `Accountant`.

use confed_protocol::policy::{DpMechanism, Evaluation, Mechanism};

use super::calibrate::{calibrate_units, epsilon_of_rho};
use super::grid::{GRID_UNITS_PER_CLIP, MAX_SCALE_GRID};
use super::{Accountant, Calibration, DpError, blt_accounting, tree};

/// Gaussian releases of one clip norm's sensitivity at the mechanism's noise multiplier that
/// rounds `1..=round` cost one device at most (one per round for `Gaussian`, one per complete
/// node over a device's round for `Tree`, a BLT's squared sensitivity with its rounding for
/// `Blt`): what calibration and accounting compose in zCDP.
pub fn units_through(mechanism: Mechanism, round: u64) -> f64 {
    match mechanism {
        Mechanism::Gaussian => round as f64,
        Mechanism::Tree { min_separation } => tree::Trees {
            length: min_separation,
        }
        .releases_through(round) as f64,
        Mechanism::Blt(blt) => blt_accounting::units_through(&blt, round),
    }
}

/// Noise lattice units per clip norm: the grid's, or a BLT's finer lattice.
pub fn units_per_clip(mechanism: Mechanism) -> f64 {
    match mechanism {
        Mechanism::Blt(blt) => blt_accounting::units_per_clip(&blt),
        _ => GRID_UNITS_PER_CLIP as f64,
    }
}

/// Largest noise multiplier the exact sampler can draw for `mechanism` (2^30 lattice units).
pub fn max_noise_multiplier(mechanism: Mechanism) -> f64 {
    MAX_SCALE_GRID as f64 / units_per_clip(mechanism)
}

/// Noised counts (adaptive clipping) one device can be in through `round`: one per round it may
/// serve, so one per round (Gaussian) or one per `min_separation` rounds begun (DP-FTRL).
pub fn counts_through(mechanism: Mechanism, round: u64) -> u64 {
    match mechanism {
        Mechanism::Gaussian => round,
        _ if round == 0 => 0,
        other => (round - 1) / u64::from(other.min_separation()) + 1,
    }
}

/// zCDP rho of one noised count under adaptive clipping: the count is `sum(2 b_i - 1)` (each
/// device adds +-1: sensitivity 1) with discrete Gaussian noise of standard deviation
/// `2 count_stddev` (the same as `count_stddev` on `sum(b_i - 1/2)`), so `1 / (8 count_stddev^2)`.
pub fn count_rho(count_scale: f64) -> f64 {
    1.0 / (2.0 * count_scale * count_scale)
}

/// Grid units per example of evaluation's sums (`aggregate::evaluation`): the loss sum, in units of
/// `max_loss`, is rounded to 1/1024 of it per device.
pub const EVALUATION_UNITS_PER_EXAMPLE: i64 = 1024;

/// Evaluation releases one device can be in through `round`: one per scheduled evaluation round
/// it may serve, so every one (Gaussian) or one per tree that has one (DP-FTRL: a device serves
/// one round per tree); plus its on-demand evaluations, which the device itself counts, at most
/// `on_demand` and one per round outside the schedule. Under DP-FTRL never more than one per tree
/// begun, whatever the sum says.
pub fn evaluations_through(mechanism: Mechanism, evaluation: &Evaluation, round: u64) -> u64 {
    let sum = scheduled_through(mechanism, evaluation, round) + evaluation.on_demand_through(round);
    match mechanism {
        Mechanism::Gaussian => sum,
        _ => sum.min(counts_through(mechanism, round)),
    }
}

fn scheduled_through(mechanism: Mechanism, evaluation: &Evaluation, round: u64) -> u64 {
    let evaluated = evaluation.rounds_through(round);
    match mechanism {
        Mechanism::Gaussian => evaluated,
        Mechanism::Tree { min_separation } => {
            let mut trees = 0;
            let mut last = None;
            for k in 0..evaluated {
                let tree = k * u64::from(evaluation.every) / u64::from(min_separation);
                if last != Some(tree) {
                    trees += 1;
                    last = Some(tree);
                }
            }
            trees
        }
        Mechanism::Blt(blt) => {
            // The most evaluation rounds pairwise at least `b` apart (earliest first is optimal).
            let b = u64::from(blt.min_separation);
            let mut served = 0;
            let mut last: Option<u64> = None;
            for k in 0..evaluated {
                let round = 1 + k * u64::from(evaluation.every);
                if last.is_none_or(|l| round >= l + b) {
                    served += 1;
                    last = Some(round);
                }
            }
            served
        }
    }
}

/// zCDP rho of one evaluation release: three sums, each device adding a vector in `[0,
/// max_examples]^3` (examples units; integer grid units after rounding, each at most
/// `max_examples * EVALUATION_UNITS_PER_EXAMPLE`), so L2 sensitivity `sqrt(3) max_examples`
/// units, with discrete Gaussian noise of scale `scale_grid` on each: `3 M^2 / (2 scale^2)`.
pub fn evaluation_rho(evaluation: &Evaluation, scale_grid: f64) -> f64 {
    let m = f64::from(evaluation.max_examples) * EVALUATION_UNITS_PER_EXAMPLE as f64;
    3.0 * m * m / (2.0 * scale_grid * scale_grid)
}

/// The scales the side releases were sampled at (grid units): adaptive clipping's count,
/// evaluation's sums and the health count (in devices).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SideScales {
    pub count: Option<f64>,
    pub evaluation: Option<(Evaluation, f64)>,
    pub health: Option<f64>,
}

impl SideScales {
    /// The scales a mechanism asks for, before the sampler rounds them up.
    pub fn planned(mechanism: &DpMechanism) -> Self {
        Self {
            count: mechanism.adaptive_clipping.map(|a| 2.0 * a.count_stddev),
            evaluation: mechanism
                .evaluation
                .map(|e| (e, e.stddev * EVALUATION_UNITS_PER_EXAMPLE as f64)),
            health: mechanism.health.map(|h| h.stddev),
        }
    }

    /// rho of the side releases one device can be in through `round`.
    pub fn rho_through(&self, mechanism: Mechanism, round: u64) -> f64 {
        let mut rho = 0.0;
        if let Some(scale) = self.count {
            rho += count_rho(scale) * counts_through(mechanism, round) as f64;
        }
        if let Some((evaluation, scale)) = &self.evaluation {
            rho += evaluation_rho(evaluation, *scale)
                * evaluations_through(mechanism, evaluation, round) as f64;
        }
        // The health count: each device adds 0 or 1 in every round it may serve, like
        // adaptive clipping's count (sensitivity 1 at the count's own scale).
        if let Some(scale) = self.health {
            rho += count_rho(scale) * counts_through(mechanism, round) as f64;
        }
        rho
    }
}

/// Share of a task's budget (in rho) the default health signal may cost at most.
pub const DEFAULT_HEALTH_SHARE: f64 = 0.05;

/// The health signal's default noise, in devices, for a budget of (epsilon, delta) over rounds
/// whose devices may each be in `counts` health counts (`counts_through`): the smallest at
/// which the counts cost at most `DEFAULT_HEALTH_SHARE` of the budget, and never finer than a
/// tenth of the report goal (a count no one needs to the device), at least 1.
pub fn default_health_stddev(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    counts: u64,
    report_goal: u32,
) -> Result<f64, DpError> {
    let budget_rho = calibrate_units(accountant, epsilon, delta, 1.0)?.rho_per_round;
    // counts / (2 stddev^2) = share * budget_rho.
    let within_share = (counts as f64 / (2.0 * DEFAULT_HEALTH_SHARE * budget_rho)).sqrt();
    Ok(within_share.max(f64::from(report_goal) / 10.0).max(1.0))
}

/// Why side releases that cost `side_rho` of `budget_rho` are refused, naming only those the
/// mechanism has and what to change for each.
fn side_too_costly(mechanism: &DpMechanism, side_rho: f64, budget_rho: f64) -> String {
    let mut names = Vec::new();
    let mut remedies = Vec::new();
    if mechanism.adaptive_clipping.is_some() {
        names.push("adaptive clipping's counts");
        remedies.push(
            "the count stddev (adaptive_clipping.count_stddev; about report_goal / 20 is usual)",
        );
    }
    if mechanism.evaluation.is_some() {
        names.push("evaluation's sums");
        remedies.push(
            "the evaluation stddev (evaluation.stddev; left out, the default costs at most 10 % of the budget unless that needs more than 1e6 examples) or evaluate less often",
        );
    }
    if mechanism.health.is_some() {
        names.push("the health counts");
        remedies.push(
            "the health stddev (privacy.health.stddev; left out, the default costs at most 5 % of the budget)",
        );
    }
    format!(
        "{} cost rho {side_rho:.4}, at least 90 % of the whole budget's {budget_rho:.4}; raise their noise: {}; or raise epsilon",
        names.join(", "),
        remedies.join("; ")
    )
}

/// Share of a task's budget (in rho) the default evaluation noise may cost at most.
pub const DEFAULT_EVALUATION_SHARE: f64 = 0.1;

/// Federated evaluation's default noise, in examples, for a budget of (epsilon, delta) whose
/// devices may each be in `evaluations` evaluation releases (`evaluations_through`): the smallest
/// at which they cost at most `DEFAULT_EVALUATION_SHARE` of the budget (`evaluation_rho`:
/// `3 max_examples^2 / (2 stddev^2)` each), and never finer than report_goal x max_examples / 100
/// (1 % noise when every device has max_examples examples: finer is budget the model needs more).
/// A plan that leaves the rest of the budget to the model's noise is then never refused for
/// evaluation's sake; whether the result can tell model versions apart is another matter
/// (`evaluation_too_noisy`).
pub fn default_evaluation_stddev(
    accountant: &dyn Accountant,
    epsilon: f64,
    delta: f64,
    evaluations: u64,
    max_examples: u32,
    report_goal: u32,
) -> Result<f64, DpError> {
    let budget_rho = calibrate_units(accountant, epsilon, delta, 1.0)?.rho_per_round;
    let m = f64::from(max_examples);
    let within_share =
        (evaluations as f64 * 3.0 * m * m / (2.0 * DEFAULT_EVALUATION_SHARE * budget_rho)).sqrt();
    Ok(up_to_three_digits(
        within_share
            .max(f64::from(report_goal) * m / 100.0)
            .max(1.0),
    ))
}

/// `x >= 1` rounded up to three significant digits (1202.76 -> 1210): a default a partner reads
/// in the policy, never below what the share asks for.
fn up_to_three_digits(x: f64) -> f64 {
    let digits = x.log10().floor() as i32 - 2;
    let scale = 10f64.powi(digits.abs());
    match digits >= 0 {
        true => (x / scale).ceil() * scale,
        false => (x * scale).ceil() / scale,
    }
}

/// Whether evaluation at noise `stddev` (examples) over about `examples` held-out examples a
/// round is too noisy to choose a best model version: the noised accuracy's standard deviation,
/// about `stddev / examples`, is 5 points or more (two versions 10 points apart could swap).
pub fn evaluation_too_noisy(stddev: f64, examples: f64) -> bool {
    examples <= 0.0 || stddev / examples >= 0.05
}

/// The calibration of a task's planned rounds under `mechanism`: the value noise that leaves
/// room in the budget for adaptive clipping's counts and evaluation's sums, if any (Andrew et
/// al. 2021, Theorem 1 in zCDP form: `rho_value + rho_side = rho_budget`).
/// The standard deviation, in units of the noise's own lattice (grid units for Gaussian noise),
/// that the task's budget calibrates: `calibrate_task`'s noise multiplier times
/// `units_per_clip(mechanism.noise)`. Every sampler of a task's value noise is built from it
/// (the enclave's `DiscreteGaussian::at_least`, a masked task's distributed noise variance,
/// which the front end writes and the key services check).
pub fn calibrated_scale(
    accountant: &dyn Accountant,
    mechanism: DpMechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<f64, DpError> {
    let z = calibrate_task(accountant, mechanism, epsilon, delta, rounds)?.noise_multiplier;
    Ok(z * units_per_clip(mechanism.noise))
}

pub fn calibrate_task(
    accountant: &dyn Accountant,
    mechanism: DpMechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<Calibration, DpError> {
    if rounds == 0 {
        return Err(DpError::InvalidBudget("rounds must be >= 1 (got 0)".into()));
    }
    let units = units_through(mechanism.noise, u64::from(rounds));
    let base = calibrate_units(accountant, epsilon, delta, units)?;
    if mechanism.adaptive_clipping.is_none()
        && mechanism.evaluation.is_none()
        && mechanism.health.is_none()
    {
        return Ok(base);
    }
    let budget_rho = base.rho_per_round * units;
    let side = SideScales::planned(&mechanism);
    let side_rho = side.rho_through(mechanism.noise, u64::from(rounds));
    if side_rho >= 0.9 * budget_rho {
        return Err(DpError::InvalidBudget(side_too_costly(
            &mechanism, side_rho, budget_rho,
        )));
    }
    let rho_per_release = (budget_rho - side_rho) / units;
    let noise_multiplier = (1.0 / (2.0 * rho_per_release)).sqrt();
    Ok(Calibration {
        noise_multiplier,
        rho_per_round: accountant.rho_at(noise_multiplier * GRID_UNITS_PER_CLIP as f64)?,
    })
}

/// Privacy spent through `round` with the value noise sampled at `scale_grid` and the side
/// releases at `side`: (rho, epsilon at `delta`).
pub fn spent_task(
    accountant: &dyn Accountant,
    mechanism: Mechanism,
    scale_grid: f64,
    side: &SideScales,
    round: u64,
    delta: f64,
) -> Result<(f64, f64), DpError> {
    let rho = rho_task(accountant, mechanism, scale_grid, side, round)?;
    Ok((rho, epsilon_of_rho(accountant, rho, delta)?))
}

/// `spent_task`'s rho alone, without the conversion to epsilon (the costly part of OpenDP's
/// accounting): what a release needs of the round before its own.
pub fn rho_task(
    accountant: &dyn Accountant,
    mechanism: Mechanism,
    scale_grid: f64,
    side: &SideScales,
    round: u64,
) -> Result<f64, DpError> {
    Ok(
        accountant.rho_at(scale_grid)? * units_through(mechanism, round)
            + side.rho_through(mechanism, round),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ClosedForm;
    use confed_protocol::policy::AdaptiveClipping;

    fn adaptive(noise: Mechanism, count_stddev: f64) -> DpMechanism {
        DpMechanism {
            adaptive_clipping: Some(AdaptiveClipping {
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_stddev,
            }),
            ..DpMechanism::plain(noise)
        }
    }

    fn evaluated(noise: Mechanism, every: u32, stddev: f64) -> DpMechanism {
        DpMechanism {
            evaluation: Some(Evaluation {
                every,
                max_loss: 10.0,
                max_examples: 50,
                stddev,
                on_demand: 0,
            }),
            ..DpMechanism::plain(noise)
        }
    }

    #[test]
    fn the_counts_take_their_share_and_the_whole_plan_still_spends_the_budget() {
        for noise in [Mechanism::Gaussian, Mechanism::Tree { min_separation: 5 }] {
            let base =
                calibrate_task(&ClosedForm, DpMechanism::plain(noise), 4.0, 1e-6, 10).unwrap();
            for mechanism in [adaptive(noise, 5.0), evaluated(noise, 3, 500.0)] {
                let with = calibrate_task(&ClosedForm, mechanism, 4.0, 1e-6, 10).unwrap();
                assert!(with.noise_multiplier > base.noise_multiplier);
                let scale = with.noise_multiplier * GRID_UNITS_PER_CLIP as f64;
                let side = SideScales::planned(&mechanism);
                let (_, epsilon) = spent_task(&ClosedForm, noise, scale, &side, 10, 1e-6).unwrap();
                assert!((epsilon - 4.0).abs() < 1e-6, "{mechanism:?}: {epsilon}");
            }
        }
    }

    #[test]
    fn weighting_by_examples_costs_nothing_a_device_still_adds_at_most_one_clip_norm() {
        use confed_protocol::policy::Weighting;
        for noise in [Mechanism::Gaussian, Mechanism::Tree { min_separation: 5 }] {
            let weighted = DpMechanism {
                weighting: Some(Weighting { max_examples: 32 }),
                ..DpMechanism::plain(noise)
            };
            let base =
                calibrate_task(&ClosedForm, DpMechanism::plain(noise), 4.0, 1e-6, 10).unwrap();
            let with = calibrate_task(&ClosedForm, weighted, 4.0, 1e-6, 10).unwrap();
            assert_eq!(with.noise_multiplier, base.noise_multiplier, "{noise:?}");
            assert_eq!(
                SideScales::planned(&weighted),
                SideScales::planned(&DpMechanism::plain(noise))
            );
        }
    }

    #[test]
    fn the_health_count_costs_one_count_per_round_a_device_may_serve() {
        use confed_protocol::policy::Health;
        for noise in [Mechanism::Gaussian, Mechanism::Tree { min_separation: 5 }] {
            let watched = DpMechanism {
                health: Some(Health { stddev: 10.0 }),
                ..DpMechanism::plain(noise)
            };
            let side = SideScales::planned(&watched);
            // Sensitivity 1 at stddev 10: rho 1/200 per count, 10 counts (Gaussian) or one per
            // tree of 5 (2 trees in 10 rounds).
            let counts = counts_through(noise, 10) as f64;
            assert!((side.rho_through(noise, 10) - counts / 200.0).abs() < 1e-15);
            // Calibration makes room for it, and the plan still spends exactly the budget.
            let base =
                calibrate_task(&ClosedForm, DpMechanism::plain(noise), 4.0, 1e-6, 10).unwrap();
            let with = calibrate_task(&ClosedForm, watched, 4.0, 1e-6, 10).unwrap();
            assert!(with.noise_multiplier > base.noise_multiplier);
            let scale = with.noise_multiplier * GRID_UNITS_PER_CLIP as f64;
            let (_, epsilon) = spent_task(&ClosedForm, noise, scale, &side, 10, 1e-6).unwrap();
            assert!((epsilon - 4.0).abs() < 1e-6, "{noise:?}: {epsilon}");
        }
        // A health noise too small for the budget is refused and names it.
        let greedy = DpMechanism {
            health: Some(Health { stddev: 1.0 }),
            ..DpMechanism::plain(Mechanism::Gaussian)
        };
        let error = calibrate_task(&ClosedForm, greedy, 0.5, 1e-6, 100).unwrap_err();
        assert!(error.to_string().contains("health stddev"), "{error}");
    }

    #[test]
    fn the_default_health_noise_costs_at_most_its_share_and_is_no_finer_than_a_tenth_of_the_goal() {
        use confed_protocol::policy::Health;
        for (epsilon, rounds, goal) in [(8.0, 3, 10), (1.0, 100, 1000), (50.0, 5, 200)] {
            let stddev =
                default_health_stddev(&ClosedForm, epsilon, 1e-6, u64::from(rounds), goal).unwrap();
            assert!(stddev >= f64::from(goal) / 10.0 && stddev >= 1.0);
            let budget = calibrate_units(&ClosedForm, epsilon, 1e-6, 1.0)
                .unwrap()
                .rho_per_round;
            let side = SideScales {
                health: Some(stddev),
                ..SideScales::default()
            };
            let cost = side.rho_through(Mechanism::Gaussian, u64::from(rounds));
            assert!(
                cost <= DEFAULT_HEALTH_SHARE * budget * (1.0 + 1e-9),
                "{cost} of {budget}"
            );
            // The task it makes calibrates (never refused for the health signal's sake).
            let watched = DpMechanism {
                health: Some(Health { stddev }),
                ..DpMechanism::plain(Mechanism::Gaussian)
            };
            calibrate_task(&ClosedForm, watched, epsilon, 1e-6, rounds).unwrap();
        }
    }

    #[test]
    fn an_evaluation_costs_three_sums_of_max_examples_each() {
        let e = evaluated(Mechanism::Gaussian, 1, 50.0).evaluation.unwrap();
        // sqrt(3) * 50 examples of sensitivity at stddev 50 examples: rho = 3 / 2.
        let scale = 50.0 * EVALUATION_UNITS_PER_EXAMPLE as f64;
        assert!((evaluation_rho(&e, scale) - 1.5).abs() < 1e-12);
    }

    #[test]
    fn an_evaluation_noise_that_would_eat_the_budget_is_refused() {
        let error = calibrate_task(
            &ClosedForm,
            evaluated(Mechanism::Gaussian, 1, 5.0),
            1.0,
            1e-6,
            10,
        )
        .unwrap_err();
        assert!(error.to_string().contains("evaluate less often"), "{error}");
    }

    #[test]
    fn a_device_is_in_one_evaluation_per_evaluation_round_or_per_tree_with_one() {
        let every_3 = evaluated(Mechanism::Gaussian, 3, 100.0).evaluation.unwrap();
        // Evaluation rounds 1, 4, 7, 10.
        assert_eq!(evaluations_through(Mechanism::Gaussian, &every_3, 10), 4);
        assert_eq!(evaluations_through(Mechanism::Gaussian, &every_3, 9), 3);
        // Trees of 5 rounds: [1-5] holds 1 and 4, [6-10] holds 7 and 10.
        let tree = Mechanism::Tree { min_separation: 5 };
        assert_eq!(evaluations_through(tree, &every_3, 10), 2);
        assert_eq!(evaluations_through(tree, &every_3, 5), 1);
        // Trees of 2 rounds: every evaluation round is in a tree of its own.
        let short = Mechanism::Tree { min_separation: 2 };
        assert_eq!(evaluations_through(short, &every_3, 10), 4);
        // Two on demand: one per round outside the schedule, at most two.
        let on_demand = Evaluation {
            on_demand: 2,
            ..every_3
        };
        assert_eq!(evaluations_through(Mechanism::Gaussian, &on_demand, 1), 1);
        assert_eq!(evaluations_through(Mechanism::Gaussian, &on_demand, 2), 2);
        assert_eq!(evaluations_through(Mechanism::Gaussian, &on_demand, 10), 6);
        // Trees of 5: at most one evaluation per tree a device can serve, so 2, not 2 + 2.
        assert_eq!(evaluations_through(tree, &on_demand, 10), 2);
        assert_eq!(evaluations_through(short, &on_demand, 10), 5);
    }

    #[test]
    fn a_count_noise_that_would_eat_the_budget_is_refused() {
        let error = calibrate_task(
            &ClosedForm,
            adaptive(Mechanism::Gaussian, 0.1),
            1.0,
            1e-6,
            10,
        )
        .unwrap_err();
        assert!(error.to_string().contains("raise their noise"), "{error}");
        // It names what the mechanism has, nothing else.
        assert!(error.to_string().contains("count stddev"), "{error}");
        for absent in ["evaluation", "health"] {
            assert!(!error.to_string().contains(absent), "{error}");
        }
    }

    /// The console's evaluation defaults at a small scale (epsilon 4, 5 rounds of 20 devices,
    /// evaluating every round) used to be refused; the default noise now fits the budget, and
    /// says it is too noisy to choose a version by.
    #[test]
    fn the_default_evaluation_noise_fits_the_budget_and_says_when_it_is_too_noisy() {
        for (every, rounds, goal) in [(1, 5, 20), (5, 5, 20), (10, 100, 1000)] {
            let mut evaluation = Evaluation {
                every,
                max_loss: 10.0,
                max_examples: 100,
                stddev: 1.0,
                on_demand: 0,
            };
            let count = evaluations_through(Mechanism::Gaussian, &evaluation, u64::from(rounds));
            evaluation.stddev =
                default_evaluation_stddev(&ClosedForm, 4.0, 1e-6, count, 100, goal).unwrap();
            assert!(evaluation.stddev >= f64::from(goal) * 100.0 / 100.0);
            let mechanism = DpMechanism {
                evaluation: Some(evaluation),
                ..DpMechanism::plain(Mechanism::Gaussian)
            };
            let side =
                SideScales::planned(&mechanism).rho_through(Mechanism::Gaussian, rounds.into());
            let budget = calibrate_units(&ClosedForm, 4.0, 1e-6, 1.0)
                .unwrap()
                .rho_per_round;
            assert!(
                side <= DEFAULT_EVALUATION_SHARE * budget * (1.0 + 1e-9),
                "{side} of {budget}"
            );
            calibrate_task(&ClosedForm, mechanism, 4.0, 1e-6, rounds).unwrap();
            let text = format!("{:e}", evaluation.stddev);
            assert!(text.len() <= 6, "a readable default: {text}");
            let noisy = evaluation_too_noisy(evaluation.stddev, f64::from(goal) * 100.0);
            assert_eq!(
                noisy,
                goal < 1000,
                "{every} {rounds} {goal}: stddev {}",
                evaluation.stddev
            );
        }
    }

    #[test]
    fn a_device_is_in_one_count_per_round_or_per_tree() {
        assert_eq!(counts_through(Mechanism::Gaussian, 7), 7);
        let tree = Mechanism::Tree { min_separation: 3 };
        assert_eq!(
            (0..=7).map(|r| counts_through(tree, r)).collect::<Vec<_>>(),
            [0, 1, 1, 1, 2, 2, 2, 3]
        );
    }
}
