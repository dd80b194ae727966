//! The device protocol's database operations: assigning devices to rounds without over-filling
//! them, recording uploads idempotently, reports, the round goal, and assignment expiry.

use rusqlite::OptionalExtension;

use super::writer::Raw;
use super::{Conn, Db, DbError, Engine, device_postgres, history, parse_state, transition};
use crate::states::{AssignmentState, RoundState, StateMachine};
use crate::task_spec::TaskSpec;

/// A collecting round a device of the population might join.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub round_id: String,
    pub task_id: String,
    pub tenant_id: String,
    pub round_number: i64,
    pub attempt: i64,
    pub deadline_at: i64,
    pub key_id: Option<String>,
    pub model_version: i64,
    pub live: i64,
    /// Parsed once per task and shared: a task's definition never changes after creation.
    pub spec: std::sync::Arc<TaskSpec>,
}

/// A new assignment.
#[derive(Debug, Clone)]
pub struct Assigned {
    pub key_id: String,
    pub expires_at: i64,
}

/// An assignment as the upload and report routes see it.
#[derive(Debug, Clone)]
pub struct AssignmentView {
    pub id: String,
    pub state: AssignmentState,
    pub expires_at: i64,
    pub round_id: String,
    pub round_state: RoundState,
    pub round_number: i64,
    pub attempt: i64,
    pub key_id: Option<String>,
    pub task_id: String,
    pub tenant_id: String,
    pub contribution_sha256: Option<String>,
    /// Size of the task's current model: an update has the same tensors, so about the same size.
    pub model_bytes: i64,
    /// The task's current model version (the one the assignment's round trains from).
    pub model_version: Option<i64>,
}

/// Why a device's request cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    UnknownAssignment,
    Expired,
    RoundClosed,
    DifferentBytes,
    NotUploaded,
    Finished(AssignmentState),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    New,
    Again,
}

pub use confed_protocol::device::ReportOutcome;

/// The state a report moves its assignment to.
fn report_target(outcome: ReportOutcome) -> AssignmentState {
    match outcome {
        ReportOutcome::Completed => AssignmentState::Completed,
        ReportOutcome::Failed => AssignmentState::Failed,
        ReportOutcome::NotEligible => AssignmentState::Rejected,
    }
}

/// The database id of an assignment: SHA-256 (hex) of the capability the device holds, the same
/// reference the contribution's associated data binds.
pub fn assignment_key(capability: &str) -> String {
    confed_enclave::envelope::assignment_ref(capability)
}

pub(super) type CandidateRow = (
    String,
    String,
    String,
    i64,
    i64,
    Option<String>,
    Option<i64>,
    i64,
    String,
    i64,
);
type ViewRow = (
    String,
    String,
    i64,
    String,
    String,
    i64,
    i64,
    Option<String>,
    String,
    String,
    Option<String>,
    Option<i64>,
    Option<i64>,
);

const VIEW_SQL: &str = "SELECT a.id, a.state, a.expires_at, r.id, r.state, r.round_number, \
     r.attempt, r.key_id, t.id, t.tenant_id, a.contribution_sha256, \
     (SELECT m.size_bytes FROM models m WHERE m.task_id = t.id AND m.version = t.model_version), \
     t.model_version \
     FROM assignments a JOIN rounds r ON r.id = a.round_id JOIN tasks t ON t.id = r.task_id \
     WHERE a.id = $1";

async fn view(conn: &mut Conn, id: &str) -> Result<Option<AssignmentView>, DbError> {
    let row: Option<ViewRow> = sqlx::query_as(VIEW_SQL)
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
    row.map(view_from_row).transpose()
}

fn view_from_row(r: ViewRow) -> Result<AssignmentView, DbError> {
    Ok(AssignmentView {
        id: r.0,
        state: parse_state(&r.1)?,
        expires_at: r.2,
        round_id: r.3,
        round_state: parse_state(&r.4)?,
        round_number: r.5,
        attempt: r.6,
        key_id: r.7,
        task_id: r.8,
        tenant_id: r.9,
        contribution_sha256: r.10,
        model_bytes: r.11.unwrap_or(0),
        model_version: r.12,
    })
}

/// What the writer needs of an assignment to apply an upload or a report (a light read: the
/// writer is serial, so it reads no more than it must).
struct WriteView {
    id: String,
    state: AssignmentState,
    expires_at: i64,
    round_state: RoundState,
    contribution_sha256: Option<String>,
}

