//! The scheduler: drives rounds by time. Each tick times out expired assignments (freeing their
//! slots) and closes the collecting rounds whose deadline has passed (to AGGREGATING with enough reports, else FAILED with a retry attempt or a failed task).
//! Time comes from the injected clock; tests call `tick` directly instead of sleeping.

use std::time::Duration;

use tokio::sync::watch;

use crate::db::{Db, DbError, DeadlineOutcome};

/// Rounds closed per tick at most, so one tick never holds the database for long.
const ROUNDS_PER_TICK: u32 = 256;
/// Assignments timed out per tick at most (one transaction).
const ASSIGNMENTS_PER_TICK: u32 = 1000;

#[derive(Debug, Clone)]
pub struct Scheduler {
    db: Db,
}

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TickSummary {
    pub assignments_timed_out: usize,
    pub aggregating: usize,
    pub retried: usize,
    pub tasks_failed: usize,
}

impl Scheduler {
    pub fn new(db: Db) -> Self {
        Self { db }
    }

    /// One pass over every round whose deadline has passed.
    pub async fn tick(&self) -> Result<TickSummary, DbError> {
        let mut summary = TickSummary {
            assignments_timed_out: self.db.expire_assignments(ASSIGNMENTS_PER_TICK).await?,
            ..TickSummary::default()
        };
        if summary.assignments_timed_out > 0 {
            metrics::counter!("confed_assignments_timed_out_total")
                .increment(summary.assignments_timed_out as u64);
        }
        for round_id in self.db.rounds_past_deadline(ROUNDS_PER_TICK).await? {
            let outcome = self.db.close_round_at_deadline(&round_id).await?;
            match &outcome {
                DeadlineOutcome::Aggregating { .. } => summary.aggregating += 1,
                DeadlineOutcome::Retried { .. } => summary.retried += 1,
                DeadlineOutcome::TaskFailed { .. } => summary.tasks_failed += 1,
                DeadlineOutcome::Skipped => continue,
            }
            tracing::info!(round = %round_id, ?outcome, "round deadline reached");
            metrics::counter!("confed_round_deadlines_total", "outcome" => outcome_label(&outcome))
                .increment(1);
        }
        Ok(summary)
    }

    /// Ticks every `period` until `shutdown` turns true. A failed tick is logged and retried on the
    /// next one: every transition is one transaction, so nothing is half-applied.
    pub async fn run(self, period: Duration, mut shutdown: watch::Receiver<bool>) {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => {
                    if let Err(error) = self.tick().await {
                        tracing::error!(%error, "scheduler tick failed; retrying next tick");
                    }
                }
                _ = shutdown.changed() => break,
            }
            if *shutdown.borrow() {
                break;
            }
        }
        tracing::info!("scheduler stopped");
    }
}

fn outcome_label(outcome: &DeadlineOutcome) -> &'static str {
    match outcome {
        DeadlineOutcome::Aggregating { .. } => "aggregating",
        DeadlineOutcome::Retried { .. } => "retried",
        DeadlineOutcome::TaskFailed { .. } => "task_failed",
        DeadlineOutcome::Skipped => "skipped",
    }
}
