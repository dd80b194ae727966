//! A batch's device writes as sets: one statement for all of its uploads (they lock no round),
//! then one that locks every round its check-ins and reports touch, and one for all its
//! check-ins and completed reports together.
//!
//! Run one statement per device (`device.rs`), a batch of 30 writes took 32 round trips, and it
//! held its rounds' rows from the first of them through its commit: on two cores PostgreSQL ran
//! about 6 ms of statements in a 20 ms batch, and the rest was waiting on round trips while the
//! round row stayed locked (device cycles at 0.44 of SQLite's). As sets, a batch is five round
//! trips (three more for a round that closes, one more for each write left to its single
//! statement), and holds its rounds for two of them and the commit.
//!
//! Every write keeps the single statement's guard; the sets only decide the common case. What a
//! set does not apply is answered from the set where the answer needs nothing more (a check-in
//! of a round that is full or no longer collecting: "no slot"; an upload whose guard fails: "not
//! stored", and its caller reads why, as before). A completion the set does not apply, and a
//! second write of the same kind to one assignment in one batch, run their single statement
//! afterwards in the same transaction, which sees the sets' effects: so a report that came too
//! late, or twice, gets exactly the answer it got before.
//!
//! Order: the writes of one batch were concurrent (each caller waits for its answer), so any
//! order of them is one their callers could have seen, and the sets choose uploads, check-ins,
//! completions, then the writes left to their single statements. Within a kind and a round the
//! order is arrival order: the k-th check-in of a round takes a slot if `live + k <= capacity`
//! (k counts the batch's earlier check-ins of the round; every check-in of a round passes the
//! same capacity, the round's), the k-th completion counts if `completed + k <= goal`, and the
//! completion that reaches the goal closes the round, with its job, in the same transaction.
//!
//! Locks: the second statement locks every round of the batch's check-ins and reports in id
//! order (`FOR NO KEY UPDATE`, as an UPDATE of the row would: rows that only reference a round
//! are not held up), so two batches (two replicas) do not wait for each other in a cycle over
//! rounds, and the single statements that follow lock no round it did not. One cycle remains,
//! over an assignment: a device that uploads through one replica while it reports the same
//! assignment through another can leave each batch waiting for the other (the upload's row
//! lock, the report's round); PostgreSQL's detector breaks it, and `batch.rs` runs both batches
//! again.

use std::collections::{BTreeMap, HashSet};
use std::sync::LazyLock;

use serde_json::json;

use crate::db::device::{NewAssignment, NewUpload};
use crate::db::{Conn, DbError};
use crate::states::{AssignmentState, RoundState, StateMachine};

use AssignmentState::{Assigned as ASSIGNED, Completed as COMPLETED, Uploaded as UPLOADED};
use RoundState::Collecting as COLLECTING;

/// One device write as a member of a set.
#[derive(Debug, Clone)]
pub(in crate::db) enum SetItem {
    Assign {
        new: NewAssignment,
        history_id: String,
    },
    Upload {
        upload: NewUpload,
        history_id: String,
    },
    /// A completed report.
    Complete {
        id: String,
        now: i64,
        history_id: String,
    },
    /// Any other report: no set applies it, but its round is locked with the others.
    Report { id: String },
}

/// What the sets decided for one write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::db) enum SetOutcome {
    /// The check-in took a slot; the round's key.
    Assigned { key_id: Option<String> },
    /// The round is full or no longer collecting.
    NoSlot,
    /// The guarded upload applied (`true`) or did not (`false`).
    Uploaded(bool),
    /// The completion applied; `closed` when it reached the goal and created the round's job.
    Completed { closed: bool },
}

