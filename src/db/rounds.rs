//! Rounds: opening, listing, and closing at the deadline with retry attempts.

use super::{Conn, Db, DbError, history, new_id, parse_state, tasks, transition};
use crate::clock::Millis;
use crate::states::{RoundState, StateMachine, TaskState};
use crate::task_spec::TaskSpec;

/// Round states in which a round still holds its task's attention.
pub(crate) const LIVE_ROUND_STATES: [RoundState; 3] = [
    RoundState::Collecting,
    RoundState::Aggregating,
    RoundState::Applying,
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundRecord {
    pub id: String,
    pub task_id: String,
    pub round_number: i64,
    pub attempt: i64,
    pub state: RoundState,
    pub report_goal: i64,
    pub min_reports: i64,
    /// Completed reports (assignments in COMPLETED).
    pub reports_received: i64,
    pub deadline_at: i64,
    pub opened_at: i64,
    pub closed_at: Option<i64>,
    /// The partner asked to evaluate this round on demand.
    pub on_demand_evaluation: bool,
    /// Why the round failed (the reason of its last transition, from the state history);
    /// `None` in any other state.
    pub failure_reason: Option<String>,
}

/// What the scheduler did with a round whose deadline passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadlineOutcome {
    /// Enough reports: the round moved to AGGREGATING.
    Aggregating { reports: i64 },
    /// Too few reports: the round failed and a new attempt opened.
    Retried { reports: i64, next_attempt: i64 },
    /// Too few reports and no attempts left: the round and its task failed.
    TaskFailed { reports: i64 },
    /// Nothing to do (the round was no longer collecting or its deadline moved).
    Skipped,
}

/// A round's row, by the column names of `ROUND_SELECT`.
#[derive(sqlx::FromRow)]
struct RoundRow {
    id: String,
    task_id: String,
    round_number: i64,
    attempt: i64,
    state: String,
    report_goal: i64,
    min_reports: i64,
    completed_reports: i64,
    deadline_at: i64,
    opened_at: i64,
    closed_at: Option<i64>,
    on_demand_evaluation: i64,
    failure_reason: Option<String>,
}

const ROUND_SELECT: &str = "SELECT r.id AS id, r.task_id AS task_id, \
     r.round_number AS round_number, r.attempt AS attempt, r.state AS state, \
     r.report_goal AS report_goal, r.min_reports AS min_reports, \
     r.completed_reports AS completed_reports, r.deadline_at AS deadline_at, \
     r.opened_at AS opened_at, r.closed_at AS closed_at, \
     r.on_demand_evaluation AS on_demand_evaluation, \
     CASE WHEN r.state = 'FAILED' THEN (SELECT h.reason FROM state_history h \
      WHERE h.entity_id = r.id AND h.entity = 'round' ORDER BY h.seq DESC LIMIT 1) END \
      AS failure_reason FROM rounds r";

fn round_from_row(row: RoundRow) -> Result<RoundRecord, DbError> {
    Ok(RoundRecord {
        state: parse_state(&row.state)?,
        id: row.id,
        task_id: row.task_id,
        round_number: row.round_number,
        attempt: row.attempt,
        report_goal: row.report_goal,
        min_reports: row.min_reports,
        reports_received: row.completed_reports,
        deadline_at: row.deadline_at,
        opened_at: row.opened_at,
        closed_at: row.closed_at,
        on_demand_evaluation: row.on_demand_evaluation != 0,
        failure_reason: row.failure_reason,
    })
}

/// Opens a round (COLLECTING) of a task with the task's goal and deadline.
pub(crate) async fn open(
    conn: &mut Conn,
    task: &tasks::TaskRecord,
    round_number: i64,
    attempt: i64,
    now: Millis,
) -> Result<String, DbError> {
    let now = now.0;
    let spec: &TaskSpec = &task.spec;
    let id = new_id();
    let deadline = crate::clock::Millis(now)
        .plus(std::time::Duration::from_secs(u64::from(
            spec.round_deadline_seconds,
        )))
        .0;
    let dropout = previous_dropout(conn, &task.id).await?;
    let capacity = spec.capacity_for(dropout) as i64;
    let key_id = tree_key(conn, task, round_number).await?;
    let on_demand = take_evaluation_request(conn, task, round_number).await?;
    sqlx::query(
        "INSERT INTO rounds (id, task_id, round_number, attempt, state, report_goal, min_reports, \
         deadline_at, opened_at, closed_at, updated_at, capacity, key_id, on_demand_evaluation) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, NULL, $9, $10, $11, $12)",
    )
    .bind(&id)
    .bind(&task.id)
    .bind(round_number)
    .bind(attempt)
    .bind(RoundState::Collecting.as_str())
    .bind(i64::from(spec.report_goal))
    .bind(i64::from(spec.min_reports))
    .bind(deadline)
    .bind(now)
    .bind(capacity)
    .bind(key_id)
    .bind(i64::from(on_demand))
    .execute(&mut *conn)
    .await?;
    let reason = if on_demand {
        format!("round {round_number} attempt {attempt} opened, evaluating on demand")
    } else {
        format!("round {round_number} attempt {attempt} opened")
    };
    history::append(
        conn,
        "round",
        &id,
        None,
        RoundState::Collecting.as_str(),
        &reason,
        Millis(now),
    )
    .await?;
    Ok(id)
}

