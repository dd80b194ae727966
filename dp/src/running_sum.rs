//! The noise on the running sum a mechanism releases: what DP-FTRL's model actually carries
//! after each round, in clip norms. (The sum of a task's releases is its running sum; the model
//! after round `t` is the base model plus the server learning rate times that sum over the
//! report counts, so this is the figure that compares mechanisms at equal privacy.)
//!
//! - Gaussian: `t` independent noises, `z sqrt(t)`.
//! - Tree aggregation: the efficient estimates of each tree begun (`tree::Trees::prefix`); a new
//!   tree every `b` rounds adds its own.
//! - BLT: `z sqrt(e_t)`, `e_t` the running-sum variance of `C^-1` (`blt::running_sum_variances`).

use confed_protocol::policy::Mechanism;

use super::blt::{Blt, running_sum_variances};
use super::tree::{Trees, variance};

/// Standard deviation of the running sum's noise after each of rounds `1..=rounds`, in clip
/// norms, at noise multiplier `noise_multiplier` (per round, per tree node, or per BLT row).
pub fn running_sum_noise(mechanism: Mechanism, noise_multiplier: f64, rounds: u32) -> Vec<f64> {
    let variances: Vec<f64> = match mechanism {
        Mechanism::Gaussian => (1..=rounds).map(f64::from).collect(),
        Mechanism::Tree { min_separation } => {
            let trees = Trees {
                length: min_separation,
            };
            let full = variance(
                trees.prefix(0, u64::from(min_separation)).values(),
                trees.denominator(),
            );
            let partial: Vec<f64> = (1..=u64::from(min_separation))
                .map(|p| variance(trees.prefix(0, p).values(), trees.denominator()))
                .collect();
            (1..=u64::from(rounds))
                .map(|round| {
                    let (tree, position) = trees.locate(round);
                    tree as f64 * full + partial[position as usize - 1]
                })
                .collect()
        }
        Mechanism::Blt(blt) => {
            let inverse = Blt::new(blt.decays(), blt.scales()).inverse();
            running_sum_variances(&inverse.coefficients(rounds as usize))
        }
    };
    variances
        .into_iter()
        .map(|v| noise_multiplier * v.sqrt())
        .collect()
}

/// The largest and the mean of the per-round standard deviations.
pub fn max_and_mean(noise: &[f64]) -> (f64, f64) {
    let max = noise.iter().copied().fold(0.0, f64::max);
    let mean = noise.iter().sum::<f64>() / noise.len().max(1) as f64;
    (max, mean)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_running_sums_grow_as_the_square_root_of_the_rounds() {
        let noise = running_sum_noise(Mechanism::Gaussian, 2.0, 4);
        assert_eq!(noise, vec![2.0, 2.0 * 2f64.sqrt(), 2.0 * 3f64.sqrt(), 4.0]);
        assert_eq!(max_and_mean(&[1.0, 3.0]), (3.0, 2.0));
    }

    #[test]
    fn a_tree_restarts_add_the_full_trees_variance() {
        let tree = Mechanism::Tree { min_separation: 2 };
        let noise = running_sum_noise(tree, 1.0, 4);
        // One leaf: 1. Two leaves: the root's efficient estimate, 2/3. Then a new tree.
        let expected: [f64; 4] = [1.0, 2.0 / 3.0, 2.0 / 3.0 + 1.0, 4.0 / 3.0];
        for (got, want) in noise.iter().zip(expected) {
            assert!((got - want.sqrt()).abs() < 1e-12, "{noise:?}");
        }
    }
}
