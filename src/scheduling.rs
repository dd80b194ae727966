//! Which task a checking-in device serves when several fit it: the deployment's scheduling
//! policy (as in Propius). The check-in tries the fitting rounds in this order and assigns the
//! device to the first with a free slot; `benches/scheduling.rs` runs the same ordering over a
//! simulated population to compare the policies.
//!
//! A population belongs to one tenant, so the policy orders that tenant's tasks on it.
//!
//! - **Fair share** (the default): the least-filled round first (live assignments over the
//!   round's capacity), then the earliest deadline. Every task progresses.
//! - **First come, first served**: the oldest task first. The earliest tasks finish as soon as
//!   possible; later ones wait.
//! - **Shortest remaining demand**: the task needing the fewest contributions to finish (its
//!   remaining rounds times its report goal, less what its live round already has out) first.
//!   Minimises mean completion time; large tasks can starve while small ones keep arriving.

use std::cmp::Ordering;

use serde::{Deserialize, Serialize};

/// A deployment's scheduling policy (`confed serve --scheduling`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SchedulingPolicy {
    #[default]
    FairShare,
    #[value(name = "fcfs")]
    FirstComeFirstServed,
    ShortestRemainingDemand,
}

/// What the policies compare of a round that could take a device.
pub trait Schedulable {
    /// Live assignments over the round's capacity, 0 to 1.
    fn fill(&self) -> f64;
    /// When the round's collection ends (milliseconds).
    fn deadline_at(&self) -> i64;
    /// When the task was created (milliseconds).
    fn task_created_at(&self) -> i64;
    /// Contributions the task still needs to finish, counting those its live round has out.
    fn remaining_demand(&self) -> u64;
    /// The task's id: the last tie-breaker, so the order is total and stable.
    fn task_id(&self) -> &str;
}

impl SchedulingPolicy {
    /// How two candidate rounds compare: the one to try first is `Less`.
    pub fn compare<T: Schedulable>(self, a: &T, b: &T) -> Ordering {
        let by_policy = match self {
            Self::FairShare => a
                .fill()
                .total_cmp(&b.fill())
                .then(a.deadline_at().cmp(&b.deadline_at())),
            Self::FirstComeFirstServed => a.task_created_at().cmp(&b.task_created_at()),
            Self::ShortestRemainingDemand => a
                .remaining_demand()
                .cmp(&b.remaining_demand())
                .then(a.task_created_at().cmp(&b.task_created_at())),
        };
        by_policy.then_with(|| a.task_id().cmp(b.task_id()))
    }

    /// Sorts `candidates` into the order the check-in tries them.
    pub fn order<T: Schedulable>(self, candidates: &mut [T]) {
        candidates.sort_by(|a, b| self.compare(a, b));
    }
}

impl Schedulable for crate::db::device::Candidate {
    fn fill(&self) -> f64 {
        self.live as f64 / self.capacity.max(1) as f64
    }

    fn deadline_at(&self) -> i64 {
        self.deadline_at
    }

    fn task_created_at(&self) -> i64 {
        self.task_created_at
    }

    fn remaining_demand(&self) -> u64 {
        let goal = u64::from(self.spec.report_goal);
        let rounds_left =
            u64::try_from(i64::from(self.spec.rounds) - self.round_number + 1).unwrap_or(0);
        (rounds_left * goal).saturating_sub((self.live.max(0) as u64).min(goal))
    }

    fn task_id(&self) -> &str {
        &self.task_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Round {
        id: &'static str,
        fill: f64,
        deadline: i64,
        created: i64,
        demand: u64,
    }

    impl Schedulable for Round {
        fn fill(&self) -> f64 {
            self.fill
        }
        fn deadline_at(&self) -> i64 {
            self.deadline
        }
        fn task_created_at(&self) -> i64 {
            self.created
        }
        fn remaining_demand(&self) -> u64 {
            self.demand
        }
        fn task_id(&self) -> &str {
            self.id
        }
    }

    fn rounds() -> Vec<Round> {
        vec![
            Round {
                id: "old-big",
                fill: 0.5,
                deadline: 30,
                created: 1,
                demand: 5000,
            },
            Round {
                id: "new-small",
                fill: 0.9,
                deadline: 20,
                created: 3,
                demand: 10,
            },
            Round {
                id: "mid-empty",
                fill: 0.0,
                deadline: 40,
                created: 2,
                demand: 800,
            },
        ]
    }

    fn ordered(policy: SchedulingPolicy) -> Vec<&'static str> {
        let mut rounds = rounds();
        policy.order(&mut rounds);
        rounds.iter().map(|r| r.id).collect()
    }

    #[test]
    fn each_policy_orders_by_its_own_criterion() {
        assert_eq!(
            ordered(SchedulingPolicy::FairShare),
            ["mid-empty", "old-big", "new-small"]
        );
        assert_eq!(
            ordered(SchedulingPolicy::FirstComeFirstServed),
            ["old-big", "mid-empty", "new-small"]
        );
        assert_eq!(
            ordered(SchedulingPolicy::ShortestRemainingDemand),
            ["new-small", "mid-empty", "old-big"]
        );
    }

    #[test]
    fn ties_fall_back_to_the_task_id_so_the_order_is_total() {
        let mut same = vec![
            Round {
                id: "b",
                fill: 0.0,
                deadline: 1,
                created: 1,
                demand: 1,
            },
            Round {
                id: "a",
                fill: 0.0,
                deadline: 1,
                created: 1,
                demand: 1,
            },
        ];
        for policy in [
            SchedulingPolicy::FairShare,
            SchedulingPolicy::FirstComeFirstServed,
            SchedulingPolicy::ShortestRemainingDemand,
        ] {
            policy.order(&mut same);
            assert_eq!(same[0].id, "a", "{policy:?}");
        }
    }
}