/// The key a round of a tree-mechanism task must use: the one its tree's first completed round
/// was released under (the key services refuse any other: `Mechanism::key_scope`). `None`
/// (the round's first check-in picks the current key) for the Gaussian mechanism and for a
/// tree's first round.
async fn tree_key(
    conn: &mut Conn,
    task: &tasks::TaskRecord,
    round_number: i64,
) -> Result<Option<String>, DbError> {
    let Some(scope) = task.spec.privacy.mechanism().key_scope(round_number as u64) else {
        return Ok(None);
    };
    let length = i64::from(task.spec.privacy.mechanism().min_separation());
    let first = scope as i64 * length + 1;
    Ok(sqlx::query_scalar(
        "SELECT key_id FROM rounds WHERE task_id = $1 AND round_number >= $2 \
         AND round_number < $3 AND state = 'COMPLETED' AND key_id IS NOT NULL \
         ORDER BY round_number LIMIT 1",
    )
    .bind(&task.id)
    .bind(first)
    .bind(round_number)
    .fetch_optional(&mut *conn)
    .await?)
}

/// The drop-out rate of the task's latest round attempt so far: the share of its assignments
/// that failed or timed out. Late deliveries do not count: when a round reaches its goal early,
/// the devices still training are the over-selected surplus, and counting them would ratchet
/// the capacity up round after round. `None` before any attempt, or with fewer than
/// `MIN_ASSIGNMENTS_FOR_DROPOUT` assignments (too few to judge by).
async fn previous_dropout(conn: &mut Conn, task_id: &str) -> Result<Option<f64>, DbError> {
    let counts: Option<(i64, i64)> = sqlx::query_as(
        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN a.state IN ('FAILED', 'TIMED_OUT') \
         THEN 1 ELSE 0 END), 0) \
         FROM assignments a WHERE a.round_id = (SELECT id FROM rounds WHERE task_id = $1 \
         ORDER BY round_number DESC, attempt DESC LIMIT 1)",
    )
    .bind(task_id)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match counts {
        Some((assigned, dropped)) if assigned >= MIN_ASSIGNMENTS_FOR_DROPOUT => {
            Some(dropped as f64 / assigned as f64)
        }
        _ => None,
    })
}

/// Fewest assignments of a round whose drop-out rate the next round's capacity adapts to.
pub(super) const MIN_ASSIGNMENTS_FOR_DROPOUT: i64 = 10;

