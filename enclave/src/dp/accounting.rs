//! What a task's mechanism costs one device, in zCDP, and the noise that fits its budget: the
//! Gaussian mechanism (one release per round), DP-FTRL's trees (`tree`: the depth of each tree
//! begun), and adaptive clipping's noised count on top of either (one count per round the device
//! may serve), all composed by adding rho and converted to (epsilon, delta) with OpenDP.

use confed_protocol::policy::{DpMechanism, Mechanism};

use super::calibrate::{epsilon_of_rho, rho_at};
use super::grid::GRID_UNITS_PER_CLIP;
use super::{Calibration, DpError, calibrate, tree};

/// Gaussian releases at the mechanism's noise scale (one per round for `Gaussian`, one per
/// complete node over a device's round for `Tree`) that rounds `1..=round` cost one device at
/// most: what calibration and accounting compose in zCDP.
pub fn releases_through(mechanism: Mechanism, round: u64) -> u64 {
    match mechanism {
        Mechanism::Gaussian => round,
        Mechanism::Tree { min_separation } => tree::Trees {
            length: min_separation,
        }
        .releases_through(round),
    }
}

/// Noised counts (adaptive clipping) one device can be in through `round`: one per round it may
/// serve, so one per round (Gaussian) or one per tree begun (DP-FTRL).
pub fn counts_through(mechanism: Mechanism, round: u64) -> u64 {
    match mechanism {
        Mechanism::Gaussian => round,
        Mechanism::Tree { min_separation } if round > 0 => {
            (round - 1) / u64::from(min_separation) + 1
        }
        Mechanism::Tree { .. } => 0,
    }
}

/// zCDP rho of one noised count under adaptive clipping: the count is `sum(2 b_i - 1)` (each
/// device adds +-1: sensitivity 1) with discrete Gaussian noise of standard deviation
/// `2 count_stddev` (the same as `count_stddev` on `sum(b_i - 1/2)`), so `1 / (8 count_stddev^2)`.
pub fn count_rho(count_scale: f64) -> f64 {
    1.0 / (2.0 * count_scale * count_scale)
}

/// The calibration of a task's planned rounds under `mechanism`: the value noise that leaves
/// room in the budget for adaptive clipping's counts, if any (Andrew et al. 2021, Theorem 1 in
/// zCDP form: `rho_value + rho_counts = rho_budget`).
pub fn calibrate_task(
    mechanism: DpMechanism,
    epsilon: f64,
    delta: f64,
    rounds: u32,
) -> Result<Calibration, DpError> {
    let units = releases_through(mechanism.noise, u64::from(rounds));
    let releases = u32::try_from(units)
        .map_err(|_| DpError::InvalidBudget(format!("{rounds} rounds are too many")))?;
    let base = calibrate(epsilon, delta, releases)?;
    let Some(adaptive) = mechanism.adaptive_clipping else {
        return Ok(base);
    };
    let budget_rho = base.rho_per_round * units as f64;
    let counts = counts_through(mechanism.noise, u64::from(rounds));
    let counts_rho = counts as f64 * count_rho(2.0 * adaptive.count_stddev);
    if counts_rho >= 0.9 * budget_rho {
        return Err(DpError::InvalidBudget(format!(
            "adaptive clipping's {counts} noised counts at count_stddev {} cost rho {counts_rho:.4}, at least 90 % of the whole budget's {budget_rho:.4}; raise count_stddev (about report_goal / 20 is usual) or epsilon",
            adaptive.count_stddev
        )));
    }
    let rho_per_release = (budget_rho - counts_rho) / units as f64;
    let noise_multiplier = (1.0 / (2.0 * rho_per_release)).sqrt();
    Ok(Calibration {
        noise_multiplier,
        rho_per_round: rho_at(noise_multiplier * GRID_UNITS_PER_CLIP as f64)?,
    })
}

/// Privacy spent through `round` with the value noise sampled at `scale_grid` and the counts at
/// `count_scale` (None without adaptive clipping): (rho, epsilon at `delta`).
pub fn spent_task(
    mechanism: Mechanism,
    scale_grid: f64,
    count_scale: Option<f64>,
    round: u64,
    delta: f64,
) -> Result<(f64, f64), DpError> {
    let mut rho = rho_at(scale_grid)? * releases_through(mechanism, round) as f64;
    if let Some(scale) = count_scale {
        rho += count_rho(scale) * counts_through(mechanism, round) as f64;
    }
    Ok((rho, epsilon_of_rho(rho, delta)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_protocol::policy::AdaptiveClipping;

    fn adaptive(noise: Mechanism, count_stddev: f64) -> DpMechanism {
        DpMechanism {
            noise,
            adaptive_clipping: Some(AdaptiveClipping {
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_stddev,
            }),
        }
    }

    #[test]
    fn the_counts_take_their_share_and_the_whole_plan_still_spends_the_budget() {
        for noise in [Mechanism::Gaussian, Mechanism::Tree { min_separation: 5 }] {
            let plain = DpMechanism {
                noise,
                adaptive_clipping: None,
            };
            let base = calibrate_task(plain, 4.0, 1e-6, 10).unwrap();
            let with = calibrate_task(adaptive(noise, 5.0), 4.0, 1e-6, 10).unwrap();
            assert!(with.noise_multiplier > base.noise_multiplier);
            let scale = with.noise_multiplier * GRID_UNITS_PER_CLIP as f64;
            let (_, epsilon) = spent_task(noise, scale, Some(10.0), 10, 1e-6).unwrap();
            assert!((epsilon - 4.0).abs() < 1e-6, "{noise:?}: {epsilon}");
        }
    }

    #[test]
    fn a_count_noise_that_would_eat_the_budget_is_refused() {
        let error = calibrate_task(adaptive(Mechanism::Gaussian, 0.1), 1.0, 1e-6, 10).unwrap_err();
        assert!(error.to_string().contains("raise count_stddev"), "{error}");
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
