//! Console sessions: which tenant a browser signed in as, until when. Keyed by the SHA-256 of
//! the cookie's secret (the caller hashes), so the table alone signs nobody in.

use super::{Db, DbError, TenantRecord};

/// Most live console sessions one tenant keeps (browsers signed in at once).
pub(super) const MAX_SESSIONS_PER_TENANT: i64 = 20;

impl Db {
    /// Records a session for `tenant_id` lasting `ttl_millis` from now, purges expired ones (sign-ins are
    /// rare, so they carry the clean-up) and keeps at most `MAX_SESSIONS_PER_TENANT` per
    /// tenant, ending the oldest: a script that signs in over and over cannot grow the table.
    pub async fn create_console_session(
        &self,
        id_sha256: &str,
        tenant_id: &str,
        ttl_millis: i64,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let expires_at = now.saturating_add(ttl_millis);
        let row = (id_sha256.to_string(), tenant_id.to_string());
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query("DELETE FROM console_sessions WHERE expires_at <= $1")
                    .bind(now)
                    .execute(&mut *conn)
                    .await?;
                sqlx::query(
                    "INSERT INTO console_sessions (id_sha256, tenant_id, created_at, expires_at) \
                     VALUES ($1, $2, $3, $4)",
                )
                .bind(row.0)
                .bind(row.1.clone())
                .bind(now)
                .bind(expires_at)
                .execute(&mut *conn)
                .await?;
                sqlx::query(
                    "DELETE FROM console_sessions WHERE tenant_id = $1 AND id_sha256 NOT IN \
                     (SELECT id_sha256 FROM console_sessions WHERE tenant_id = $1 \
                      ORDER BY created_at DESC, id_sha256 LIMIT $2)",
                )
                .bind(row.1.clone())
                .bind(MAX_SESSIONS_PER_TENANT)
                .execute(&mut *conn)
                .await
                .map_err(DbError::from)
            })
        })
        .await
        .map(|_| ())
    }

    /// The tenant of a live session, or `None` when the session is unknown or expired.
    pub async fn console_session_tenant(
        &self,
        id_sha256: &str,
    ) -> Result<Option<TenantRecord>, DbError> {
        let now = self.now().0;
        Ok(sqlx::query_as(
            "SELECT t.id, t.name, t.max_active_tasks, t.max_report_goal, t.max_device_hours, \
             t.created_at \
             FROM console_sessions s JOIN tenants t ON t.id = s.tenant_id \
             WHERE s.id_sha256 = $1 AND s.expires_at > $2",
        )
        .bind(id_sha256)
        .bind(now)
        .fetch_optional(self.pool())
        .await?)
    }

    /// Ends a session (sign out); ending an unknown one is not an error.
    pub async fn delete_console_session(&self, id_sha256: &str) -> Result<(), DbError> {
        let id = id_sha256.to_string();
        self.write(move |conn| {
            Box::pin(async move {
                sqlx::query("DELETE FROM console_sessions WHERE id_sha256 = $1")
                    .bind(id)
                    .execute(&mut *conn)
                    .await
                    .map_err(DbError::from)
            })
        })
        .await
        .map(|_| ())
    }
}
