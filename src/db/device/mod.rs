//! The device store: assigning devices to rounds without over-filling them, recording uploads
//! idempotently, reports, the round goal, and assignment expiry.
//!
//! Each hot path has one home per engine behind the `DeviceStore` trait: `sqlite/device.rs`
//! (rusqlite statements on the single writer, each request whole in its savepoint) and
//! `postgres/device.rs` (single-statement CTEs and row locks for many replicas). What the two
//! share lives here: the types, the decisions a request takes when its guarded statement changed
//! nothing (`upload_outcome`, `report_step`), and the rarely run operations in SQL both engines
//! accept. `tests/store/device_store.rs` runs one conformance suite over both.

use std::future::Future;
use std::sync::LazyLock;

mod rows;

pub(in crate::db) use rows::{CandidateRow, ViewRow, WriteViewRow};

use super::postgres::device::PostgresDevices;
use super::sqlite::device::SqliteDevices;
use super::{Conn, Db, DbError, Engine, history, parse_state, transition};
use crate::clock::Millis;
use crate::states::{AssignmentState, RoundState, StateMachine, TaskState};
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
    /// When the task was created (first come, first served).
    pub task_created_at: i64,
    /// Most live assignments the round takes (fixed when it opened: adaptive over-selection).
    pub capacity: u64,
    /// The partner asked to evaluate this round on demand (devices are told so).
    pub on_demand_evaluation: bool,
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
    pub id: AssignmentRef,
    pub state: AssignmentState,
    pub expires_at: i64,
    pub round_state: RoundState,
    pub round_number: i64,
    pub attempt: i64,
    pub key_id: Option<String>,
    pub task_id: String,
    pub tenant_id: String,
    pub contribution_digest: Option<String>,
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

pub use confed_protocol::ids::{AssignmentRef, Capability};

/// An assignment's view without its condition: `VIEW_SQL` reads one by `a.id`, PostgreSQL's
/// grouped read (`postgres/grouped.rs`) several.
pub(in crate::db) const VIEW_COLUMNS_FROM: &str = "a.id AS id, a.state AS state, \
     a.expires_at AS expires_at, r.state AS round_state, r.round_number AS round_number, \
     r.attempt AS attempt, r.key_id AS key_id, t.id AS task_id, t.tenant_id AS tenant_id, \
     a.contribution_digest AS contribution_digest, \
     (SELECT m.size_bytes FROM models m WHERE m.task_id = t.id AND m.version = t.model_version) \
     AS model_bytes, t.model_version AS model_version \
     FROM assignments a JOIN rounds r ON r.id = a.round_id JOIN tasks t ON t.id = r.task_id";

/// One assignment's view (`$1`: its id).
pub(in crate::db) static VIEW_SQL: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {VIEW_COLUMNS_FROM} WHERE a.id = $1"));

/// The candidate rounds' columns and conditions but the population's: `CANDIDATES` reads one
/// population, PostgreSQL's grouped read (`postgres/grouped.rs`) several.
pub(in crate::db) static CANDIDATES_COLUMNS_WHERE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "r.id AS round_id, t.id AS task_id, t.tenant_id AS tenant_id, \
         r.round_number AS round_number, r.deadline_at AS deadline_at, r.key_id AS key_id, \
         t.model_version AS model_version, r.live_assignments AS live_assignments, \
         t.spec_json AS spec_json, r.attempt AS attempt, t.created_at AS task_created_at, \
         r.capacity AS capacity, r.on_demand_evaluation AS on_demand_evaluation \
         FROM rounds r JOIN tasks t ON t.id = r.task_id \
         JOIN populations p ON p.name = t.population AND p.tenant_id = t.tenant_id \
         WHERE t.state = '{open}' AND r.state = '{collecting}'",
        open = TaskState::Open.as_str(),
        collecting = RoundState::Collecting.as_str(),
    )
});

/// Collecting rounds of open tasks in a population whose owner runs them (`$1`: the population;
/// SQLite binds `$1` by position too).
pub(in crate::db) static CANDIDATES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} AND t.population = $1",
        CANDIDATES_COLUMNS_WHERE.as_str()
    )
});

pub(in crate::db) fn view_from_row(r: ViewRow) -> Result<AssignmentView, DbError> {
    Ok(AssignmentView {
        id: AssignmentRef::from_stored(r.id),
        state: parse_state(&r.state)?,
        expires_at: r.expires_at,
        round_state: parse_state(&r.round_state)?,
        round_number: r.round_number,
        attempt: r.attempt,
        key_id: r.key_id,
        task_id: r.task_id,
        tenant_id: r.tenant_id,
        contribution_digest: r.contribution_digest,
        model_bytes: r.model_bytes.unwrap_or(0),
        model_version: r.model_version,
    })
}

