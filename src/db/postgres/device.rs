//! The device store on PostgreSQL. On SQLite the hot paths run on the single writer's raw handle
//! (`sqlite/device.rs`), where being serial makes every guarded statement atomic. Here many
//! servers run them at once, in READ COMMITTED transactions kept apart by row locks; each
//! process groups its writes into shared transactions (`batch.rs`, one at a time per process):
//! - check-in: the guarded `UPDATE rounds ... live_assignments < capacity` locks the round row;
//!   PostgreSQL re-checks the guard after waiting for the lock, so no round is over-filled;
//! - upload: the guarded `UPDATE assignments` (compare-and-set on the state) locks the
//!   assignment; a repeated upload waits and then sees the stored digest;
//! - completed report: locks the round row first (`FOR UPDATE`), so completions and the goal's
//!   closing are serial per round: exactly one report closes the round, and none completes an
//!   assignment of a round already closed (its contribution would miss the aggregation).
//!
//! Each statement here is also a write's single path: in a batch, the sets of `sets.rs` apply
//! the common case of many writes at once under the same guards, and a write they leave (or one
//! run alone after a fault) takes its statement here.
//!
//! State names come from `states.rs`.

use std::sync::{Arc, LazyLock};

use super::grouped::Grouped;
use super::readers::Readers;
use super::sets::{SetItem, SetOutcome};
use crate::db::device::{
    Assigned, AssignmentView, CANDIDATES_COLUMNS_WHERE, CandidateRow, DeviceStore, NewAssignment,
    NewUpload, Refusal, Report, ReportOutcome, ReportStep, Stored, VIEW_COLUMNS_FROM, ViewRow,
    WRITE_VIEW_SQL, WriteView, WriteViewRow, device_error_text, report_step, upload_outcome,
    view_from_row,
};
use crate::db::{Conn, Db, DbError, history, new_history_id, transition};
use crate::states::{AssignmentState, RoundState, StateMachine};

use crate::clock::Millis;
use AssignmentState::{Assigned as ASSIGNED, Completed as COMPLETED, Uploaded as UPLOADED};
use RoundState::{Aggregating as AGGREGATING, Collecting as COLLECTING};

/// The device store of a PostgreSQL `Db`.
pub(in crate::db) struct PostgresDevices<'a>(pub &'a Db);

/// The device path's reads on one database, each kind grouped into shared statements
/// (`grouped.rs`) on the same connections (`readers.rs`).
pub(in crate::db) struct DeviceReads {
    /// A check-in's candidate rounds, keyed by population.
    pub candidates: Arc<Grouped<CandidateRow>>,
    /// An assignment's view (the model download's and the upload's), keyed by its id.
    pub views: Arc<Grouped<ViewRow>>,
}

impl std::fmt::Debug for DeviceReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceReads").finish_non_exhaustive()
    }
}

impl DeviceReads {
    pub(in crate::db) fn new(url: &str) -> Self {
        // Each kind keeps one statement in flight: two kinds, two connections.
        let readers = Readers::new(url, 2);
        Self {
            candidates: Grouped::new(
                "candidates",
                Arc::clone(&readers),
                &format!(
                    "SELECT {} AND t.population = grouped_keys.key",
                    CANDIDATES_COLUMNS_WHERE.as_str()
                ),
            ),
            views: Grouped::new(
                "views",
                readers,
                &format!("SELECT {VIEW_COLUMNS_FROM} WHERE a.id = grouped_keys.key"),
            ),
        }
    }
}

/// One statement, so one round trip: the round row's lock is taken by the guarded UPDATE, which
/// PostgreSQL re-checks after waiting for it. Every check-in of a round takes that lock, so its
/// hold time (until the group commit that carries it) bounds the round's check-in rate.
static ASSIGN: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH r AS (UPDATE rounds SET key_id = COALESCE(key_id, $2), \
         live_assignments = live_assignments + 1 \
         WHERE id = $1 AND state = '{collecting}' AND live_assignments < $3 RETURNING key_id), \
         a AS (INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at) \
         SELECT $4, $1, '{assigned}', $5, $6, $6 FROM r RETURNING id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $7, '{entity}', a.id, 1, NULL, '{assigned}', 'device checked in', $6 FROM a) \
         SELECT key_id FROM r",
        collecting = COLLECTING.as_str(),
        assigned = ASSIGNED.as_str(),
        entity = AssignmentState::ENTITY,
    )
});