/// Locks the rows of the rounds of `$1` (round ids) and of `$2` (assignment ids), in id order.
///
/// Every set names the rows it reads or writes by `id = ANY(ARRAY(...))` besides its join, and
/// writes its guards on a row's state as `CASE WHEN state = ... THEN ... ELSE false END`: the
/// planner takes a JSON input for 100 rows and the tables for what their last ANALYZE saw, and
/// chose hash joins over sequential scans of `assignments`, or the state index (every UPLOADED
/// assignment, once per input row), over the primary key: 2-7 ms a statement on tables of a few
/// thousand rows, growing with them. The ids are the one condition left for an index, so every
/// row is found by its key. (The guards are the same: an UPDATE rechecks its whole WHERE.)
const LOCK_ROUNDS: &str = "SELECT id FROM rounds WHERE id = ANY(ARRAY(\
     SELECT jsonb_array_elements_text($1::jsonb) UNION SELECT a.round_id FROM assignments a \
     WHERE a.id = ANY(ARRAY(SELECT jsonb_array_elements_text($2::jsonb))))) \
     ORDER BY id FOR NO KEY UPDATE";

/// `device.rs`'s guarded upload for each member; answers the ords it applied to.
static UPLOAD_SET: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH i AS (SELECT * FROM jsonb_to_recordset($1::jsonb) AS t(ord bigint, id text, \
         at_ms bigint, digest text, size bigint, blob_key text, blake3 text, hid text)), \
         u AS (UPDATE assignments a SET state = '{uploaded}', updated_at = i.at_ms, \
         contribution_digest = i.digest, contribution_bytes = i.size, blob_key = i.blob_key, \
         contribution_blake3 = i.blake3 FROM i \
         WHERE a.id = i.id AND a.id = ANY(ARRAY(SELECT id FROM i)) \
         AND CASE WHEN a.state = '{assigned}' AND a.contribution_digest IS NULL \
         THEN a.expires_at > i.at_ms ELSE false END AND EXISTS (SELECT 1 FROM rounds r \
         WHERE r.id = a.round_id AND CASE WHEN r.state = '{collecting}' THEN true ELSE false END) \
         RETURNING a.id), \
         h AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT i.hid, '{entity}', i.id, \
         (SELECT COALESCE(MAX(s.seq), 0) + 1 FROM state_history s WHERE s.entity_id = i.id), \
         '{assigned}', '{uploaded}', 'contribution stored', i.at_ms FROM u JOIN i ON i.id = u.id) \
         SELECT i.ord FROM u JOIN i ON i.id = u.id",
        uploaded = UPLOADED.as_str(),
        assigned = ASSIGNED.as_str(),
        collecting = COLLECTING.as_str(),
        entity = AssignmentState::ENTITY,
    )
});

