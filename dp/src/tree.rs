//! DP-FTRL's tree aggregation (Kairouz et al. 2021, "Practical and Private (Deep) Learning
//! without Sampling or Shuffling"), with Honaker's "efficient" estimator and restarts.
//!
//! Rounds are the leaves of binary trees of `b` rounds each (`b` = the policy's minimum
//! separation; a new tree starts every `b` rounds). Every complete node of a tree (a dyadic run
//! of rounds) gets independent discrete Gaussian noise `z` of one scale; the released running sum
//! of rounds `1..=t` of a tree is the sum of the node estimates of `t`'s binary decomposition.
//! The efficient estimate of a node of height `h` combines its own noisy value with its
//! children's estimates, `est = w_h * own + (1 - w_h) * (left + right)`, with
//! `w_h = v_h = 2^h / (2^(h+1) - 1)`, the estimate's variance in node variances (the inverse-
//! variance weighting of two unbiased estimates; `v_0 = 1`, `v_h -> 1/2`). Every estimate is a
//! fixed linear combination of the raw node noises of its subtree: a raw node at height `h'` below
//! enters with `beta(h, h') = v_h' * prod_{l = h'+1..=h} (1 - v_l) = 2^h' / (2^(h+1) - 1)` (the
//! product telescopes). The weights are kept exact, as integers over one common denominator `D`
//! (the lcm of `2^(g+1) - 1` for every level `g` of a tree, below 2^46 for trees of up to 1024
//! rounds), so the release is computed exactly in integers and rounded once: a function of the
//! noisy nodes alone, with no float error that could depend on the inputs.
//!
//! The enclave releases round `t`'s *increment*, the running sum at `t` minus the one at `t - 1`
//! (round `t`'s sum plus the difference of the two prefix noises), so the model updater stays
//! "add the release", and the sum of a tree's releases is its running sum. The increment's noise
//! only involves raw nodes inside the subtree of the node that completes at `t`; nodes shared
//! with the previous prefix cancel exactly.
//!
//! Privacy: every release is a function of the noisy complete nodes, a Gaussian mechanism whose
//! sensitivity counts the nodes one device's round is in. A device serves at most one round of a
//! tree (two rounds it serves are at least `b` apart), and a round of a tree whose first `t`
//! rounds were released is in `depth(t) = ceil(log2(t + 1))` complete nodes, so a task whose
//! trees have lengths `L_1..L_k` costs at most `sum_i depth(L_i)` Gaussian releases at the node
//! scale in zCDP (Kairouz et al., Appendix D; dp-accounting's `SingleEpochTreeAggregationDpEvent`
//! per tree, composed).

use std::collections::BTreeMap;

/// One raw noise node: tree `tree` (0-based), height `level`, and `index` among that level's
/// nodes; it spans the tree's rounds `index * 2^level + 1 ..= (index + 1) * 2^level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Node {
    pub tree: u64,
    pub level: u32,
    pub index: u64,
}

/// The tree layout of a task: trees of `length` rounds (the last may be shorter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trees {
    pub length: u32,
}

/// Nodes containing one leaf among the complete nodes of a tree with `rounds` rounds released:
/// `ceil(log2(rounds + 1))`, the bit length of `rounds`.
pub fn depth(rounds: u64) -> u32 {
    u64::BITS - rounds.leading_zeros()
}

/// Variance of the efficient estimate of a node of height `level`, in raw node variances.
pub fn estimate_variance(level: u32) -> f64 {
    let leaves = 2f64.powi(level as i32);
    leaves / (2.0 * leaves - 1.0)
}