/// The common upload in one statement (one round trip): the guarded ASSIGNED -> UPLOADED
/// transition and its history row.
static UPLOAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH u AS (UPDATE assignments SET state = '{uploaded}', updated_at = $1, \
         contribution_digest = $2, contribution_bytes = $3, blob_key = $4, \
         contribution_blake3 = $7 \
         WHERE id = $5 AND state = '{assigned}' AND contribution_digest IS NULL \
         AND expires_at > $1 AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = assignments.round_id AND r.state = '{collecting}') RETURNING id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $6, '{entity}', u.id, \
         (SELECT COALESCE(MAX(seq), 0) + 1 FROM state_history WHERE entity_id = $5), \
         '{assigned}', '{uploaded}', 'contribution stored', $1 FROM u) \
         SELECT COUNT(*) FROM u",
        uploaded = UPLOADED.as_str(),
        assigned = ASSIGNED.as_str(),
        collecting = COLLECTING.as_str(),
        entity = AssignmentState::ENTITY,
    )
});

/// The completion in one statement: `r` locks the round's row first (`FOR UPDATE`; under READ
/// COMMITTED a waiter then reads the row as its holder committed it), and the guarded
/// transition, its history row and the round's counter apply only while that round is
/// collecting. Answers the round (id, state, goal) and the new count of completed reports, which
/// is NULL when the transition did not apply. A round's completions so serialize on its row, as
/// the closing one must see every other.
static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH r AS (SELECT id, state, report_goal FROM rounds \
         WHERE id = (SELECT round_id FROM assignments WHERE id = $2) FOR UPDATE), \
         u AS (UPDATE assignments SET state = '{completed}', updated_at = $1 \
         WHERE id = $2 AND state = '{uploaded}' AND expires_at > $1 \
         AND EXISTS (SELECT 1 FROM r WHERE r.state = '{collecting}') RETURNING id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT $3, '{entity}', u.id, \
         (SELECT COALESCE(MAX(seq), 0) + 1 FROM state_history WHERE entity_id = $2), \
         '{uploaded}', '{completed}', 'device reported completion', $1 FROM u), \
         c AS (UPDATE rounds SET completed_reports = completed_reports + 1 \
         WHERE id = (SELECT id FROM r) AND EXISTS (SELECT 1 FROM u) RETURNING completed_reports) \
         SELECT r.id, r.state, r.report_goal, (SELECT completed_reports FROM c) FROM r",
        completed = COMPLETED.as_str(),
        uploaded = UPLOADED.as_str(),
        collecting = COLLECTING.as_str(),
        entity = AssignmentState::ENTITY,
    )
});

static CLOSE_ROUND: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE rounds SET state = '{aggregating}', updated_at = $2 \
         WHERE id = $1 AND state = '{collecting}'",
        aggregating = AGGREGATING.as_str(),
        collecting = COLLECTING.as_str(),
    )
});

static CREATE_JOB: LazyLock<String> = LazyLock::new(|| crate::db::jobs::create_job_sql("$1", "$2"));

async fn write_view(conn: &mut Conn, id: &str) -> Result<Option<WriteView>, DbError> {
    let row: Option<WriteViewRow> = sqlx::query_as(WRITE_VIEW_SQL)
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
    row.map(WriteView::from_row).transpose()
}

/// A report the guarded completion did not apply, decided by `report_step`.
async fn report_off_path(
    conn: &mut Conn,
    report: &Report,
) -> Result<Result<AssignmentState, Refusal>, DbError> {
    let view = write_view(conn, &report.id).await?;
    match report_step(view.as_ref(), report.outcome, Millis(report.now))? {
        ReportStep::Answer(answer) => Ok(answer),
        ReportStep::Apply { from, to, reason } => {
            if let Some(error) = &report.device_error {
                sqlx::query("UPDATE assignments SET device_error = $1 WHERE id = $2")
                    .bind(device_error_text(error))
                    .bind(&report.id)
                    .execute(&mut *conn)
                    .await?;
            }
            transition(conn, &report.id, from, to, reason, Millis(report.now)).await?;
            Ok(Ok(to))
        }
    }
}

/// A completion with its round row locked first; the completion that reaches the goal closes the
/// round and creates its job in the same transaction.
/// `Ok((answer, closed))`: `closed` when this completion reached the goal and created the job.
async fn complete(
    tx: &mut Conn,
    report: &Report,
) -> Result<(Result<AssignmentState, Refusal>, bool), DbError> {
    debug_assert!(UPLOADED.can_become(COMPLETED));
    let round: Option<(String, String, i64, Option<i64>)> = sqlx::query_as(COMPLETE.as_str())
        .bind(report.now)
        .bind(&report.id)
        .bind(new_history_id())
        .fetch_optional(&mut *tx)
        .await?;
    let Some((round_id, _, goal, completed)) = round else {
        return Ok((Err(Refusal::UnknownAssignment), false));
    };
    let Some(completed) = completed else {
        return Ok((report_off_path(tx, report).await?, false));
    };
    if completed != goal {
        return Ok((Ok(COMPLETED), false));
    }
    close_round(tx, &round_id, goal, report.now).await?;
    Ok((Ok(COMPLETED), true))
}