/// A batch's check-ins and completed reports in one statement, run after its rounds are locked
/// (so its snapshot sees every earlier batch's commit), answering one row per applied member.
///
/// Check-ins: the k-th check-in of a collecting round takes a slot while `live + k <= capacity`;
/// the round's key is set by its first granted check-in if it has none. Completions: the k-th
/// uploaded, unexpired completion of a collecting round counts while `completed + k <= goal` (or,
/// as one by one, always once a round is past its goal); the transition keeps its guard, so a
/// row another transaction changed meanwhile is left out, and the counter moves by what applied.
/// The two share one UPDATE of `rounds` (`delta`): a statement may change a row once, and one
/// statement instead of two takes a round trip off the time a batch holds its rounds.
///
/// Rows: `('a', ord, the round's key, NULL...)` per granted check-in; `('c', ord, NULL, round,
/// at_ms, the round's new count, its goal, its count before)` per applied completion.
static ASSIGN_AND_COMPLETE_SET: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ai AS (SELECT * FROM jsonb_to_recordset($1::jsonb) AS t(ord bigint, round_id text, \
         key_if_unset text, capacity bigint, id text, expires_at bigint, at_ms bigint, hid text)), \
         ci AS (SELECT * FROM jsonb_to_recordset($2::jsonb) AS t(ord bigint, id text, \
         at_ms bigint, hid text)), \
         ranked_a AS (SELECT ai.*, row_number() OVER (PARTITION BY ai.round_id ORDER BY ai.ord) \
         AS k FROM ai), \
         granted AS (SELECT ranked_a.* FROM ranked_a JOIN rounds r ON r.id = ranked_a.round_id \
         WHERE r.id = ANY(ARRAY(SELECT round_id FROM ai)) \
         AND CASE WHEN r.state = '{collecting}' \
         THEN r.live_assignments + ranked_a.k <= ranked_a.capacity ELSE false END), \
         g AS (SELECT round_id, count(*) AS n, \
         (array_agg(key_if_unset ORDER BY ord))[1] AS first_key FROM granted GROUP BY round_id), \
         c AS (SELECT ci.*, a.round_id FROM ci JOIN assignments a ON a.id = ci.id \
         WHERE a.id = ANY(ARRAY(SELECT id FROM ci)) \
         AND CASE WHEN a.state = '{uploaded}' THEN a.expires_at > ci.at_ms ELSE false END), \
         ranked_c AS (SELECT c.*, r.completed_reports AS before, r.report_goal AS goal, \
         row_number() OVER (PARTITION BY c.round_id ORDER BY c.ord) AS k \
         FROM c JOIN rounds r ON r.id = c.round_id \
         WHERE r.id = ANY(ARRAY(SELECT round_id FROM c)) \
         AND CASE WHEN r.state = '{collecting}' THEN true ELSE false END), \
         ok AS (SELECT * FROM ranked_c WHERE before >= goal OR before + k <= goal), \
         u AS (UPDATE assignments a SET state = '{completed}', updated_at = ok.at_ms FROM ok \
         WHERE a.id = ok.id AND a.id = ANY(ARRAY(SELECT id FROM ok)) \
         AND CASE WHEN a.state = '{uploaded}' THEN a.expires_at > ok.at_ms ELSE false END \
         RETURNING a.id, a.round_id), \
         hc AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT ok.hid, '{entity}', ok.id, \
         (SELECT COALESCE(MAX(s.seq), 0) + 1 FROM state_history s WHERE s.entity_id = ok.id), \
         '{uploaded}', '{completed}', 'device reported completion', ok.at_ms \
         FROM u JOIN ok ON ok.id = u.id), \
         n AS (SELECT round_id, count(*) AS n FROM u GROUP BY round_id), \
         delta AS (SELECT COALESCE(g.round_id, n.round_id) AS round_id, \
         COALESCE(g.n, 0) AS assigned, g.first_key, COALESCE(n.n, 0) AS completed \
         FROM g FULL JOIN n ON n.round_id = g.round_id), \
         upd AS (UPDATE rounds SET live_assignments = rounds.live_assignments + delta.assigned, \
         key_id = COALESCE(rounds.key_id, delta.first_key), \
         completed_reports = rounds.completed_reports + delta.completed FROM delta \
         WHERE rounds.id = delta.round_id AND rounds.id = ANY(ARRAY(SELECT round_id FROM delta)) \
         RETURNING rounds.id, rounds.key_id, rounds.completed_reports, rounds.report_goal, \
         delta.completed), \
         inserted AS (INSERT INTO assignments \
         (id, round_id, state, expires_at, created_at, updated_at) \
         SELECT id, round_id, '{assigned}', expires_at, at_ms, at_ms FROM granted), \
         ha AS (INSERT INTO state_history \
         (id, entity, entity_id, seq, from_state, to_state, reason, at) \
         SELECT hid, '{entity}', id, 1, NULL, '{assigned}', 'device checked in', at_ms \
         FROM granted) \
         SELECT 'a' AS kind, granted.ord, upd.key_id, NULL::text AS round_id, NULL::bigint AS at_ms, \
         NULL::bigint AS after, NULL::bigint AS goal, NULL::bigint AS before \
         FROM granted JOIN upd ON upd.id = granted.round_id \
         UNION ALL \
         SELECT 'c', ok.ord, NULL::text, ok.round_id, ok.at_ms, upd.completed_reports, \
         upd.report_goal, upd.completed_reports - upd.completed \
         FROM u JOIN ok ON ok.id = u.id JOIN upd ON upd.id = u.round_id",
        collecting = COLLECTING.as_str(),
        assigned = ASSIGNED.as_str(),
        uploaded = UPLOADED.as_str(),
        completed = COMPLETED.as_str(),
        entity = AssignmentState::ENTITY,
    )
});