/// Exact weight of each raw node at height `below` inside the efficient estimate of a node at
/// `level`, as a numerator over `denominator` (which `2^(level+1) - 1` divides).
fn beta(level: u32, below: u32, denominator: i64) -> i64 {
    (denominator / ((1i64 << (level + 1)) - 1)) << below
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl Trees {
    /// (tree, 1-based position in it) of a task round (1-based).
    pub fn locate(&self, round: u64) -> (u64, u64) {
        let length = u64::from(self.length);
        ((round - 1) / length, (round - 1) % length + 1)
    }

    /// Rounds of tree `tree` (0-based) that a task of `planned` rounds releases: the tree's
    /// length, or fewer for a last tree the plan cuts short.
    pub fn planned_rounds(&self, tree: u64, planned: u32) -> u64 {
        let length = u64::from(self.length);
        u64::from(planned).saturating_sub(tree * length).min(length)
    }

    /// Gaussian releases at the node scale that rounds `1..=round` cost one device, at most: the
    /// sum over the trees begun so far of the depth of what each released.
    pub fn releases_through(&self, round: u64) -> u64 {
        if round == 0 {
            return 0;
        }
        let (tree, position) = self.locate(round);
        tree * u64::from(depth(u64::from(self.length))) + u64::from(depth(position))
    }

    /// The common denominator of every weight in a tree: the lcm of `2^(g+1) - 1` over its
    /// levels `g` (3.5e13 for trees of 1024 rounds).
    pub fn denominator(&self) -> i64 {
        let top = u64::from(self.length).ilog2();
        (0..=top).fold(1i64, |lcm, g| {
            let d = (1i64 << (g + 1)) - 1;
            lcm / gcd(lcm, d) * d
        })
    }

    /// The raw-node coefficients of the running sum's noise over a tree's first `rounds`
    /// rounds (the efficient estimates of `rounds`' binary decomposition), as numerators over
    /// `denominator()`.
    pub fn prefix(&self, tree: u64, rounds: u64) -> BTreeMap<Node, i64> {
        let denominator = self.denominator();
        let mut out = BTreeMap::new();
        let mut start = 0u64; // leaves covered so far
        for level in (0..u64::BITS - rounds.leading_zeros()).rev() {
            if rounds & (1 << level) == 0 {
                continue;
            }
            let index = start >> level;
            for below in 0..=level {
                let weight = beta(level, below, denominator);
                let width = 1u64 << (level - below);
                for i in index * width..(index + 1) * width {
                    out.insert(
                        Node {
                            tree,
                            level: below,
                            index: i,
                        },
                        weight,
                    );
                }
            }
            start += 1 << level;
        }
        out
    }

    /// The raw-node coefficients of round `round`'s released noise (numerators over
    /// `denominator()`): the running sum's noise at its position minus the one before (nodes
    /// shared by both cancel exactly and are left out).
    pub fn release(&self, round: u64) -> Vec<(Node, i64)> {
        let (tree, position) = self.locate(round);
        let mut out = self.prefix(tree, position);
        for (node, weight) in self.prefix(tree, position - 1) {
            *out.entry(node).or_insert(0) -= weight;
        }
        out.into_iter().filter(|&(_, w)| w != 0).collect()
    }
}

/// Covariance of two noises given by raw-node coefficients over `denominator`, in raw node
/// variances.
pub fn covariance(a: &BTreeMap<Node, i64>, b: &BTreeMap<Node, i64>, denominator: i64) -> f64 {
    let d = denominator as f64;
    a.iter()
        .filter_map(|(node, x)| b.get(node).map(|y| (*x as f64 / d) * (*y as f64 / d)))
        .sum()
}

/// Sum of squared coefficients over `denominator`: the variance of a noise, in raw node
/// variances.
pub fn variance<'a>(coefficients: impl IntoIterator<Item = &'a i64>, denominator: i64) -> f64 {
    let d = denominator as f64;
    coefficients
        .into_iter()
        .map(|&c| (c as f64 / d).powi(2))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trees_planned_rounds_are_its_length_or_what_the_plan_leaves() {
        let trees = Trees { length: 4 };
        assert_eq!(trees.planned_rounds(0, 10), 4);
        assert_eq!(trees.planned_rounds(1, 10), 4);
        assert_eq!(trees.planned_rounds(2, 10), 2);
        assert_eq!(trees.planned_rounds(3, 10), 0);
    }

    #[test]
    fn depth_is_the_number_of_complete_nodes_over_a_leaf() {
        // 1 round: the leaf; 2: leaf + pair; 3: the third leaf is in one node; 4: a full tree.
        assert_eq!([1, 2, 3, 4, 7, 8].map(depth), [1, 2, 2, 3, 3, 4]);
    }

    #[test]
    fn estimate_variances_follow_the_inverse_variance_recursion() {
        let mut v = 1.0;
        for level in 1..12 {
            v = 2.0 * v / (1.0 + 2.0 * v);
            assert!((estimate_variance(level) - v).abs() < 1e-12, "{level}");
        }
        assert!((estimate_variance(1) - 2.0 / 3.0).abs() < 1e-15);
    }

    #[test]
    fn a_prefix_variance_is_the_sum_of_its_decompositions_estimate_variances() {
        let trees = Trees { length: 64 };
        for rounds in 1..=64u64 {
            let expected: f64 = (0..7)
                .filter(|l| rounds & (1 << l) != 0)
                .map(estimate_variance)
                .sum();
            let got = variance(trees.prefix(0, rounds).values(), trees.denominator());
            assert!((got - expected).abs() < 1e-12, "{rounds}: {got} {expected}");
        }
    }

    #[test]
    fn releases_telescope_to_the_running_sum_and_only_touch_the_completing_subtree() {
        let trees = Trees { length: 16 };
        let mut running: BTreeMap<Node, i64> = BTreeMap::new();
        for round in 1..=16u64 {
            let release = trees.release(round);
            let completing_level = round.trailing_zeros();
            let first = (round - 1) >> completing_level << completing_level; // leaves before
            for (node, weight) in &release {
                *running.entry(*node).or_insert(0) += weight;
                let span_start = node.index << node.level;
                assert!(node.level <= completing_level, "{round}: {node:?}");
                assert!(
                    span_start >= first && span_start < round,
                    "{round}: {node:?}"
                );
            }
            for (node, weight) in trees.prefix(0, round) {
                assert_eq!(
                    running.get(&node).copied(),
                    Some(weight),
                    "{round}: {node:?}"
                );
            }
            running.retain(|_, w| *w != 0);
            assert_eq!(running.len(), trees.prefix(0, round).len(), "{round}");
        }
    }

    #[test]
    fn the_second_tree_restarts_and_costs_its_own_depth() {
        let trees = Trees { length: 4 };
        assert_eq!(trees.locate(5), (1, 1));
        assert!(trees.release(5).iter().all(|(n, _)| n.tree == 1));
        // Tree 0 with 4 rounds: depth 3; then 1, 2, 2, 3 for tree 1's rounds.
        let costs: Vec<u64> = (1..=8).map(|r| trees.releases_through(r)).collect();
        assert_eq!(costs, [1, 2, 2, 3, 4, 5, 5, 6]);
    }

    #[test]
    fn exact_weights_are_the_inverse_variance_recursions() {
        let trees = Trees { length: 1024 };
        let d = trees.denominator();
        assert!(d < 1 << 46, "{d}");
        for level in 0..=10 {
            for below in 0..=level {
                let recursive = (below + 1..=level).fold(estimate_variance(below), |w, l| {
                    w * (1.0 - estimate_variance(l))
                });
                let exact = beta(level, below, d) as f64 / d as f64;
                assert!((exact - recursive).abs() < 1e-12, "{level} {below}");
                assert_eq!(d % ((1 << (level + 1)) - 1), 0);
            }
        }
    }

    #[test]
    fn a_one_round_tree_is_the_gaussian_mechanism() {
        let trees = Trees { length: 1 };
        for round in 1..=5 {
            assert_eq!(
                trees.release(round),
                vec![(
                    Node {
                        tree: round - 1,
                        level: 0,
                        index: 0
                    },
                    1
                )]
            );
            assert_eq!(trees.releases_through(round), round);
        }
    }
}