/// Closes a collecting round whose completions reached its goal, and creates its job, in the
/// transaction of the completion that reached it.
pub(super) async fn close_round(
    tx: &mut Conn,
    round_id: &str,
    goal: i64,
    now: i64,
) -> Result<(), DbError> {
    debug_assert!(COLLECTING.can_become(AGGREGATING));
    sqlx::query(CLOSE_ROUND.as_str())
        .bind(round_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    history::append(
        tx,
        RoundState::ENTITY,
        round_id,
        Some(COLLECTING.as_str()),
        AGGREGATING.as_str(),
        &format!("report goal {goal} reached"),
        Millis(now),
    )
    .await?;
    sqlx::query(CREATE_JOB.as_str())
        .bind(round_id)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl DeviceStore for PostgresDevices<'_> {
    async fn candidates(&self, population: &str) -> Result<Vec<CandidateRow>, DbError> {
        let reads = self.0.device_reads()?;
        reads.candidates.read(population.to_string()).await
    }

    async fn assign(&self, new: NewAssignment) -> Result<Option<Assigned>, DbError> {
        let expires_at = new.expires_at;
        let history_id = new_history_id();
        let item = SetItem::Assign {
            new: new.clone(),
            history_id: history_id.clone(),
        };
        let settle = |outcome: &SetOutcome| match outcome {
            SetOutcome::Assigned { key_id } => Some(Some((key_id.clone(),))),
            SetOutcome::NoSlot => Some(None),
            _ => None,
        };
        let key_id: Option<(Option<String>,)> = self
            .0
            .batched_write(item, settle, move |tx| {
                let (new, history_id) = (new.clone(), history_id.clone());
                Box::pin(async move {
                    Ok(sqlx::query_as(ASSIGN.as_str())
                        .bind(new.round_id)
                        .bind(new.key_if_unset)
                        .bind(new.capacity)
                        .bind(new.id)
                        .bind(new.expires_at)
                        .bind(new.now)
                        .bind(history_id)
                        .fetch_optional(&mut *tx)
                        .await?)
                })
            })
            .await?;
        Ok(match key_id {
            Some((Some(key_id),)) => Some(Assigned { key_id, expires_at }),
            _ => None,
        })
    }

    async fn assignment(&self, id: String) -> Result<Option<AssignmentView>, DbError> {
        let rows = self.0.device_reads()?.views.read(id).await?;
        rows.into_iter().next().map(view_from_row).transpose()
    }

    async fn record_upload(&self, upload: NewUpload) -> Result<Result<Stored, Refusal>, DbError> {
        debug_assert!(ASSIGNED.can_become(UPLOADED));
        let history_id = new_history_id();
        let item = SetItem::Upload {
            upload: upload.clone(),
            history_id: history_id.clone(),
        };
        let settle = |outcome: &SetOutcome| match outcome {
            SetOutcome::Uploaded(applied) => Some((i64::from(*applied),)),
            _ => None,
        };
        let (changed,): (i64,) = {
            let upload = upload.clone();
            self.0
                .batched_write(item, settle, move |tx| {
                    let (upload, history_id) = (upload.clone(), history_id.clone());
                    Box::pin(async move {
                        Ok(sqlx::query_as(UPLOAD.as_str())
                            .bind(upload.now)
                            .bind(upload.sha256_hex)
                            .bind(upload.size)
                            .bind(upload.blob_key)
                            .bind(upload.id)
                            .bind(history_id)
                            .bind(upload.blake3_hex)
                            .fetch_one(&mut *tx)
                            .await?)
                    })
                })
                .await?
        };
        if changed == 1 {
            return Ok(Ok(Stored::New));
        }
        // Only a refusal or a repeated upload reads the row to say why.
        self.0
            .write(move |tx| {
                Box::pin(async move {
                    let view = write_view(tx, &upload.id).await?;
                    Ok(upload_outcome(view, &upload.sha256_hex, Millis(upload.now)))
                })
            })
            .await
    }

    async fn record_report(
        &self,
        report: Report,
    ) -> Result<Result<AssignmentState, Refusal>, DbError> {
        let item = match report.outcome {
            ReportOutcome::Completed => SetItem::Complete {
                id: report.id.clone(),
                now: report.now,
                history_id: new_history_id(),
            },
            _ => SetItem::Report {
                id: report.id.clone(),
            },
        };
        let settle = |outcome: &SetOutcome| match outcome {
            SetOutcome::Completed { closed } => Some((Ok(COMPLETED), *closed)),
            _ => None,
        };
        let (answer, closed) = self
            .0
            .batched_write(item, settle, move |tx| {
                let report = report.clone();
                Box::pin(async move {
                    if report.outcome == ReportOutcome::Completed {
                        complete(tx, &report).await
                    } else {
                        Ok((report_off_path(tx, &report).await?, false))
                    }
                })
            })
            .await?;
        // After the commit: a worker woken earlier could lease before the job row is visible.
        if closed {
            self.0.announce_job().await;
        }
        Ok(answer)
    }
}