/// Runs the sets of `items` (a batch, in arrival order; `None`: a job with no set member) on
/// `conn`, inside the batch's transaction. Answers, per item, what the sets decided, or `None`
/// where the job must run its single statement (after this, in the same transaction).
pub(super) async fn run(
    conn: &mut Conn,
    items: &[Option<&SetItem>],
) -> Result<Vec<Option<SetOutcome>>, DbError> {
    let mut outcomes = vec![None; items.len()];
    let members = Members::of(items);
    // Uploads first: they lock no round row, so they do not lengthen the time the batch holds
    // its rounds, which every other batch of those rounds waits out.
    if !members.uploads.is_empty() {
        upload(conn, &members.uploads, &mut outcomes).await?;
    }
    if members.locks_rounds() {
        sqlx::query(LOCK_ROUNDS)
            .bind(json!(members.lock_round_ids).to_string())
            .bind(json!(members.lock_assignment_ids).to_string())
            .fetch_all(&mut *conn)
            .await?;
    }
    if !members.assigns.is_empty() || !members.completions.is_empty() {
        assign_and_complete(conn, &members, &mut outcomes).await?;
    }
    Ok(outcomes)
}

/// A batch's items sorted into sets (each set in arrival order) and the ids its lock covers.
struct Members<'a> {
    assigns: Vec<(usize, &'a NewAssignment, &'a str)>,
    uploads: Vec<(usize, &'a NewUpload, &'a str)>,
    completions: Vec<(usize, &'a str, i64, &'a str)>,
    lock_round_ids: Vec<&'a str>,
    lock_assignment_ids: Vec<&'a str>,
}

