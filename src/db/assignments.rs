//! Assignments: one device's one-time capability to contribute to one round. The device protocol
//! (check-in, upload, report) builds on these primitives.

use super::{Db, DbError, new_id, transition};
use crate::clock::Millis;
use crate::states::AssignmentState;

impl Db {
    /// Records a new assignment (ASSIGNED) in a round, expiring at `expires_at`.
    pub async fn insert_assignment(
        &self,
        round_id: &str,
        expires_at: i64,
    ) -> Result<String, DbError> {
        let now = self.now().0;
        let id = new_id();
        let (round_id, assignment_id) = (round_id.to_string(), id.clone());
        self.write(move |tx| {
            Box::pin(async move {
                super::device::insert_row(
                    &mut *tx,
                    &assignment_id,
                    &round_id,
                    expires_at,
                    "assigned",
                    Millis(now),
                )
                .await?;
                sqlx::query(
                    "UPDATE rounds SET live_assignments = live_assignments + 1 WHERE id = $1",
                )
                .bind(&round_id)
                .execute(&mut *tx)
                .await?;
                Ok(())
            })
        })
        .await?;
        Ok(id)
    }

    /// Moves an assignment between states (compare-and-set on `from`).
    pub async fn transition_assignment(
        &self,
        assignment_id: &str,
        from: AssignmentState,
        to: AssignmentState,
        reason: &str,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let assignment_id = assignment_id.to_string();
        let reason = reason.to_string();
        self.write(move |tx| {
            Box::pin(async move {
                let assignment_id = assignment_id.as_str();
                let reason = reason.as_str();
                transition(&mut *tx, assignment_id, from, to, reason, Millis(now)).await?;
                Ok(())
            })
        })
        .await
    }

    /// The stored state of an assignment.
    pub async fn assignment_state(&self, assignment_id: &str) -> Result<AssignmentState, DbError> {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM assignments WHERE id = $1")
                .bind(assignment_id)
                .fetch_optional(self.pool())
                .await?;
        let state = state.ok_or_else(|| DbError::NotFound {
            entity: "assignment",
            id: assignment_id.to_string(),
        })?;
        super::parse_state(&state)
    }
}
