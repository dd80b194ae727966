//! The device protocol's database operations: assigning devices to rounds without over-filling
//! them, recording uploads idempotently, reports, the round goal, and assignment expiry.

use super::{Conn, Db, DbError, history, parse_state, rounds, transition};
use crate::states::{AssignmentState, RoundState, StateMachine};
use crate::task_spec::TaskSpec;

/// A collecting round a device of the population might join.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub round_id: String,
    pub task_id: String,
    pub tenant_id: String,
    pub round_number: i64,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportOutcome {
    Completed,
    Failed,
    NotEligible,
}

impl ReportOutcome {
    fn target(self) -> AssignmentState {
        match self {
            Self::Completed => AssignmentState::Completed,
            Self::Failed => AssignmentState::Failed,
            Self::NotEligible => AssignmentState::Rejected,
        }
    }
}

/// The database id of an assignment: SHA-256 (hex) of the capability the device holds, the same
/// reference the contribution's associated data binds.
pub fn assignment_key(capability: &str) -> String {
    confed_enclave::envelope::assignment_ref(capability)
}

type CandidateRow = (
    String,
    String,
    String,
    i64,
    i64,
    Option<String>,
    Option<i64>,
    i64,
    String,
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
);

async fn view(conn: &mut Conn, id: &str) -> Result<Option<AssignmentView>, DbError> {
    let row: Option<ViewRow> = sqlx::query_as(
        "SELECT a.id, a.state, a.expires_at, r.id, r.state, r.round_number, r.attempt, r.key_id, \
         t.id, t.tenant_id, a.contribution_sha256, \
         (SELECT m.size_bytes FROM models m WHERE m.task_id = t.id AND m.version = t.model_version) \
         FROM assignments a JOIN rounds r ON r.id = a.round_id JOIN tasks t ON t.id = r.task_id \
         WHERE a.id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(r) = row else { return Ok(None) };
    Ok(Some(AssignmentView {
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
    }))
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
        let rows: Vec<CandidateRow> = sqlx::query_as(
            "SELECT r.id, t.id, t.tenant_id, r.round_number, r.deadline_at, r.key_id, t.model_version, \
             r.live_assignments, t.spec_json \
             FROM rounds r JOIN tasks t ON t.id = r.task_id \
             WHERE t.population = $1 AND t.state = 'OPEN' AND r.state = 'COLLECTING'",
        )
            .bind(population)
            .fetch_all(self.pool())
            .await?;
        rows.into_iter()
            .map(|r| {
                let spec = self.spec_of(&r.1, &r.8)?;
                Ok(Candidate {
                    round_id: r.0,
                    task_id: r.1,
                    tenant_id: r.2,
                    round_number: r.3,
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
        let capability = capability.to_string();
        let key_if_unset = key_if_unset.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                let round_id = round_id.as_str();
                let capability = capability.as_str();
                let key_if_unset = key_if_unset.as_str();
                let id = assignment_key(capability);
                // One round trip to SQLite for the whole check-in: the guarded update locks the
                // round, checks and takes the slot and fixes the key; the assignment and its
                // first history row are inserted only if it changed a row (`changes()` is the
                // row count of the statement before). Same effect as `insert_row` after the update.
                let taken: Vec<Option<String>> = sqlx::query_scalar(
                    "UPDATE rounds SET key_id = COALESCE(key_id, $2), \
                     live_assignments = live_assignments + 1 \
                     WHERE id = $1 AND state = 'COLLECTING' AND live_assignments < $3 \
                     RETURNING key_id; \
                     INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
                     SELECT $4, $1, 'ASSIGNED', $5, $6, $6 WHERE changes() = 1; \
                     INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                     SELECT $7, 'assignment', $4, 1, NULL, 'ASSIGNED', 'device checked in', $6 \
                     WHERE changes() = 1",
                )
                .bind(round_id)
                .bind(key_if_unset)
                .bind(i64::try_from(capacity).unwrap_or(i64::MAX))
                .bind(&id)
                .bind(expires_at)
                .bind(now)
                .bind(super::new_id())
                .fetch_all(&mut *tx)
                .await?;
                let Some(Some(key_id)) = taken.into_iter().next() else {
                    return Ok(None);
                };
                Ok(Some(Assigned { key_id, expires_at }))
            })
        })
        .await
    }

    /// The assignment a capability names, with its round and task.
    pub async fn assignment(&self, capability: &str) -> Result<Option<AssignmentView>, DbError> {
        let mut conn = self.pool().acquire().await?;
        view(&mut conn, &assignment_key(capability)).await
    }

    /// Records a stored contribution (ASSIGNED -> UPLOADED). The same bytes again are accepted
    /// (`Stored::Again`); different bytes for a used assignment are refused. With `inline_bytes`,
    /// the contribution itself is written to the database's blob table in the same job.
    pub async fn record_upload(
        &self,
        capability: &str,
        sha256_hex: &str,
        size: i64,
        blob_key: &str,
        inline_bytes: Option<Vec<u8>>,
        now: i64,
    ) -> Result<Result<Stored, Refusal>, DbError> {
        let capability = capability.to_string();
        let sha256_hex = sha256_hex.to_string();
        let blob_key = blob_key.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                let capability = capability.as_str();
                let sha256_hex = sha256_hex.as_str();
                let blob_key = blob_key.as_str();
                let id = assignment_key(capability);
                // Common path in one statement: the guards are the upload's checks, and the update
                // is the ASSIGNED -> UPLOADED transition (compare-and-set on the state; this
                // transition moves no round counter). Only a refusal reads the row to say why.
                debug_assert!(AssignmentState::Assigned.can_become(AssignmentState::Uploaded));
                // One round trip: the guarded transition, then its history row and (for a store
                // inside the task database) the bytes, each only if the statement before changed a
                // row (`changes()`), so the three apply together or not at all.
                const UPLOAD: &str = "UPDATE assignments SET state = 'UPLOADED', updated_at = $1, \
                     contribution_sha256 = $2, contribution_bytes = $3, blob_key = $4 \
                     WHERE id = $5 AND state = 'ASSIGNED' AND contribution_sha256 IS NULL \
                     AND expires_at > $1 AND EXISTS (SELECT 1 FROM rounds r \
                     WHERE r.id = assignments.round_id AND r.state = 'COLLECTING'); \
                     INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
                     SELECT $6, 'assignment', $5, next, 'ASSIGNED', 'UPLOADED', 'contribution stored', $1 \
                     FROM (SELECT COALESCE(MAX(seq), 0) + 1 AS next FROM state_history WHERE entity_id = $5) \
                     WHERE changes() = 1";
                const WITH_BYTES: &str = "; INSERT INTO blobs (key, sha256, bytes) \
                     SELECT $4, $2, $7 WHERE changes() = 1 ON CONFLICT (key) DO NOTHING";
                let inline = inline_bytes.is_some();
                let sql = if inline { format!("{UPLOAD}{WITH_BYTES}") } else { UPLOAD.to_string() };
                let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(now)
                    .bind(sha256_hex)
                    .bind(size)
                    .bind(blob_key)
                    .bind(&id)
                    .bind(super::new_id());
                if let Some(bytes) = inline_bytes {
                    query = query.bind(bytes);
                }
                let changed = query.execute(&mut *tx).await?.rows_affected();
                if changed == 0 {
                    let Some(a) = write_view(&mut *tx, &id).await? else {
                        return Ok(Err(Refusal::UnknownAssignment));
                    };
                    if let Some(stored) = &a.contribution_sha256 {
                        return Ok(if stored == sha256_hex {
                            Ok(Stored::Again)
                        } else {
                            Err(Refusal::DifferentBytes)
                        });
                    }
                    return Ok(Err(closed(&a, now).unwrap_or(Refusal::Finished(a.state))));
                }
                let expected = if inline { 3 } else { 2 };
                if changed != expected {
                    return Err(DbError::Corrupt(format!(
                        "upload of {id} changed {changed} rows, expected {expected}"
                    )));
                }
                Ok(Ok(Stored::New))
            })
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
        let capability = capability.to_string();
        let device_error = device_error.map(str::to_string);
        self.write(move |tx| {
            Box::pin(async move {
                let capability = capability.as_str();
                let device_error = device_error.as_deref();
                let id = assignment_key(capability);
                if outcome == ReportOutcome::Completed
                    && let Some(state) = complete_in_one_step(&mut *tx, &id, now).await?
                {
                    return Ok(Ok(state));
                }
                let Some(a) = write_view(&mut *tx, &id).await? else {
                    return Ok(Err(Refusal::UnknownAssignment));
                };
                let target = outcome.target();
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
                    // `complete_in_one_step` applies every completion its guards allow; reaching
                    // here means the row changed under the single writer, which cannot happen.
                    return Err(DbError::Corrupt(format!(
                        "completion of {} neither applied nor refused",
                        a.id
                    )));
                }
                if let Some(error) = device_error {
                    sqlx::query("UPDATE assignments SET device_error = $1 WHERE id = $2")
                        .bind(error.chars().take(1000).collect::<String>())
                        .bind(&a.id)
                        .execute(&mut *tx)
                        .await?;
                }
                let reason = match outcome {
                    ReportOutcome::Failed => "device reported failure",
                    _ => "device found itself not eligible",
                };
                transition(&mut *tx, &a.id, a.state, target, reason, now).await?;
                Ok(Ok(target))
            })
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

/// The common completed report in three statements: the guarded UPLOADED -> COMPLETED
/// transition (compare-and-set, plus the report's checks), the round's counter (which says whether
/// the goal is reached), and the history row. `None` when the guards do not hold: the caller then
/// reads the row and answers why (or that it was already completed).
async fn complete_in_one_step(
    conn: &mut Conn,
    id: &str,
    now: i64,
) -> Result<Option<AssignmentState>, DbError> {
    use AssignmentState::{Completed, Uploaded};
    debug_assert!(Uploaded.can_become(Completed));
    debug_assert_eq!(Uploaded.round_counter_deltas(Completed), (0, 1));
    // One round trip: the guarded transition, its history row, and the round's counter (which
    // answers whether the goal is reached); each later statement applies only if the one before
    // changed a row (`changes()`).
    let counted: Vec<(String, i64, i64)> = sqlx::query_as(
        "UPDATE assignments SET state = 'COMPLETED', updated_at = $1 \
         WHERE id = $2 AND state = 'UPLOADED' AND expires_at > $1 AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = assignments.round_id AND r.state = 'COLLECTING'); \
         INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $3, 'assignment', $2, next, 'UPLOADED', 'COMPLETED', 'device reported completion', $1 \
         FROM (SELECT COALESCE(MAX(seq), 0) + 1 AS next FROM state_history WHERE entity_id = $2) \
         WHERE changes() = 1; \
         UPDATE rounds SET completed_reports = completed_reports + 1 \
         WHERE id = (SELECT round_id FROM assignments WHERE id = $2) AND changes() = 1 \
         RETURNING id, report_goal, completed_reports",
    )
    .bind(now)
    .bind(id)
    .bind(super::new_id())
    .fetch_all(&mut *conn)
    .await?;
    let Some((round_id, goal, completed)) = counted.into_iter().next() else {
        return Ok(None);
    };
    if completed >= goal {
        let reason = format!("report goal {goal} reached");
        rounds::close(
            conn,
            &round_id,
            RoundState::Collecting,
            RoundState::Aggregating,
            &reason,
            now,
        )
        .await?;
    }
    Ok(Some(Completed))
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