impl<'a> Members<'a> {
    fn of(items: &[Option<&'a SetItem>]) -> Self {
        let mut members = Members {
            assigns: Vec::new(),
            uploads: Vec::new(),
            completions: Vec::new(),
            lock_round_ids: Vec::new(),
            lock_assignment_ids: Vec::new(),
        };
        // A second write of one kind to one assignment runs its single statement, after the
        // sets: an UPDATE ... FROM touches a row once (with one of its matching inputs, chosen
        // by the plan), so the statements rely on every id being in their input once.
        let (mut uploaded, mut completed) = (HashSet::new(), HashSet::new());
        for (ord, item) in items.iter().enumerate() {
            match item {
                Some(SetItem::Assign { new, history_id }) => {
                    members.lock_round_ids.push(&new.round_id);
                    members.assigns.push((ord, new, history_id));
                }
                Some(SetItem::Upload { upload, history_id })
                    if uploaded.insert(upload.id.as_str()) =>
                {
                    members.uploads.push((ord, upload, history_id));
                }
                Some(SetItem::Upload { .. }) => {}
                Some(SetItem::Complete {
                    id,
                    now,
                    history_id,
                }) => {
                    members.lock_assignment_ids.push(id);
                    if completed.insert(id.as_str()) {
                        members.completions.push((ord, id, *now, history_id));
                    }
                }
                Some(SetItem::Report { id }) => members.lock_assignment_ids.push(id),
                None => {}
            }
        }
        members
    }

    fn locks_rounds(&self) -> bool {
        !self.lock_round_ids.is_empty() || !self.lock_assignment_ids.is_empty()
    }
}

async fn upload(
    conn: &mut Conn,
    uploads: &[(usize, &NewUpload, &str)],
    outcomes: &mut [Option<SetOutcome>],
) -> Result<(), DbError> {
    let rows: Vec<_> = uploads
        .iter()
        .map(|(ord, upload, history_id)| {
            json!({
                "ord": ord, "id": upload.id, "at_ms": upload.now, "digest": upload.sha256_hex,
                "size": upload.size, "blob_key": upload.blob_key, "blake3": upload.blake3_hex,
                "hid": history_id,
            })
        })
        .collect();
    let applied: Vec<(i64,)> = sqlx::query_as(UPLOAD_SET.as_str())
        .bind(json!(rows).to_string())
        .fetch_all(&mut *conn)
        .await?;
    for (ord, _, _) in uploads {
        outcomes[*ord] = Some(SetOutcome::Uploaded(false));
    }
    for (ord,) in applied {
        *outcome_at(outcomes, ord)? = Some(SetOutcome::Uploaded(true));
    }
    Ok(())
}

/// One row of `ASSIGN_AND_COMPLETE_SET`: (kind, ord, the round's key for a check-in; for a
/// completion its round, at_ms, the round's count after, goal, count before).
type SetRow = (
    String,
    i64,
    Option<String>,
    Option<String>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

async fn assign_and_complete(
    conn: &mut Conn,
    members: &Members<'_>,
    outcomes: &mut [Option<SetOutcome>],
) -> Result<(), DbError> {
    let assigns: Vec<_> = members
        .assigns
        .iter()
        .map(|(ord, new, history_id)| {
            json!({
                "ord": ord, "round_id": new.round_id, "key_if_unset": new.key_if_unset,
                "capacity": new.capacity, "id": new.id, "expires_at": new.expires_at,
                "at_ms": new.now, "hid": history_id,
            })
        })
        .collect();
    let completions: Vec<_> = members
        .completions
        .iter()
        .map(|(ord, id, now, history_id)| {
            json!({"ord": ord, "id": id, "at_ms": now, "hid": history_id})
        })
        .collect();
    let rows: Vec<SetRow> = sqlx::query_as(ASSIGN_AND_COMPLETE_SET.as_str())
        .bind(json!(assigns).to_string())
        .bind(json!(completions).to_string())
        .fetch_all(&mut *conn)
        .await?;
    for (ord, _, _) in &members.assigns {
        outcomes[*ord] = Some(SetOutcome::NoSlot);
    }
    // The completion that reaches a round's goal is its last applied one in arrival order.
    let mut closers: BTreeMap<String, (i64, i64, i64)> = BTreeMap::new();
    for (kind, ord, key_id, round_id, at_ms, after, goal, before) in rows {
        match (kind.as_str(), round_id, at_ms, after, goal, before) {
            ("a", ..) => *outcome_at(outcomes, ord)? = Some(SetOutcome::Assigned { key_id }),
            ("c", Some(round_id), Some(at_ms), Some(after), Some(goal), Some(before)) => {
                *outcome_at(outcomes, ord)? = Some(SetOutcome::Completed { closed: false });
                if before < goal && after == goal {
                    let closer = closers.entry(round_id).or_insert((ord, at_ms, goal));
                    if ord > closer.0 {
                        *closer = (ord, at_ms, goal);
                    }
                }
            }
            _ => {
                return Err(DbError::Corrupt(format!(
                    "a device write set answered an incomplete row for member {ord}"
                )));
            }
        }
    }
    for (round_id, (ord, at_ms, goal)) in closers {
        super::device::close_round(conn, &round_id, goal, at_ms).await?;
        *outcome_at(outcomes, ord)? = Some(SetOutcome::Completed { closed: true });
    }
    Ok(())
}

/// The outcome slot of the member `ord` a statement answered.
fn outcome_at(
    outcomes: &mut [Option<SetOutcome>],
    ord: i64,
) -> Result<&mut Option<SetOutcome>, DbError> {
    usize::try_from(ord)
        .ok()
        .and_then(|ord| outcomes.get_mut(ord))
        .ok_or_else(|| DbError::Corrupt(format!("a device write set answered member {ord}")))
}

#[cfg(test)]
#[path = "sets_tests.rs"]
mod tests;