async fn write_view(conn: &mut Conn, id: &str) -> Result<Option<WriteView>, DbError> {
    let row: Option<(String, String, i64, String, Option<String>)> = sqlx::query_as(
        "SELECT a.id, a.state, a.expires_at, r.state, a.contribution_sha256 \
         FROM assignments a JOIN rounds r ON r.id = a.round_id WHERE a.id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(WriteView {
        id: r.0,
        state: parse_state(&r.1)?,
        expires_at: r.2,
        round_state: parse_state(&r.3)?,
        contribution_sha256: r.4,
    }))
}

impl Db {
    /// Collecting rounds of open tasks in a population, with how many live assignments each has.
    pub async fn checkin_candidates(&self, population: &str) -> Result<Vec<Candidate>, DbError> {
        // On SQLite, on a raw read connection: every check-in runs this, and a round trip to a
        // sqlx worker thread costs more than the read.
        let rows: Vec<CandidateRow> = if self.engine() == Engine::Postgres {
            device_postgres::checkin_candidates(self, population).await?
        } else {
            self.read_raw(|c| {
                let mut statement = c.prepare_cached(
                    "SELECT r.id, t.id, t.tenant_id, r.round_number, r.deadline_at, r.key_id, \
                 t.model_version, r.live_assignments, t.spec_json, r.attempt \
                 FROM rounds r JOIN tasks t ON t.id = r.task_id \
                 JOIN populations p ON p.name = t.population AND p.tenant_id = t.tenant_id \
                 WHERE t.population = ?1 AND t.state = 'OPEN' AND r.state = 'COLLECTING'",
                )?;
                let rows = statement.query_map([population], |r| {
                    Ok((
                        r.get(0)?,
                        r.get(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                        r.get(6)?,
                        r.get(7)?,
                        r.get(8)?,
                        r.get(9)?,
                    ))
                })?;
                Ok(rows.collect::<Result<Vec<_>, _>>()?)
            })?
        };
        rows.into_iter()
            .map(|r| {
                let spec = self.spec_of(&r.1, &r.8)?;
                Ok(Candidate {
                    round_id: r.0,
                    task_id: r.1,
                    tenant_id: r.2,
                    round_number: r.3,
                    attempt: r.9,
                    deadline_at: r.4,
                    key_id: r.5,
                    model_version: r.6.unwrap_or(0),
                    live: r.7,
                    spec,
                })
            })
            .collect()
    }

    /// Takes a slot of a collecting round, or `None` if the round is full or no longer collecting.
    /// The round row is locked first, so concurrent check-ins can never exceed `capacity`. The
    /// round's key is fixed by its first assignment (`key_if_unset`).
    pub async fn assign(
        &self,
        round_id: &str,
        capacity: u64,
        capability: &str,
        expires_at: i64,
        key_if_unset: &str,
        now: i64,
    ) -> Result<Option<Assigned>, DbError> {
        let round_id = round_id.to_string();
        let id = assignment_key(capability);
        let key_if_unset = key_if_unset.to_string();
        let history_id = super::new_history_id();
        let capacity = i64::try_from(capacity).unwrap_or(i64::MAX);
        if self.engine() == Engine::Postgres {
            return device_postgres::assign(
                self,
                round_id,
                id,
                capacity,
                key_if_unset,
                expires_at,
                now,
            )
            .await;
        }
        self.write_raw(move |c| {
            // The guarded update locks the round, checks and takes the slot and fixes the key;
            // the assignment and its first history row follow only if it took one.
            let key_id: Option<Option<String>> = c
                .prepare_cached(
                    "UPDATE rounds SET key_id = COALESCE(key_id, ?2), \
                     live_assignments = live_assignments + 1 \
                     WHERE id = ?1 AND state = 'COLLECTING' AND live_assignments < ?3 \
                     RETURNING key_id",
                )?
                .query_row(rusqlite::params![round_id, key_if_unset, capacity], |r| r.get(0))
                .optional()?;
            let Some(Some(key_id)) = key_id else {
                return Ok(Raw::Done(None));
            };
            c.prepare_cached(
                "INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
                 VALUES (?1, ?2, 'ASSIGNED', ?3, ?4, ?4)",
            )?
            .execute(rusqlite::params![id, round_id, expires_at, now])?;
            c.prepare_cached(
                "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                 VALUES (?1, 'assignment', ?2, 1, NULL, 'ASSIGNED', 'device checked in', ?3)",
            )?
            .execute(rusqlite::params![history_id, id, now])?;
            Ok(Raw::Done(Some(Assigned { key_id, expires_at })))
        })
        .await
    }

    /// The assignment a capability names, with its round and task.
    pub async fn assignment(&self, capability: &str) -> Result<Option<AssignmentView>, DbError> {
        let id = assignment_key(capability);
        if self.engine() == Engine::Postgres {
            let mut conn = self.pool().acquire().await?;
            return view(&mut conn, &id).await;
        }
        // On SQLite, on a raw read connection: every upload and every model download reads it,
        // and a hop to a sqlx worker thread costs more than the read.
        let row: Option<ViewRow> = self.read_raw(|c| {
            // SQLite reads `$1` as a parameter too (bound by position here).
            let mut statement = c.prepare_cached(VIEW_SQL)?;
            let mut rows = statement.query_map([&id], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                    r.get(8)?,
                    r.get(9)?,
                    r.get(10)?,
                    r.get(11)?,
                    r.get(12)?,
                ))
            })?;
            Ok(rows.next().transpose()?)
        })?;
        row.map(view_from_row).transpose()
    }

    /// Records a stored contribution (ASSIGNED -> UPLOADED). The same bytes again are accepted
    /// (`Stored::Again`); different bytes for a used assignment are refused. `blob_key` names
    /// bytes the contribution store has already made durable.
    pub async fn record_upload(
        &self,
        capability: &str,
        sha256_hex: &str,
        size: i64,
        blob_key: &str,
        now: i64,
    ) -> Result<Result<Stored, Refusal>, DbError> {
        let id = assignment_key(capability);
        let sha256_hex = sha256_hex.to_string();
        let blob_key = blob_key.to_string();
        let history_id = super::new_history_id();
        if self.engine() == Engine::Postgres {
            return device_postgres::record_upload(self, id, sha256_hex, size, blob_key, now).await;
        }
        self.write_raw(move |c| {
            // Common path: the guards are the upload's checks, and the update is the ASSIGNED ->
            // UPLOADED transition (compare-and-set on the state; it moves no round counter).
            debug_assert!(AssignmentState::Assigned.can_become(AssignmentState::Uploaded));
            let changed = c
                .prepare_cached(
                    "UPDATE assignments SET state = 'UPLOADED', updated_at = ?1, \
                     contribution_sha256 = ?2, contribution_bytes = ?3, blob_key = ?4 \
                     WHERE id = ?5 AND state = 'ASSIGNED' AND contribution_sha256 IS NULL \
                     AND expires_at > ?1 AND EXISTS (SELECT 1 FROM rounds r \
                     WHERE r.id = assignments.round_id AND r.state = 'COLLECTING')",
                )?
                .execute(rusqlite::params![now, sha256_hex, size, blob_key, id])?;
            if changed == 0 {
                // Only a refusal (or a repeated upload) reads the row to say why.
                return Ok(Raw::After(Box::new(move |tx| {
                    Box::pin(async move { upload_refused(tx, &id, &sha256_hex, now).await })
                })));
            }
            c.prepare_cached(
                "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                 SELECT ?1, 'assignment', ?2, COALESCE(MAX(seq), 0) + 1, 'ASSIGNED', 'UPLOADED', \
                 'contribution stored', ?3 FROM state_history WHERE entity_id = ?2",
            )?
            .execute(rusqlite::params![history_id, id, now])?;
            Ok(Raw::Done(Ok(Stored::New)))
        })
        .await
    }

    /// Applies a device's report. A completed report that reaches the round's goal moves the round
    /// to AGGREGATING in the same transaction. Repeating the same report is accepted.
    pub async fn record_report(
        &self,
        capability: &str,
        outcome: ReportOutcome,
        device_error: Option<&str>,
        now: i64,
    ) -> Result<Result<AssignmentState, Refusal>, DbError> {
        let id = assignment_key(capability);
        let device_error = device_error.map(str::to_string);
        if outcome != ReportOutcome::Completed {
            return self
                .write(move |tx| {
                    Box::pin(async move {
                        report_slow(tx, &id, outcome, device_error.as_deref(), now).await
                    })
                })
                .await;
        }
        let history_id = super::new_history_id();
        if self.engine() == Engine::Postgres {
            return device_postgres::record_completed(self, id, now).await;
        }
        self.write_raw(move |c| {
            use AssignmentState::{Completed, Uploaded};
            debug_assert!(Uploaded.can_become(Completed));
            debug_assert_eq!(Uploaded.round_counter_deltas(Completed), (0, 1));
            // Common path: the guarded UPLOADED -> COMPLETED transition (compare-and-set plus the
            // report's checks), its history row, and the round's counter, which says whether the
            // goal is reached.
            let changed = c
                .prepare_cached(
                    "UPDATE assignments SET state = 'COMPLETED', updated_at = ?1 \
                     WHERE id = ?2 AND state = 'UPLOADED' AND expires_at > ?1 \
                     AND EXISTS (SELECT 1 FROM rounds r \
                     WHERE r.id = assignments.round_id AND r.state = 'COLLECTING')",
                )?
                .execute(rusqlite::params![now, id])?;
            if changed == 0 {
                return Ok(Raw::After(Box::new(move |tx| {
                    Box::pin(async move { report_slow(tx, &id, outcome, None, now).await })
                })));
            }
            c.prepare_cached(
                "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                 SELECT ?1, 'assignment', ?2, COALESCE(MAX(seq), 0) + 1, 'UPLOADED', 'COMPLETED', \
                 'device reported completion', ?3 FROM state_history WHERE entity_id = ?2",
            )?
            .execute(rusqlite::params![history_id, id, now])?;
            let (round_id, goal, completed): (String, i64, i64) = c
                .prepare_cached(
                    "UPDATE rounds SET completed_reports = completed_reports + 1 \
                     WHERE id = (SELECT round_id FROM assignments WHERE id = ?1) \
                     RETURNING id, report_goal, completed_reports",
                )?
                .query_row(rusqlite::params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            if completed < goal {
                return Ok(Raw::Done(Ok(Completed)));
            }
            // The goal is reached (once per round): close the round for aggregation and record
            // its job, in the same savepoint (what `rounds::close` and `jobs::create` do).
            debug_assert!(RoundState::Collecting.can_become(RoundState::Aggregating));
            let closed = c
                .prepare_cached(
                    "UPDATE rounds SET state = 'AGGREGATING', updated_at = ?2 \
                     WHERE id = ?1 AND state = 'COLLECTING'",
                )?
                .execute(rusqlite::params![round_id, now])?;
            if closed != 1 {
                return Err(DbError::Corrupt(format!(
                    "round {round_id} reached its goal but is not collecting"
                )));
            }
            c.prepare_cached(
                "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                 SELECT ?1, 'round', ?2, COALESCE(MAX(seq), 0) + 1, 'COLLECTING', 'AGGREGATING', ?3, ?4 \
                 FROM state_history WHERE entity_id = ?2",
            )?
            .execute(rusqlite::params![
                super::new_history_id(),
                round_id,
                format!("report goal {goal} reached"),
                now
            ])?;
            c.prepare_cached(
                "INSERT INTO aggregation_jobs (round_id, task_id, state, not_before, created_at, updated_at) \
                 SELECT id, task_id, 'PENDING', ?2, ?2, ?2 FROM rounds WHERE id = ?1",
            )?
            .execute(rusqlite::params![round_id, now])?;
            Ok(Raw::Done(Ok(Completed)))
        })
        .await
    }

    /// (assignment ref, blob key) of every completed contribution of a task's round (all attempts
    /// of that round number that completed; at most one attempt completes).
    pub async fn completed_contributions(
        &self,
        task_id: &str,
        round_number: i64,
    ) -> Result<Vec<(String, String)>, DbError> {
        Ok(sqlx::query_as(
            "SELECT a.id, a.blob_key FROM assignments a JOIN rounds r ON r.id = a.round_id \
             WHERE r.task_id = $1 AND r.round_number = $2 AND a.state = 'COMPLETED' \
             AND a.blob_key IS NOT NULL ORDER BY a.id",
        )
        .bind(task_id)
        .bind(round_number)
        .fetch_all(self.pool())
        .await?)
    }

    /// Times out assignments past their expiry (ASSIGNED or UPLOADED but not reported), freeing
    /// their slots. Returns how many.
    pub async fn expire_assignments(&self, now: i64, limit: u32) -> Result<usize, DbError> {
        self.write(move |tx| {
            Box::pin(async move {
                let due: Vec<(String, String)> = sqlx::query_as(
                    "SELECT id, state FROM assignments WHERE state IN ('ASSIGNED', 'UPLOADED') \
                     AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
                )
                .bind(now)
                .bind(i64::from(limit))
                .fetch_all(&mut *tx)
                .await?;
                for (id, state) in &due {
                    let from: AssignmentState = parse_state(state)?;
                    transition(
                        &mut *tx,
                        id,
                        from,
                        AssignmentState::TimedOut,
                        "assignment expired",
                        now,
                    )
                    .await?;
                }
                Ok(due.len())
            })
        })
        .await
    }
}