/// What a store reads of an assignment to say why a guarded upload or report changed nothing (a
/// light read: on SQLite the writer is serial, so it reads no more than it must).
pub(in crate::db) struct WriteView {
    pub id: String,
    pub state: AssignmentState,
    pub expires_at: i64,
    pub round_state: RoundState,
    pub contribution_digest: Option<String>,
}

/// The columns of a `WriteView`, in SQL both engines accept (`$1` is the assignment id).
pub(in crate::db) const WRITE_VIEW_SQL: &str = "SELECT a.id AS id, a.state AS state, \
     a.expires_at AS expires_at, r.state AS round_state, \
     a.contribution_digest AS contribution_digest \
     FROM assignments a JOIN rounds r ON r.id = a.round_id WHERE a.id = $1";

impl WriteView {
    pub(in crate::db) fn from_row(r: WriteViewRow) -> Result<Self, DbError> {
        Ok(Self {
            id: r.id,
            state: super::parse_state(&r.state)?,
            expires_at: r.expires_at,
            round_state: super::parse_state(&r.round_state)?,
            contribution_digest: r.contribution_digest,
        })
    }
}

/// A slot to take in a collecting round (`DeviceStore::assign`).
#[derive(Debug, Clone)]
pub(in crate::db) struct NewAssignment {
    pub round_id: String,
    /// The assignment's database id (`Capability::reference`).
    pub id: String,
    pub capacity: i64,
    pub key_if_unset: String,
    pub expires_at: i64,
    pub now: i64,
}

/// The digests of an upload: the one that makes a repeated upload idempotent (`blake3:<hex>`
/// through the server, `md5:<hex>` for a direct upload), and the BLAKE3 the enclave checks
/// (`None` for a direct upload, whose bytes the server never saw).
#[derive(Debug, Clone, Copy)]
pub struct UploadDigests<'a> {
    pub idempotency: &'a str,
    pub blake3_hex: Option<&'a str>,
}

/// A stored contribution to record (`DeviceStore::record_upload`).
#[derive(Debug, Clone)]
pub(in crate::db) struct NewUpload {
    pub id: String,
    pub sha256_hex: String,
    /// BLAKE3 of the bytes (lowercase hex), for uploads through the server; listed in the job.
    pub blake3_hex: Option<String>,
    pub size: i64,
    pub blob_key: String,
    pub now: i64,
}

/// A device's report to apply (`DeviceStore::record_report`).
#[derive(Debug, Clone)]
pub(in crate::db) struct Report {
    pub id: String,
    pub outcome: ReportOutcome,
    pub device_error: Option<String>,
    pub now: i64,
}

/// The device hot paths, one implementation per engine. Every method is one atomic write (or
/// one read) and returns once it is durable.
pub(in crate::db) trait DeviceStore {
    /// Collecting rounds of open tasks in a population whose owner runs them.
    fn candidates(
        &self,
        population: &str,
    ) -> impl Future<Output = Result<Vec<CandidateRow>, DbError>> + Send;

    /// Takes a slot of a collecting round (the round row locked or the writer serial, so no
    /// round is over-filled), fixes the round's key if unset, inserts the assignment and its
    /// history; `None` if the round is full or no longer collecting.
    fn assign(
        &self,
        new: NewAssignment,
    ) -> impl Future<Output = Result<Option<Assigned>, DbError>> + Send;

    /// The assignment with this id, with its round and task.
    fn assignment(
        &self,
        id: String,
    ) -> impl Future<Output = Result<Option<AssignmentView>, DbError>> + Send;

    /// ASSIGNED -> UPLOADED with the digest, or why not (`upload_outcome`).
    fn record_upload(
        &self,
        upload: NewUpload,
    ) -> impl Future<Output = Result<Result<Stored, Refusal>, DbError>> + Send;

    /// Applies a report (`report_step` when its guarded path does not apply); the completion
    /// that reaches the goal closes the round and creates its aggregation job in the same
    /// transaction.
    fn record_report(
        &self,
        report: Report,
    ) -> impl Future<Output = Result<Result<AssignmentState, Refusal>, DbError>> + Send;
}

/// Why an upload's guarded update changed nothing: the same bytes again, or a refusal.
pub(in crate::db) fn upload_outcome(
    view: Option<WriteView>,
    sha256_hex: &str,
    now: Millis,
) -> Result<Stored, Refusal> {
    let now = now.0;
    let Some(a) = view else {
        return Err(Refusal::UnknownAssignment);
    };
    if let Some(stored) = &a.contribution_digest {
        return if stored == sha256_hex {
            Ok(Stored::Again)
        } else {
            Err(Refusal::DifferentBytes)
        };
    }
    Err(closed(&a, Millis(now)).unwrap_or(Refusal::Finished(a.state)))
}

