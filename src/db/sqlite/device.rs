//! The device store on SQLite: every request is one job on the single writer's rusqlite handle
//! (`writer.rs`), whole in its savepoint, so each guarded statement is atomic and nothing else
//! writes meanwhile; reads run on raw read-only connections. No thread hop per statement: this is
//! the path every device cycle takes three times. State names come from `states.rs`.

use std::sync::LazyLock;

use rusqlite::OptionalExtension;

use crate::db::device::{
    Assigned, AssignmentView, CANDIDATES, CandidateRow, DeviceStore, NewAssignment, NewUpload,
    Refusal, Report, ReportOutcome, ReportStep, Stored, VIEW_SQL, ViewRow, WRITE_VIEW_SQL,
    WriteView, WriteViewRow, device_error_text, report_step, upload_outcome, view_from_row,
};
use crate::db::{Db, DbError, history, new_history_id};
use crate::states::{AssignmentState, RoundState, StateMachine};

use crate::clock::Millis;
use AssignmentState::{Assigned as ASSIGNED, Completed as COMPLETED, Uploaded as UPLOADED};
use RoundState::{Aggregating as AGGREGATING, Collecting as COLLECTING};

/// The device store of a SQLite `Db`.
pub(in crate::db) struct SqliteDevices<'a>(pub &'a Db);

static TAKE_SLOT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE rounds SET key_id = COALESCE(key_id, ?2), \
         live_assignments = live_assignments + 1 \
         WHERE id = ?1 AND state = '{collecting}' AND live_assignments < ?3 RETURNING key_id",
        collecting = COLLECTING.as_str(),
    )
});

static INSERT_ASSIGNMENT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
         VALUES (?1, ?2, '{assigned}', ?3, ?4, ?4)",
        assigned = ASSIGNED.as_str(),
    )
});

/// The first history row of a new assignment (`seq` 1: nothing to read).
const FIRST_HISTORY: &str = "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
     VALUES (?1, ?2, ?3, 1, NULL, ?4, ?5, ?6)";

static UPLOAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE assignments SET state = '{uploaded}', updated_at = ?1, \
         contribution_digest = ?2, contribution_bytes = ?3, blob_key = ?4, \
         contribution_blake3 = ?6 \
         WHERE id = ?5 AND state = '{assigned}' AND contribution_digest IS NULL \
         AND expires_at > ?1 AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = assignments.round_id AND r.state = '{collecting}')",
        uploaded = UPLOADED.as_str(),
        assigned = ASSIGNED.as_str(),
        collecting = COLLECTING.as_str(),
    )
});

static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE assignments SET state = '{completed}', updated_at = ?1 \
         WHERE id = ?2 AND state = '{uploaded}' AND expires_at > ?1 \
         AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = assignments.round_id AND r.state = '{collecting}')",
        completed = COMPLETED.as_str(),
        uploaded = UPLOADED.as_str(),
        collecting = COLLECTING.as_str(),
    )
});

const COUNT_COMPLETION: &str = "UPDATE rounds SET completed_reports = completed_reports + 1 \
     WHERE id = (SELECT round_id FROM assignments WHERE id = ?1) \
     RETURNING id, report_goal, completed_reports";

static CLOSE_ROUND: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE rounds SET state = '{aggregating}', updated_at = ?2 \
         WHERE id = ?1 AND state = '{collecting}'",
        aggregating = AGGREGATING.as_str(),
        collecting = COLLECTING.as_str(),
    )
});

static CREATE_JOB: LazyLock<String> = LazyLock::new(|| crate::db::jobs::create_job_sql("?1", "?2"));

/// Appends a history row for one transition.
fn append_history(
    c: &rusqlite::Connection,
    entity: &str,
    entity_id: &str,
    from: Option<&str>,
    to: &str,
    reason: &str,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    c.prepare_cached(history::APPEND_SQL)?
        .execute(rusqlite::params![
            new_history_id(),
            entity,
            entity_id,
            from,
            to,
            reason,
            now
        ])?;
    Ok(())
}

fn write_view(c: &rusqlite::Connection, id: &str) -> Result<Option<WriteView>, DbError> {
    // SQLite reads `$1` as a parameter too (bound by position here).
    let row = c
        .prepare_cached(WRITE_VIEW_SQL)?
        .query_row([id], WriteViewRow::from_sqlite)
        .optional()?;
    row.map(WriteView::from_row).transpose()
}