/// Why an upload's guarded update changed nothing: a repeated upload of the same bytes, or a
/// refusal.
pub(super) async fn upload_refused(
    conn: &mut Conn,
    id: &str,
    sha256_hex: &str,
    now: i64,
) -> Result<Result<Stored, Refusal>, DbError> {
    let Some(a) = write_view(conn, id).await? else {
        return Ok(Err(Refusal::UnknownAssignment));
    };
    if let Some(stored) = &a.contribution_sha256 {
        return Ok(if stored == sha256_hex {
            Ok(Stored::Again)
        } else {
            Err(Refusal::DifferentBytes)
        });
    }
    Ok(Err(closed(&a, now).unwrap_or(Refusal::Finished(a.state))))
}

/// A report off the common path: a failure or not-eligible report, a repeated report, or a
/// refusal (read the row, say why).
pub(super) async fn report_slow(
    conn: &mut Conn,
    id: &str,
    outcome: ReportOutcome,
    device_error: Option<&str>,
    now: i64,
) -> Result<Result<AssignmentState, Refusal>, DbError> {
    let Some(a) = write_view(conn, id).await? else {
        return Ok(Err(Refusal::UnknownAssignment));
    };
    let target = report_target(outcome);
    if a.state == target {
        return Ok(Ok(target));
    }
    if a.state.is_terminal() {
        return Ok(Err(Refusal::Finished(a.state)));
    }
    if outcome == ReportOutcome::Completed && a.state != AssignmentState::Uploaded {
        return Ok(Err(Refusal::NotUploaded));
    }
    if let Some(refusal) = closed(&a, now) {
        return Ok(Err(refusal));
    }
    if outcome == ReportOutcome::Completed {
        // The fast path applies every completion its guards allow; reaching here means the row
        // changed under the single writer, which cannot happen.
        return Err(DbError::Corrupt(format!(
            "completion of {} neither applied nor refused",
            a.id
        )));
    }
    if let Some(error) = device_error {
        sqlx::query("UPDATE assignments SET device_error = $1 WHERE id = $2")
            .bind(error.chars().take(1000).collect::<String>())
            .bind(&a.id)
            .execute(&mut *conn)
            .await?;
    }
    let reason = match outcome {
        ReportOutcome::Failed => "device reported failure",
        _ => "device found itself not eligible",
    };
    transition(conn, &a.id, a.state, target, reason, now).await?;
    Ok(Ok(target))
}

/// Inserts an ASSIGNED assignment and its first history row. The round's `live_assignments`
/// counter is the caller's to move (check-in takes the slot in its guarded update).
pub(crate) async fn insert_row(
    conn: &mut Conn,
    id: &str,
    round_id: &str,
    expires_at: i64,
    reason: &str,
    now: i64,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $5)",
    )
    .bind(id)
    .bind(round_id)
    .bind(AssignmentState::Assigned.as_str())
    .bind(expires_at)
    .bind(now)
    .execute(&mut *conn)
    .await?;
    history::append(
        conn,
        "assignment",
        id,
        None,
        AssignmentState::Assigned.as_str(),
        reason,
        now,
    )
    .await
}

/// Whether the assignment can no longer take uploads or reports.
fn closed(a: &WriteView, now: i64) -> Option<Refusal> {
    if a.round_state != RoundState::Collecting {
        Some(Refusal::RoundClosed)
    } else if now >= a.expires_at || a.state == AssignmentState::TimedOut {
        Some(Refusal::Expired)
    } else if a.state.is_terminal() {
        Some(Refusal::Finished(a.state))
    } else {
        None
    }
}
