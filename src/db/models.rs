//! Model versions of a task: where each version's bytes live in the blob store.

use super::{Conn, Db, DbError};
use crate::clock::Millis;

/// A model version about to be recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewModel {
    pub blob_key: String,
    pub sha256_hex: String,
    pub size_bytes: i64,
    /// The server optimizer's state after this version's round (None for FedAvg, version 0).
    pub optimizer_state_key: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRecord {
    pub task_id: String,
    pub version: i64,
    pub blob_key: String,
    pub sha256_hex: String,
    pub size_bytes: i64,
    pub created_at: i64,
    /// The server optimizer's state after this version's round (None for FedAvg, version 0).
    pub optimizer_state_key: Option<String>,
}

pub(crate) async fn insert(
    conn: &mut Conn,
    task_id: &str,
    version: i64,
    model: &NewModel,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    sqlx::query(
        "INSERT INTO models (task_id, version, blob_key, sha256, size_bytes, created_at, \
         optimizer_state_key) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(task_id)
    .bind(version)
    .bind(&model.blob_key)
    .bind(&model.sha256_hex)
    .bind(model.size_bytes)
    .bind(now)
    .bind(&model.optimizer_state_key)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

pub(crate) async fn load(
    conn: &mut Conn,
    task_id: &str,
    version: i64,
) -> Result<ModelRecord, DbError> {
    let row: Option<(String, String, i64, i64, Option<String>)> = sqlx::query_as(
        "SELECT blob_key, sha256, size_bytes, created_at, optimizer_state_key FROM models \
         WHERE task_id = $1 AND version = $2",
    )
    .bind(task_id)
    .bind(version)
    .fetch_optional(&mut *conn)
    .await?;
    let (blob_key, sha256_hex, size_bytes, created_at, optimizer_state_key) =
        row.ok_or_else(|| DbError::NotFound {
            entity: "model",
            id: format!("{task_id}/{version}"),
        })?;
    Ok(ModelRecord {
        task_id: task_id.to_string(),
        version,
        blob_key,
        sha256_hex,
        size_bytes,
        created_at,
        optimizer_state_key,
    })
}

impl Db {
    /// One model version of any task (devices download models without a tenant token).
    /// What the contributions of round `round` of a task are bound to, as the database says:
    /// the task policy's hash and the hash of model version `round - 1`. (For tools and tests: the
    /// enclave never takes these from the database, it hashes the policy and model it is given.)
    pub async fn round_context(
        &self,
        task_id: &str,
        round: i64,
    ) -> Result<confed_protocol::envelope::RoundContext, DbError> {
        let task = {
            let mut conn = self.pool().acquire().await?;
            super::tasks::load_any(&mut conn, task_id).await?
        };
        let model = self
            .model_of_task(task_id, task.spec.base_model_version(round))
            .await?;
        Ok(confed_protocol::envelope::RoundContext {
            task_id: task_id.to_string(),
            round: confed_protocol::ids::wire_round(round)
                .ok_or_else(|| DbError::Corrupt(format!("round number {round}")))?,
            policy_sha256: task.spec.policy(task_id, &task.tenant_id).sha256_hex(),
            model_sha256: model.sha256_hex,
        })
    }

    pub async fn model_of_task(&self, task_id: &str, version: i64) -> Result<ModelRecord, DbError> {
        if let Some(record) = self.cached_model(task_id, version) {
            return Ok(record);
        }
        let mut conn = self.pool().acquire().await?;
        let record = load(&mut conn, task_id, version).await?;
        self.cache_model(&record);
        Ok(record)
    }

    /// One model version of one tenant's task (`NotFound` for another tenant's task).
    pub async fn model(
        &self,
        tenant_id: &str,
        task_id: &str,
        version: i64,
    ) -> Result<ModelRecord, DbError> {
        self.task(tenant_id, task_id).await?;
        self.model_of_task(task_id, version).await
    }
}
