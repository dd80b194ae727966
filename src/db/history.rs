//! The append-only state history: one row per transition of any task, round or assignment.

use sqlx::FromRow;

use super::{Conn, Db, DbError};
use crate::clock::Millis;

#[derive(Debug, Clone, PartialEq, Eq, FromRow)]
pub struct HistoryRecord {
    pub entity: String,
    pub entity_id: String,
    pub from_state: Option<String>,
    pub to_state: String,
    pub reason: String,
    pub at: i64,
}

/// A history row appended after the entity's last (`seq` one more): `$1` id, `$2` entity, `$3`
/// entity id, `$4` from, `$5` to, `$6` reason, `$7` time. Both engines, and rusqlite (which binds
/// `$n` by position).
pub(crate) const APPEND_SQL: &str = "INSERT INTO state_history (id, entity, entity_id, seq, from_state, to_state, reason, at) \
     SELECT $1, $2, $3, COALESCE(MAX(seq), 0) + 1, $4, $5, $6, $7 \
     FROM state_history WHERE entity_id = $3";

pub(crate) async fn append(
    conn: &mut Conn,
    entity: &str,
    entity_id: &str,
    from: Option<&str>,
    to: &str,
    reason: &str,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    sqlx::query(APPEND_SQL)
        .bind(super::new_history_id())
        .bind(entity)
        .bind(entity_id)
        .bind(from)
        .bind(to)
        .bind(reason)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

impl Db {
    /// The transitions of one entity, oldest first.
    pub async fn history(&self, entity_id: &str) -> Result<Vec<HistoryRecord>, DbError> {
        Ok(sqlx::query_as(
            "SELECT entity, entity_id, from_state, to_state, reason, at FROM state_history \
             WHERE entity_id = $1 ORDER BY seq",
        )
        .bind(entity_id)
        .fetch_all(self.pool())
        .await?)
    }
}
