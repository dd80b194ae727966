//! The persisted state machines of tasks, rounds and assignments, as transition tables.
//! The database layer refuses any transition these tables do not allow, and applies allowed ones
//! only if the stored state still equals the expected old state (compare-and-set).

pub use confed_protocol::states::{AssignmentState, RoundState, TaskState};

/// A persisted state machine: its storage names and which transitions it allows.
pub trait StateMachine: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// The entity name recorded in the state history (`task`, `round`, `assignment`).
    const ENTITY: &'static str;
    /// The table whose `state` column holds this machine's state.
    const TABLE: &'static str;
    /// The column that names a row of `TABLE` (its entity id in the state history).
    const KEY: &'static str = "id";
    const ALL: &'static [Self];

    fn as_str(self) -> &'static str;
    fn can_become(self, next: Self) -> bool;

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|state| state.as_str() == s)
    }

    /// How a transition changes its round's (live assignments, completed reports) counters; only
    /// assignments have any.
    fn round_counter_deltas(self, _next: Self) -> (i64, i64) {
        (0, 0)
    }

    /// A terminal state allows no further transition.
    fn is_terminal(self) -> bool {
        !Self::ALL.iter().any(|&next| self.can_become(next))
    }
}

impl StateMachine for TaskState {
    const ENTITY: &'static str = "task";
    const TABLE: &'static str = "tasks";
    const ALL: &'static [Self] = TaskState::ALL;

    fn as_str(self) -> &'static str {
        TaskState::as_str(self)
    }

    fn can_become(self, next: Self) -> bool {
        use TaskState::*;
        matches!(
            (self, next),
            (Created, Open) | (Created, Cancelled) | (Open, Completed | Failed | Cancelled)
        )
    }
}

impl StateMachine for RoundState {
    const ENTITY: &'static str = "round";
    const TABLE: &'static str = "rounds";
    const ALL: &'static [Self] = RoundState::ALL;

    fn as_str(self) -> &'static str {
        RoundState::as_str(self)
    }

    fn can_become(self, next: Self) -> bool {
        use RoundState::*;
        matches!(
            (self, next),
            (Collecting, Aggregating | Failed)
                | (Aggregating, Applying | Failed)
                | (Applying, Completed | Failed)
        )
    }
}

impl StateMachine for AssignmentState {
    const ENTITY: &'static str = "assignment";
    const TABLE: &'static str = "assignments";
    const ALL: &'static [Self] = AssignmentState::ALL;

    fn as_str(self) -> &'static str {
        AssignmentState::as_str(self)
    }

    fn round_counter_deltas(self, next: Self) -> (i64, i64) {
        use AssignmentState::*;
        let live = |s: Self| matches!(s, Assigned | Uploaded | Completed);
        (
            i64::from(live(next)) - i64::from(live(self)),
            i64::from(next == Completed) - i64::from(self == Completed),
        )
    }

    fn can_become(self, next: Self) -> bool {
        use AssignmentState::*;
        matches!(
            (self, next),
            (Assigned, Uploaded | Failed | TimedOut | Rejected)
                | (Uploaded, Completed | Failed | TimedOut | Rejected)
        )
    }
}

/// An aggregation job's state (`aggregation_jobs.state`). A job is created PENDING with its
/// round's move to AGGREGATING (leases are columns of a pending job, not a state); it ends DONE
/// when its round completes or FAILED when its round fails. Only the operator's resume
/// (`db/resume.rs`) makes a FAILED job PENDING again, outside the machine like its round's return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Pending,
    Done,
    Failed,
}

impl JobState {
    pub const ALL: &'static [Self] = &[Self::Pending, Self::Done, Self::Failed];

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Done => "DONE",
            Self::Failed => "FAILED",
        }
    }
}

impl StateMachine for JobState {
    const ENTITY: &'static str = "aggregation job";
    const TABLE: &'static str = "aggregation_jobs";
    /// A round has at most one job, named by the round's id.
    const KEY: &'static str = "round_id";
    const ALL: &'static [Self] = JobState::ALL;

    fn as_str(self) -> &'static str {
        JobState::as_str(self)
    }

    fn can_become(self, next: Self) -> bool {
        use JobState::*;
        matches!((self, next), (Pending, Done | Failed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_transitions_are_exactly_the_design() {
        use JobState::*;
        assert_exactly(&[(Pending, Done), (Pending, Failed)]);
        assert!(Done.is_terminal() && Failed.is_terminal());
    }

    /// Checks a machine's table against the complete list of allowed transitions: every listed pair
    /// is allowed, every other pair is refused.
    fn assert_exactly<S: StateMachine>(allowed: &[(S, S)]) {
        for &from in S::ALL {
            for &to in S::ALL {
                let expected = allowed.contains(&(from, to));
                assert_eq!(
                    from.can_become(to),
                    expected,
                    "{} {:?} -> {:?}",
                    S::ENTITY,
                    from,
                    to
                );
            }
            assert_eq!(S::parse(from.as_str()), Some(from));
        }
        assert_eq!(S::parse("NOT_A_STATE"), None);
    }

    #[test]
    fn task_transitions_are_exactly_the_design() {
        use TaskState::*;
        assert_exactly(&[
            (Created, Open),
            (Created, Cancelled),
            (Open, Completed),
            (Open, Failed),
            (Open, Cancelled),
        ]);
        assert!(Completed.is_terminal() && Failed.is_terminal() && Cancelled.is_terminal());
        assert!(!Open.is_terminal());
    }

    #[test]
    fn round_transitions_are_exactly_the_design() {
        use RoundState::*;
        assert_exactly(&[
            (Collecting, Aggregating),
            (Collecting, Failed),
            (Aggregating, Applying),
            (Aggregating, Failed),
            (Applying, Completed),
            (Applying, Failed),
        ]);
    }

    #[test]
    fn assignment_transitions_move_the_round_counters() {
        use AssignmentState::*;
        assert_eq!(Assigned.round_counter_deltas(Uploaded), (0, 0));
        assert_eq!(Uploaded.round_counter_deltas(Completed), (0, 1));
        for freed in [Failed, TimedOut, Rejected] {
            assert_eq!(Assigned.round_counter_deltas(freed), (-1, 0));
            assert_eq!(Uploaded.round_counter_deltas(freed), (-1, 0));
        }
        assert_eq!(
            TaskState::Open.round_counter_deltas(TaskState::Cancelled),
            (0, 0)
        );
    }

    #[test]
    fn assignment_transitions_are_exactly_the_design() {
        use AssignmentState::*;
        let mut allowed = Vec::new();
        for to in [Uploaded, Failed, TimedOut, Rejected] {
            allowed.push((Assigned, to));
        }
        for to in [Completed, Failed, TimedOut, Rejected] {
            allowed.push((Uploaded, to));
        }
        assert_exactly(&allowed);
    }
}