/// Moves a round to a later state; a terminal state also stamps `closed_at`.
pub(crate) async fn close(
    conn: &mut Conn,
    round_id: &str,
    from: RoundState,
    to: RoundState,
    reason: &str,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    transition(conn, round_id, from, to, reason, Millis(now)).await?;
    if to == RoundState::Aggregating {
        super::jobs::create(conn, round_id, Millis(now)).await?;
    }
    if to.is_terminal() {
        sqlx::query("UPDATE rounds SET closed_at = $1 WHERE id = $2")
            .bind(now)
            .bind(round_id)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

pub(crate) async fn load_for_task(
    conn: &mut Conn,
    task_id: &str,
) -> Result<Vec<RoundRecord>, DbError> {
    let sql = format!("{ROUND_SELECT} WHERE r.task_id = $1 ORDER BY r.round_number, r.attempt");
    let rows: Vec<RoundRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(task_id)
        .fetch_all(&mut *conn)
        .await?;
    rows.into_iter().map(round_from_row).collect()
}

pub(crate) async fn load_one(conn: &mut Conn, round_id: &str) -> Result<RoundRecord, DbError> {
    let sql = format!("{ROUND_SELECT} WHERE r.id = $1");
    let row: Option<RoundRow> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(round_id)
        .fetch_optional(&mut *conn)
        .await?;
    round_from_row(row.ok_or_else(|| DbError::NotFound {
        entity: "round",
        id: round_id.to_string(),
    })?)
}

impl Db {
    /// Every round and attempt of one tenant's task, in order.
    pub async fn rounds(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<RoundRecord>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        load_for_task(&mut conn, task_id).await
    }

    /// Ids of collecting rounds whose deadline is at or before `now`, oldest deadline first.
    pub async fn rounds_past_deadline(&self, limit: u32) -> Result<Vec<String>, DbError> {
        let now = self.now().0;
        Ok(sqlx::query_scalar(
            "SELECT id FROM rounds WHERE state = $1 AND deadline_at <= $2 \
             ORDER BY deadline_at LIMIT $3",
        )
        .bind(RoundState::Collecting.as_str())
        .bind(now)
        .bind(i64::from(limit))
        .fetch_all(self.pool())
        .await?)
    }

    /// Closes one collecting round whose deadline has passed, in one transaction: with at least
    /// `min_reports` reports it moves to AGGREGATING; otherwise it fails, and the task either
    /// opens a new attempt of the same round or, out of attempts, fails.
    pub async fn close_round_at_deadline(
        &self,
        round_id: &str,
    ) -> Result<DeadlineOutcome, DbError> {
        let now = self.now().0;
        let round_id = round_id.to_string();
        let outcome = self
            .write(move |tx| {
                Box::pin(async move {
                    let round_id = round_id.as_str();
                    let round = load_one(&mut *tx, round_id).await?;
                    if round.state != RoundState::Collecting || round.deadline_at > now {
                        return Ok(DeadlineOutcome::Skipped);
                    }
                    let reports = round.reports_received;
                    let outcome = if reports >= round.min_reports {
                        let reason = format!(
                            "deadline reached with {reports} reports (minimum {})",
                            round.min_reports
                        );
                        close(
                            &mut *tx,
                            round_id,
                            RoundState::Collecting,
                            RoundState::Aggregating,
                            &reason,
                            Millis(now),
                        )
                        .await?;
                        DeadlineOutcome::Aggregating { reports }
                    } else {
                        let reason = format!(
                            "deadline reached with {reports} reports, fewer than the minimum {}: \
                             too few devices of the population checked in and reported in time \
                             (the task's recent_eligible_checkins counts those that match it); \
                             lengthen round_deadline_seconds or lower min_reports",
                            round.min_reports
                        );
                        close(
                            &mut *tx,
                            round_id,
                            RoundState::Collecting,
                            RoundState::Failed,
                            &reason,
                            Millis(now),
                        )
                        .await?;
                        let task = tasks::load_any(&mut *tx, &round.task_id).await?;
                        if task.state != TaskState::Open {
                            DeadlineOutcome::Skipped
                        } else if round.attempt < i64::from(task.spec.max_round_attempts) {
                            let next_attempt = round.attempt + 1;
                            open(
                                &mut *tx,
                                &task,
                                round.round_number,
                                next_attempt,
                                Millis(now),
                            )
                            .await?;
                            DeadlineOutcome::Retried {
                                reports,
                                next_attempt,
                            }
                        } else {
                            let reason = format!(
                                "round {} failed {} times, the task's max_round_attempts; \
                                 the last attempt: {reason}",
                                round.round_number, round.attempt
                            );
                            transition(
                                &mut *tx,
                                &task.id,
                                TaskState::Open,
                                TaskState::Failed,
                                &reason,
                                Millis(now),
                            )
                            .await?;
                            DeadlineOutcome::TaskFailed { reports }
                        }
                    };
                    Ok(outcome)
                })
            })
            .await?;
        if matches!(outcome, DeadlineOutcome::Aggregating { .. }) {
            self.announce_job().await;
        }
        Ok(outcome)
    }
}

/// Whether round `round_number`, now opening, evaluates on demand: an earlier attempt of it did,
/// or the partner's pending request (`Db::request_evaluation`) is taken now. A round the
/// schedule evaluates anyway takes the request without marking itself (it costs nothing more).
async fn take_evaluation_request(
    conn: &mut Conn,
    task: &tasks::TaskRecord,
    round_number: i64,
) -> Result<bool, DbError> {
    let Some(evaluation) = task.spec.evaluation.map(|e| e.policy()) else {
        return Ok(false);
    };
    if evaluation.on_demand == 0 {
        // A stray request (a row edited by hand) would flag a round the enclave must refuse.
        return Ok(false);
    }
    let earlier: Option<i64> = sqlx::query_scalar(
        "SELECT MAX(on_demand_evaluation) FROM rounds WHERE task_id = $1 AND round_number = $2",
    )
    .bind(&task.id)
    .bind(round_number)
    .fetch_one(&mut *conn)
    .await?;
    if earlier.unwrap_or(0) != 0 {
        return Ok(true);
    }
    // Test and clear in one statement: a request made meanwhile is never lost.
    let requested = sqlx::query(
        "UPDATE tasks SET evaluation_requested = 0 WHERE id = $1 AND evaluation_requested <> 0",
    )
    .bind(&task.id)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        > 0;
    let scheduled = u64::try_from(round_number).is_ok_and(|r| evaluation.evaluates(r));
    Ok(requested && !scheduled)
}