/// What a report off the guarded path does.
pub(in crate::db) enum ReportStep {
    /// Answer at once: a repeated report, or a refusal.
    Answer(Result<AssignmentState, Refusal>),
    /// Apply this transition (a failure or not-eligible report).
    Apply {
        from: AssignmentState,
        to: AssignmentState,
        reason: &'static str,
    },
}

/// Decides a report the guarded completion did not apply: a failure or not-eligible report, a
/// repeated report, or a refusal.
pub(in crate::db) fn report_step(
    view: Option<&WriteView>,
    outcome: ReportOutcome,
    now: Millis,
) -> Result<ReportStep, DbError> {
    let now = now.0;
    let Some(a) = view else {
        return Ok(ReportStep::Answer(Err(Refusal::UnknownAssignment)));
    };
    let target = report_target(outcome);
    if a.state == target {
        return Ok(ReportStep::Answer(Ok(target)));
    }
    // Timed out is expired, as the upload and model routes say (410), not finished otherwise.
    if a.state == AssignmentState::TimedOut {
        return Ok(ReportStep::Answer(Err(Refusal::Expired)));
    }
    if a.state.is_terminal() {
        return Ok(ReportStep::Answer(Err(Refusal::Finished(a.state))));
    }
    if outcome == ReportOutcome::Completed && a.state != AssignmentState::Uploaded {
        return Ok(ReportStep::Answer(Err(Refusal::NotUploaded)));
    }
    if let Some(refusal) = closed(a, Millis(now)) {
        return Ok(ReportStep::Answer(Err(refusal)));
    }
    if outcome == ReportOutcome::Completed {
        // The guarded path applies every completion its guards allow, and the row is locked (or
        // the writer serial) meanwhile: reaching here is a bug.
        return Err(DbError::Corrupt(format!(
            "completion of {} neither applied nor refused",
            a.id
        )));
    }
    Ok(ReportStep::Apply {
        from: a.state,
        to: target,
        reason: match outcome {
            ReportOutcome::Failed => "device reported failure",
            _ => "device found itself not eligible",
        },
    })
}

/// Longest device error text kept.
pub(in crate::db) const DEVICE_ERROR_CHARS: usize = 1000;

/// A device's error text as stored: at most `DEVICE_ERROR_CHARS` characters, control characters
/// (NUL among them, which PostgreSQL refuses in text) replaced by U+FFFD, line breaks and tabs
/// kept. The text is the device's to choose; a byte it sends must not fail the write.
pub(in crate::db) fn device_error_text(error: &str) -> String {
    error
        .chars()
        .take(DEVICE_ERROR_CHARS)
        .map(|c| {
            if c.is_control() && !matches!(c, '\n' | '\t') {
                char::REPLACEMENT_CHARACTER
            } else {
                c
            }
        })
        .collect()
}

/// Runs `$call` on this database's engine's device store.
macro_rules! on_store {
    ($db:expr, $store:ident => $call:expr) => {
        match $db.engine() {
            Engine::Sqlite => {
                let $store = SqliteDevices($db);
                $call.await
            }
            Engine::Postgres => {
                let $store = PostgresDevices($db);
                $call.await
            }
        }
    };
}

impl Db {
    /// Collecting rounds of open tasks in a population, with how many live assignments each has.
    pub async fn checkin_candidates(&self, population: &str) -> Result<Vec<Candidate>, DbError> {
        let rows = on_store!(self, store => store.candidates(population))?;
        rows.into_iter()
            .map(|r| {
                let spec = self.spec_of(&r.task_id, &r.spec_json)?;
                Ok(Candidate {
                    round_id: r.round_id,
                    task_id: r.task_id,
                    tenant_id: r.tenant_id,
                    round_number: r.round_number,
                    attempt: r.attempt,
                    deadline_at: r.deadline_at,
                    key_id: r.key_id,
                    model_version: r.model_version.unwrap_or(0),
                    live: r.live_assignments,
                    task_created_at: r.task_created_at,
                    capacity: r
                        .capacity
                        .and_then(|c| u64::try_from(c).ok())
                        .unwrap_or_else(|| spec.max_live_assignments()),
                    on_demand_evaluation: r.on_demand_evaluation != 0,
                    spec,
                })
            })
            .collect()
    }

