//! Tenants (partners) and their API tokens and quotas.

use serde::Serialize;
use sqlx::FromRow;
use utoipa::ToSchema;
use zeroize::Zeroizing;

use super::{Db, DbError, new_id};
use crate::auth;

/// A tenant as stored; the token hash never leaves the database layer.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, Serialize, ToSchema)]
pub struct TenantRecord {
    pub id: String,
    pub name: String,
    pub max_active_tasks: i64,
    pub max_report_goal: i64,
    /// Device-hours the tenant's active tasks may plan at once.
    pub max_device_hours: i64,
    pub created_at: i64,
}

/// What an operator asks for when creating a tenant.
#[derive(Debug, Clone)]
pub struct NewTenant {
    pub name: String,
    pub max_active_tasks: i64,
    pub max_report_goal: i64,
    pub max_device_hours: i64,
}

/// SHA-256 of nothing in particular: compared against when a token id is unknown, so an unknown
/// id costs the same work as a wrong secret.
const DUMMY_SHA256: &str = "0000000000000000000000000000000000000000000000000000000000000000";

impl Db {
    /// Creates a tenant and returns it with its API token (shown to the operator once, never
    /// stored).
    pub async fn create_tenant(
        &self,
        tenant: &NewTenant,
    ) -> Result<(TenantRecord, Zeroizing<String>), DbError> {
        let now = self.now().0;
        let issued = auth::issue_tenant_token()?;
        let record = TenantRecord {
            id: new_id(),
            name: tenant.name.clone(),
            max_active_tasks: tenant.max_active_tasks,
            max_report_goal: tenant.max_report_goal,
            max_device_hours: tenant.max_device_hours,
            created_at: now,
        };
        let row = (
            record.id.clone(),
            record.name.clone(),
            issued.token_id.clone(),
            issued.secret_sha256_hex.clone(),
            record.max_active_tasks,
            record.max_report_goal,
            record.created_at,
            record.max_device_hours,
        );
        let inserted = self
            .write(move |conn| {
                Box::pin(async move {
                    sqlx::query(
                        "INSERT INTO tenants (id, name, token_id, token_sha256, max_active_tasks, \
                         max_report_goal, created_at, max_device_hours) \
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                    )
                    .bind(row.0)
                    .bind(row.1)
                    .bind(row.2)
                    .bind(row.3)
                    .bind(row.4)
                    .bind(row.5)
                    .bind(row.6)
                    .bind(row.7)
                    .execute(&mut *conn)
                    .await
                    .map_err(DbError::from)
                })
            })
            .await;
        match inserted {
            Ok(_) => Ok((record, issued.token)),
            Err(DbError::Sqlx(e)) if DbError::is_unique_violation(&e) => Err(
                DbError::AlreadyExists(format!("a tenant named {:?}", tenant.name)),
            ),
            Err(e) => Err(e),
        }
    }

    pub async fn list_tenants(&self) -> Result<Vec<TenantRecord>, DbError> {
        Ok(sqlx::query_as(
            "SELECT id, name, max_active_tasks, max_report_goal, max_device_hours, created_at \
             FROM tenants \
             ORDER BY created_at, name",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// The tenant a presented bearer token belongs to, or `None` for any token that is malformed,
    /// unknown or wrong. The secret is compared in constant time.
    pub async fn tenant_for_token(&self, token: &str) -> Result<Option<TenantRecord>, DbError> {
        let Some((token_id, secret)) = auth::split_tenant_token(token) else {
            return Ok(None);
        };
        /// A tenant's row with its token digest, by column name.
        #[derive(sqlx::FromRow)]
        struct TokenRow {
            token_sha256: String,
            #[sqlx(flatten)]
            tenant: TenantRecord,
        }
        let row: Option<TokenRow> = sqlx::query_as(
            "SELECT token_sha256, id, name, max_active_tasks, max_report_goal, created_at, \
             max_device_hours \
             FROM tenants WHERE token_id = $1",
        )
        .bind(token_id)
        .fetch_optional(self.pool())
        .await?;
        let stored = row
            .as_ref()
            .map_or(DUMMY_SHA256, |r| r.token_sha256.as_str());
        let matches = auth::secret_matches(secret, stored);
        Ok(row.filter(|_| matches).map(|r| r.tenant))
    }
}
