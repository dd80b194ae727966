//! The rows the device store reads, by column name: the same structs on both engines (sqlx's
//! `FromRow` on PostgreSQL, `from_sqlite` on SQLite's raw read connection), so neither reads a
//! column by its position and the SQL's aliases (`CANDIDATES`, `VIEW_SQL`, `WRITE_VIEW_SQL`) are
//! the one list of what each holds.

/// A collecting round of an open task in the population (`CANDIDATES`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub(in crate::db) struct CandidateRow {
    pub round_id: String,
    pub task_id: String,
    pub tenant_id: String,
    pub round_number: i64,
    pub deadline_at: i64,
    pub key_id: Option<String>,
    pub model_version: Option<i64>,
    pub live_assignments: i64,
    pub spec_json: String,
    pub attempt: i64,
    pub task_created_at: i64,
    pub capacity: Option<i64>,
    pub on_demand_evaluation: i64,
}

/// An assignment with its round and task (`VIEW_SQL`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub(in crate::db) struct ViewRow {
    pub id: String,
    pub state: String,
    pub expires_at: i64,
    pub round_state: String,
    pub round_number: i64,
    pub attempt: i64,
    pub key_id: Option<String>,
    pub task_id: String,
    pub tenant_id: String,
    pub contribution_digest: Option<String>,
    pub model_bytes: Option<i64>,
    pub model_version: Option<i64>,
}

/// The light read behind a guarded write that changed nothing (`WRITE_VIEW_SQL`).
#[derive(Debug, sqlx::FromRow)]
pub(in crate::db) struct WriteViewRow {
    pub id: String,
    pub state: String,
    pub expires_at: i64,
    pub round_state: String,
    pub contribution_digest: Option<String>,
}

impl CandidateRow {
    pub(in crate::db) fn from_sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            round_id: row.get("round_id")?,
            task_id: row.get("task_id")?,
            tenant_id: row.get("tenant_id")?,
            round_number: row.get("round_number")?,
            deadline_at: row.get("deadline_at")?,
            key_id: row.get("key_id")?,
            model_version: row.get("model_version")?,
            live_assignments: row.get("live_assignments")?,
            spec_json: row.get("spec_json")?,
            attempt: row.get("attempt")?,
            task_created_at: row.get("task_created_at")?,
            capacity: row.get("capacity")?,
            on_demand_evaluation: row.get("on_demand_evaluation")?,
        })
    }
}

impl ViewRow {
    pub(in crate::db) fn from_sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            id: row.get("id")?,
            state: row.get("state")?,
            expires_at: row.get("expires_at")?,
            round_state: row.get("round_state")?,
            round_number: row.get("round_number")?,
            attempt: row.get("attempt")?,
            key_id: row.get("key_id")?,
            task_id: row.get("task_id")?,
            tenant_id: row.get("tenant_id")?,
            contribution_digest: row.get("contribution_digest")?,
            model_bytes: row.get("model_bytes")?,
            model_version: row.get("model_version")?,
        })
    }
}

impl WriteViewRow {
    pub(in crate::db) fn from_sqlite(row: &rusqlite::Row<'_>) -> rusqlite::Result<Self> {
        Ok(Self {
            id: row.get("id")?,
            state: row.get("state")?,
            expires_at: row.get("expires_at")?,
            round_state: row.get("round_state")?,
            contribution_digest: row.get("contribution_digest")?,
        })
    }
}