    /// Takes a slot of a collecting round, or `None` if the round is full or no longer collecting.
    /// Concurrent check-ins can never exceed `capacity`. The round's key is fixed by its first
    /// assignment (`key_if_unset`).
    pub async fn assign(
        &self,
        round_id: &str,
        capacity: u64,
        capability: &Capability,
        expires_at: i64,
        key_if_unset: &str,
    ) -> Result<Option<Assigned>, DbError> {
        let now = self.now().0;
        let new = NewAssignment {
            round_id: round_id.to_string(),
            id: capability.reference().into_string(),
            capacity: i64::try_from(capacity).unwrap_or(i64::MAX),
            key_if_unset: key_if_unset.to_string(),
            expires_at,
            now,
        };
        on_store!(self, store => store.assign(new))
    }

    /// The assignment a capability names, with its round and task.
    pub async fn assignment(
        &self,
        capability: &Capability,
    ) -> Result<Option<AssignmentView>, DbError> {
        let id = capability.reference().into_string();
        on_store!(self, store => store.assignment(id))
    }

    /// Records a stored contribution (ASSIGNED -> UPLOADED). The same bytes again are accepted
    /// (`Stored::Again`); different bytes for a used assignment are refused. `blob_key` names
    /// bytes the contribution store has already made durable; `blake3_hex` their BLAKE3 when
    /// the server computed it (an upload through the server), which the round's job lists.
    pub async fn record_upload(
        &self,
        capability: &Capability,
        digests: UploadDigests<'_>,
        size: i64,
        blob_key: &str,
    ) -> Result<Result<Stored, Refusal>, DbError> {
        let now = self.now().0;
        let upload = NewUpload {
            id: capability.reference().into_string(),
            sha256_hex: digests.idempotency.to_string(),
            blake3_hex: digests.blake3_hex.map(str::to_string),
            size,
            blob_key: blob_key.to_string(),
            now,
        };
        on_store!(self, store => store.record_upload(upload))
    }

    /// Applies a device's report. A completed report that reaches the round's goal moves the round
    /// to AGGREGATING in the same transaction. Repeating the same report is accepted.
    pub async fn record_report(
        &self,
        capability: &Capability,
        outcome: ReportOutcome,
        device_error: Option<&str>,
    ) -> Result<Result<AssignmentState, Refusal>, DbError> {
        let now = self.now().0;
        let report = Report {
            id: capability.reference().into_string(),
            outcome,
            device_error: device_error.map(str::to_string),
            now,
        };
        on_store!(self, store => store.record_report(report))
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
             WHERE r.task_id = $1 AND r.round_number = $2 AND a.state = $3 \
             AND a.blob_key IS NOT NULL ORDER BY a.id",
        )
        .bind(task_id)
        .bind(round_number)
        .bind(AssignmentState::Completed.as_str())
        .fetch_all(self.pool())
        .await?)
    }

    /// Times out assignments past their expiry (ASSIGNED or UPLOADED but not reported), freeing
    /// their slots. Returns how many.
    pub async fn expire_assignments(&self, limit: u32) -> Result<usize, DbError> {
        let now = self.now().0;
        self.write(move |tx| {
            Box::pin(async move {
                // Both engines use the (state, expires_at) index for bound states as well.
                let due: Vec<(String, String)> = sqlx::query_as(
                    "SELECT id, state FROM assignments WHERE state IN ($3, $4) \
                     AND expires_at <= $1 ORDER BY expires_at LIMIT $2",
                )
                .bind(now)
                .bind(i64::from(limit))
                .bind(AssignmentState::Assigned.as_str())
                .bind(AssignmentState::Uploaded.as_str())
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
                        Millis(now),
                    )
                    .await?;
                }
                Ok(due.len())
            })
        })
        .await
    }
}

/// Inserts an ASSIGNED assignment and its first history row. The round's `live_assignments`
/// counter is the caller's to move (check-in takes the slot in its guarded update).
pub(crate) async fn insert_row(
    conn: &mut Conn,
    id: &str,
    round_id: &str,
    expires_at: i64,
    reason: &str,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
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
        Millis(now),
    )
    .await
}

/// Whether the assignment can no longer take uploads or reports.
fn closed(a: &WriteView, now: Millis) -> Option<Refusal> {
    let now = now.0;
    closed_at(a.round_state, a.expires_at, a.state, Millis(now))
}

/// The one rule of when an assignment is closed, from its round's state, its expiry and its
/// own state: the round closed, then expired, then finished.
pub(crate) fn closed_at(
    round_state: RoundState,
    expires_at: i64,
    state: AssignmentState,
    now: Millis,
) -> Option<Refusal> {
    let now = now.0;
    if round_state != RoundState::Collecting {
        Some(Refusal::RoundClosed)
    } else if now >= expires_at || state == AssignmentState::TimedOut {
        Some(Refusal::Expired)
    } else if state.is_terminal() {
        Some(Refusal::Finished(state))
    } else {
        None
    }
}
