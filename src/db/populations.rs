//! Populations and the tenant each belongs to. A device population is a partner's: only that
//! tenant's tasks run on it, so another tenant cannot create a task with its own privacy
//! parameters, model and plan and receive the partner's devices.

use serde::Serialize;
use utoipa::ToSchema;

use super::{Conn, Db, DbError};
use crate::clock::Millis;

/// A population as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema, sqlx::FromRow)]
pub struct PopulationRecord {
    pub name: String,
    pub tenant_id: String,
    pub created_at: i64,
}

/// What a claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// The population was free and is now the tenant's.
    New,
    /// It already was the tenant's.
    Already,
}

/// Claims `name` for `tenant_id` inside a write transaction: free populations become the
/// tenant's; another tenant's is refused (`PopulationTaken`).
pub(super) async fn claim(
    conn: &mut Conn,
    tenant_id: &str,
    name: &str,
    now: Millis,
) -> Result<Claimed, DbError> {
    let now = now.0;
    let inserted = sqlx::query(
        "INSERT INTO populations (name, tenant_id, created_at) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(tenant_id)
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Claimed::New);
    }
    let owner: String = sqlx::query_scalar("SELECT tenant_id FROM populations WHERE name = $1")
        .bind(name)
        .fetch_one(&mut *conn)
        .await?;
    if owner == tenant_id {
        Ok(Claimed::Already)
    } else {
        Err(DbError::PopulationTaken(name.to_string()))
    }
}

impl Db {
    /// Registers a population for a tenant ahead of its first task.
    pub async fn claim_population(&self, tenant_id: &str, name: &str) -> Result<Claimed, DbError> {
        let now = self.now().0;
        let (tenant_id, name) = (tenant_id.to_string(), name.to_string());
        self.write(move |conn| {
            Box::pin(async move { claim(conn, &tenant_id, &name, Millis(now)).await })
        })
        .await
    }

    /// A tenant's populations, by name.
    pub async fn populations(&self, tenant_id: &str) -> Result<Vec<PopulationRecord>, DbError> {
        Ok(sqlx::query_as(
            "SELECT name, tenant_id, created_at FROM populations WHERE tenant_id = $1 ORDER BY name",
        )
        .bind(tenant_id)
        .fetch_all(self.pool())
        .await?)
    }

    /// Active tasks (CREATED or OPEN) of tenants other than `tenant_id` on a population:
    /// (tenant id, task id).
    pub async fn other_tenants_active_tasks(
        &self,
        population: &str,
        tenant_id: &str,
    ) -> Result<Vec<(String, String)>, DbError> {
        Ok(sqlx::query_as(
            "SELECT tenant_id, id FROM tasks WHERE population = $1 AND tenant_id <> $2 \
             AND state IN ('CREATED', 'OPEN')",
        )
        .bind(population)
        .bind(tenant_id)
        .fetch_all(self.pool())
        .await?)
    }

    /// The operator gives a population to a tenant: a free one, or another tenant's that has no
    /// active task on it (its devices would otherwise go to a new owner mid-task).
    pub async fn assign_population(
        &self,
        name: &str,
        tenant_id: &str,
    ) -> Result<PopulationRecord, DbError> {
        let now = self.now().0;
        let (name, tenant_id) = (name.to_string(), tenant_id.to_string());
        self.write(move |conn| {
            Box::pin(async move {
                let exists: Option<String> =
                    sqlx::query_scalar("SELECT id FROM tenants WHERE id = $1")
                        .bind(&tenant_id)
                        .fetch_optional(&mut *conn)
                        .await?;
                if exists.is_none() {
                    return Err(DbError::NotFound {
                        entity: "tenant",
                        id: tenant_id,
                    });
                }
                let active: i64 = sqlx::query_scalar(
                    "SELECT COUNT(*) FROM tasks WHERE population = $1 AND tenant_id <> $2 \
                     AND state IN ('CREATED', 'OPEN')",
                )
                .bind(&name)
                .bind(&tenant_id)
                .fetch_one(&mut *conn)
                .await?;
                if active > 0 {
                    return Err(DbError::StateConflict {
                        entity: "population",
                        id: name,
                        expected: "without another tenant's active tasks",
                        found: format!("running {active} active tasks of its current tenant"),
                    });
                }
                sqlx::query(
                    "INSERT INTO populations (name, tenant_id, created_at) VALUES ($1, $2, $3) \
                     ON CONFLICT (name) DO UPDATE SET tenant_id = excluded.tenant_id",
                )
                .bind(&name)
                .bind(&tenant_id)
                .bind(now)
                .execute(&mut *conn)
                .await?;
                Ok(sqlx::query_as(
                    "SELECT name, tenant_id, created_at FROM populations WHERE name = $1",
                )
                .bind(&name)
                .fetch_one(&mut *conn)
                .await?)
            })
        })
        .await
    }
}