/// An assignment transition off the hot path (a failure or not-eligible report): compare-and-set
/// on the state, the round's counters, and the history row.
fn apply_transition(
    c: &rusqlite::Connection,
    id: &str,
    from: AssignmentState,
    to: AssignmentState,
    reason: &str,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    if !from.can_become(to) {
        return Err(DbError::IllegalTransition {
            entity: AssignmentState::ENTITY,
            from: from.as_str(),
            to: to.as_str(),
        });
    }
    let changed = c
        .prepare_cached(
            "UPDATE assignments SET state = ?1, updated_at = ?2 WHERE id = ?3 AND state = ?4",
        )?
        .execute(rusqlite::params![to.as_str(), now, id, from.as_str()])?;
    if changed != 1 {
        // What `db::transition` answers: gone, or moved by someone else first.
        let found: Option<String> = c
            .prepare_cached("SELECT state FROM assignments WHERE id = ?1")?
            .query_row([id], |r| r.get(0))
            .optional()?;
        return Err(match found {
            None => DbError::NotFound {
                entity: AssignmentState::ENTITY,
                id: id.to_string(),
            },
            Some(found) => DbError::StateConflict {
                entity: AssignmentState::ENTITY,
                id: id.to_string(),
                expected: from.as_str(),
                found,
            },
        });
    }
    let (live, completed) = from.round_counter_deltas(to);
    if live != 0 || completed != 0 {
        c.prepare_cached(
            "UPDATE rounds SET live_assignments = live_assignments + ?1, \
             completed_reports = completed_reports + ?2 \
             WHERE id = (SELECT round_id FROM assignments WHERE id = ?3)",
        )?
        .execute(rusqlite::params![live, completed, id])?;
    }
    append_history(
        c,
        AssignmentState::ENTITY,
        id,
        Some(from.as_str()),
        to.as_str(),
        reason,
        Millis(now),
    )
}

/// A report the guarded completion did not apply, decided by `report_step`.
fn report_off_path(
    c: &rusqlite::Connection,
    report: &Report,
) -> Result<Result<AssignmentState, Refusal>, DbError> {
    let view = write_view(c, &report.id)?;
    match report_step(view.as_ref(), report.outcome, Millis(report.now))? {
        ReportStep::Answer(answer) => Ok(answer),
        ReportStep::Apply { from, to, reason } => {
            if let Some(error) = &report.device_error {
                c.prepare_cached("UPDATE assignments SET device_error = ?1 WHERE id = ?2")?
                    .execute(rusqlite::params![device_error_text(error), report.id])?;
            }
            apply_transition(c, &report.id, from, to, reason, Millis(report.now))?;
            Ok(Ok(to))
        }
    }
}

/// The guarded UPLOADED -> COMPLETED transition, its history row and the round's counter; the
/// completion that reaches the goal closes the round and creates its job. `None` if the guards
/// did not hold.
fn complete(
    c: &rusqlite::Connection,
    id: &str,
    now: Millis,
    on_close: &dyn Fn(),
) -> Result<Option<AssignmentState>, DbError> {
    let now = now.0;
    debug_assert!(UPLOADED.can_become(COMPLETED));
    debug_assert_eq!(UPLOADED.round_counter_deltas(COMPLETED), (0, 1));
    if c.prepare_cached(&COMPLETE)?
        .execute(rusqlite::params![now, id])?
        == 0
    {
        return Ok(None);
    }
    append_history(
        c,
        AssignmentState::ENTITY,
        id,
        Some(UPLOADED.as_str()),
        COMPLETED.as_str(),
        "device reported completion",
        Millis(now),
    )?;
    let (round_id, goal, completed): (String, i64, i64) = c
        .prepare_cached(COUNT_COMPLETION)?
        .query_row([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
    if completed < goal {
        return Ok(Some(COMPLETED));
    }
    // The goal is reached (once per round): close the round for aggregation and record its job
    // (what `rounds::close` and `jobs::create` do), in the same savepoint.
    debug_assert!(COLLECTING.can_become(AGGREGATING));
    if c.prepare_cached(&CLOSE_ROUND)?
        .execute(rusqlite::params![round_id, now])?
        != 1
    {
        return Err(DbError::Corrupt(format!(
            "round {round_id} reached its goal but is not collecting"
        )));
    }
    append_history(
        c,
        RoundState::ENTITY,
        &round_id,
        Some(COLLECTING.as_str()),
        AGGREGATING.as_str(),
        &format!("report goal {goal} reached"),
        Millis(now),
    )?;
    c.prepare_cached(&CREATE_JOB)?
        .execute(rusqlite::params![round_id, now])?;
    on_close();
    Ok(Some(COMPLETED))
}

impl DeviceStore for SqliteDevices<'_> {
    async fn candidates(&self, population: &str) -> Result<Vec<CandidateRow>, DbError> {
        // On a raw read connection: every check-in runs this, and a round trip to a sqlx worker
        // thread costs more than the read.
        self.0.read_raw(|c| {
            let mut statement = c.prepare_cached(&CANDIDATES)?;
            let rows = statement.query_map([population], CandidateRow::from_sqlite)?;
            Ok(rows.collect::<Result<Vec<_>, _>>()?)
        })
    }

    async fn assign(&self, new: NewAssignment) -> Result<Option<Assigned>, DbError> {
        self.0
            .write_raw(move |c| {
                // The guarded update checks and takes the slot and fixes the key; the assignment
                // and its first history row follow only if it took one.
                let key_id: Option<Option<String>> = c
                    .prepare_cached(&TAKE_SLOT)?
                    .query_row(
                        rusqlite::params![new.round_id, new.key_if_unset, new.capacity],
                        |r| r.get(0),
                    )
                    .optional()?;
                let Some(Some(key_id)) = key_id else {
                    return Ok(None);
                };
                c.prepare_cached(&INSERT_ASSIGNMENT)?
                    .execute(rusqlite::params![
                        new.id,
                        new.round_id,
                        new.expires_at,
                        new.now
                    ])?;
                c.prepare_cached(FIRST_HISTORY)?.execute(rusqlite::params![
                    new_history_id(),
                    AssignmentState::ENTITY,
                    new.id,
                    ASSIGNED.as_str(),
                    "device checked in",
                    new.now
                ])?;
                Ok(Some(Assigned {
                    key_id,
                    expires_at: new.expires_at,
                }))
            })
            .await
    }

    async fn assignment(&self, id: String) -> Result<Option<AssignmentView>, DbError> {
        // On a raw read connection: every upload and every model download reads it, and a hop
        // to a sqlx worker thread costs more than the read.
        let row: Option<ViewRow> = self.0.read_raw(|c| {
            Ok(c.prepare_cached(&VIEW_SQL)?
                .query_row([&id], ViewRow::from_sqlite)
                .optional()?)
        })?;
        row.map(view_from_row).transpose()
    }

    async fn record_upload(&self, upload: NewUpload) -> Result<Result<Stored, Refusal>, DbError> {
        self.0
            .write_raw(move |c| {
                // The guards are the upload's checks; the update is the ASSIGNED -> UPLOADED
                // transition (compare-and-set on the state; it moves no round counter).
                debug_assert!(ASSIGNED.can_become(UPLOADED));
                let changed = c.prepare_cached(&UPLOAD)?.execute(rusqlite::params![
                    upload.now,
                    upload.sha256_hex,
                    upload.size,
                    upload.blob_key,
                    upload.id,
                    upload.blake3_hex
                ])?;
                if changed == 0 {
                    // Only a refusal (or a repeated upload) reads the row to say why.
                    let view = write_view(c, &upload.id)?;
                    return Ok(upload_outcome(view, &upload.sha256_hex, Millis(upload.now)));
                }
                append_history(
                    c,
                    AssignmentState::ENTITY,
                    &upload.id,
                    Some(ASSIGNED.as_str()),
                    UPLOADED.as_str(),
                    "contribution stored",
                    Millis(upload.now),
                )?;
                Ok(Ok(Stored::New))
            })
            .await
    }

    async fn record_report(
        &self,
        report: Report,
    ) -> Result<Result<AssignmentState, Refusal>, DbError> {
        // The worker's lease is a later job on the same single writer, so it sees this batch's
        // commit: waking it from inside the job is safe.
        let jobs = self.0.job_signal();
        self.0
            .write_raw(move |c| {
                if report.outcome == ReportOutcome::Completed
                    && let Some(state) =
                        complete(c, &report.id, Millis(report.now), &|| jobs.notify_one())?
                {
                    return Ok(Ok(state));
                }
                report_off_path(c, &report)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast paths spell their transitions in SQL (one statement each, for the device path's
    /// throughput) instead of calling `db::transition`, so the tables are checked here: an edit
    /// of `states.rs` that forbids one of them fails this test, not a device in production.
    /// PostgreSQL's fast paths (`postgres/device.rs`) make the same three.
    #[test]
    fn the_fast_paths_make_only_transitions_the_state_machines_allow() {
        assert!(ASSIGNED.can_become(UPLOADED), "upload");
        assert!(UPLOADED.can_become(COMPLETED), "report");
        assert!(
            COLLECTING.can_become(AGGREGATING),
            "the round's last report"
        );
    }
}
