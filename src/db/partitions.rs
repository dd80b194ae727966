//! Partitions of an aggregation job (docs/architecture.md, "Partitioned rounds"): the first
//! lease of a large round's job plans it into `count` partitions; each is leased by a worker of
//! its own (lease, renew, store its sealed result, or fail), and the job itself (the root, which
//! merges them) becomes leasable once every partition is stored. Every change is one transaction
//! guarded by the lease it needs, like the job's.

use std::time::Duration;

use super::jobs::fail_leased;
use super::leases::{LeaseAsk, Leased, expiry};
use super::{Conn, Db, DbError};
use crate::clock::Millis;
use crate::states::JobState;

/// A partition a worker just leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedPartition {
    pub round_id: String,
    pub index: u32,
    pub count: u32,
    /// What every later write under this lease names (`lease_holder`).
    pub holder: String,
}

/// A partition of a planned job, and where its sealed result is once stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPartition {
    pub index: u32,
    pub count: u32,
    pub sealed_key: Option<String>,
    /// The worker holding its lease, if any (an expired lease included).
    pub lease_owner: Option<String>,
}

type PartitionRow = (i64, i64, Option<String>, Option<String>);

fn stored(
    (index, count, sealed_key, lease_owner): PartitionRow,
) -> Result<StoredPartition, DbError> {
    Ok(StoredPartition {
        index: to_u32(index)?,
        count: to_u32(count)?,
        sealed_key,
        lease_owner,
    })
}

pub(super) fn to_u32(value: i64) -> Result<u32, DbError> {
    u32::try_from(value).map_err(|_| DbError::Corrupt(format!("partition number {value}")))
}

/// Fails with `LeaseLost` unless `worker` holds the partition's lease (`Leased::check`).
async fn check_partition_lease(
    conn: &mut Conn,
    round_id: &str,
    index: u32,
    worker: &str,
) -> Result<(), DbError> {
    Leased::Partition { round_id, index }
        .check(conn, worker)
        .await
}

impl Db {
    /// Leases the first partition not stored yet whose lease is free or expired, or one this
    /// worker lost track of (`lease_holder`; only while the partition has been leased fewer than
    /// four times, all leases counted, so one that keeps killing its worker waits for its lease
    /// like any other), of the oldest pending job past its backoff, for a request that arrived
    /// `now`. The answer's `holder` is what every later write names.
    pub async fn lease_partition(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<LeasedPartition>, DbError> {
        self.lease_partition_for(worker, self.now().0, lease).await
    }

    /// `lease_partition` for a request that arrived at `arrived` (a long poll asks again and
    /// again, and keeps the time it arrived).
    pub async fn lease_partition_for(
        &self,
        worker: &str,
        arrived: i64,
        lease: Duration,
    ) -> Result<Option<LeasedPartition>, DbError> {
        let now = self.now().0;
        let ask = LeaseAsk::new(worker, arrived);
        let until = expiry(Millis(now), lease)?;
        self.write(move |tx| {
            Box::pin(async move {
                // Locked with SKIP LOCKED on PostgreSQL, so concurrent workers take different
                // partitions; the update repeats the guard (a compare-and-set).
                let free = |p: &str, first: u8| {
                    format!(
                        "({p}lease_expires_at IS NULL OR {p}lease_expires_at <= $1 OR {})",
                        LeaseAsk::reclaimable_sql(
                            p,
                            &format!("{p}attempts < 4"),
                            first,
                            first + 1,
                            first + 2
                        )
                    )
                };
                let sql = format!(
                    "SELECT p.round_id, p.partition_index, p.partition_count \
                     FROM job_partitions p JOIN aggregation_jobs j ON j.round_id = p.round_id \
                     WHERE j.state = '{pending}' AND j.not_before <= $1 AND p.sealed_key IS NULL \
                     AND {} \
                     ORDER BY j.created_at, p.round_id, p.partition_index LIMIT 1{}",
                    free("p.", 2),
                    super::lock_clause(tx, " FOR UPDATE OF p SKIP LOCKED"),
                    pending = JobState::Pending.as_str(),
                );
                let candidate: Option<(String, i64, i64)> =
                    sqlx::query_as(sqlx::AssertSqlSafe(sql))
                        .bind(now)
                        .bind(&ask.other_incarnations)
                        .bind(&ask.own)
                        .bind(&ask.arrived)
                        .fetch_optional(&mut *tx)
                        .await?;
                let Some((round_id, index, count)) = candidate else {
                    return Ok(None);
                };
                let update = format!(
                    "UPDATE job_partitions SET lease_owner = $5, lease_expires_at = $6, \
                     attempts = attempts + 1, updated_at = $1 \
                     WHERE round_id = $7 AND partition_index = $8 AND sealed_key IS NULL AND {}",
                    free("", 2)
                );
                let taken = sqlx::query(sqlx::AssertSqlSafe(update))
                    .bind(now)
                    .bind(&ask.other_incarnations)
                    .bind(&ask.own)
                    .bind(&ask.arrived)
                    .bind(&ask.holder)
                    .bind(until)
                    .bind(&round_id)
                    .bind(index)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if taken == 0 {
                    return Ok(None);
                }
                Ok(Some(LeasedPartition {
                    round_id,
                    index: to_u32(index)?,
                    count: to_u32(count)?,
                    holder: ask.holder,
                }))
            })
        })
        .await
    }

    /// Plans the job `worker` leased into `count` partitions, once (a job already planned keeps
    /// its plan). With more than one, the partitions are created and the job's lease given
    /// back: workers lease the partitions, and the job again once they are all stored.
    pub async fn plan_job(&self, round_id: &str, worker: &str, count: u32) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker) = (round_id.to_string(), worker.to_string());
        let partitioned = self
            .write(move |tx| {
                Box::pin(async move {
                    super::jobs::check_lease(&mut *tx, &round_id, &worker).await?;
                    let planned = sqlx::query(
                        "UPDATE aggregation_jobs SET partitions = $1, updated_at = $2 \
                         WHERE round_id = $3 AND partitions IS NULL",
                    )
                    .bind(i64::from(count))
                    .bind(now)
                    .bind(&round_id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    if planned == 0 || count <= 1 {
                        return Ok(false);
                    }
                    for index in 0..count {
                        sqlx::query(
                            "INSERT INTO job_partitions (round_id, partition_index, \
                             partition_count, created_at, updated_at) VALUES ($1, $2, $3, $4, $4)",
                        )
                        .bind(&round_id)
                        .bind(i64::from(index))
                        .bind(i64::from(count))
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                    }
                    sqlx::query(
                        "UPDATE aggregation_jobs SET lease_owner = NULL, lease_expires_at = NULL, \
                         updated_at = $1 WHERE round_id = $2",
                    )
                    .bind(now)
                    .bind(&round_id)
                    .execute(&mut *tx)
                    .await?;
                    Ok(true)
                })
            })
            .await?;
        if partitioned {
            self.announce_job().await;
        }
        Ok(())
    }

    /// `LeaseLost` unless `worker` holds the partition's lease (read-only, before a blob is
    /// written under the partition's name; the write's own transaction checks again).
    pub async fn check_partition_lease(
        &self,
        round_id: &str,
        index: u32,
        worker: &str,
    ) -> Result<(), DbError> {
        let mut conn = self.pool().acquire().await?;
        check_partition_lease(&mut conn, round_id, index, worker).await
    }

    /// Records the BLAKE3 (hex) of contributions the server did not see arrive (direct uploads
    /// to the blob store), computed by the store before it plans a round into partitions; only
    /// the job's lease holder, only where none is recorded; extends the lease by `lease`. Untrusted like every listed digest:
    /// the enclave fails a job whose bytes do not have their committed digest.
    pub async fn record_contribution_digests(
        &self,
        round_id: &str,
        worker: &str,
        digests: Vec<(String, String)>,
        lease: Duration,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker) = (round_id.to_string(), worker.to_string());
        self.write(move |tx| {
            Box::pin(async move {
                let leased = Leased::Job {
                    round_id: &round_id,
                };
                leased.check(&mut *tx, &worker).await?;
                leased.extend(&mut *tx, Millis(now), lease).await?;
                for (assignment_ref, blake3_hex) in &digests {
                    sqlx::query(
                        "UPDATE assignments SET contribution_blake3 = $1, updated_at = $2 \
                         WHERE id = $3 AND round_id = $4 AND contribution_blake3 IS NULL",
                    )
                    .bind(blake3_hex)
                    .bind(now)
                    .bind(assignment_ref)
                    .bind(&round_id)
                    .execute(&mut *tx)
                    .await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// Extends `worker`'s lease on a partition; `LeaseLost` if it is not (or no longer) its.
    pub async fn renew_partition(
        &self,
        round_id: &str,
        index: u32,
        worker: &str,
        lease: Duration,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker) = (round_id.to_string(), worker.to_string());
        self.write(move |tx| {
            Box::pin(async move {
                let leased = Leased::Partition {
                    round_id: &round_id,
                    index,
                };
                leased.check(&mut *tx, &worker).await?;
                leased.extend(&mut *tx, Millis(now), lease).await
            })
        })
        .await
    }

    /// Records where the partition's sealed result is stored (its lease holder only, once);
    /// when it is the job's last, the job's root becomes leasable and waiting workers are woken.
    pub async fn store_partition(
        &self,
        round_id: &str,
        index: u32,
        worker: &str,
        sealed_key: &str,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker, sealed_key) = (
            round_id.to_string(),
            worker.to_string(),
            sealed_key.to_string(),
        );
        let last = self
            .write(move |tx| {
                Box::pin(async move {
                    check_partition_lease(&mut *tx, &round_id, index, &worker).await?;
                    // The job's row first (locked on PostgreSQL): two partitions stored at once
                    // then count in turn, and the second sees the first, so the last announces.
                    let lock = format!(
                        "SELECT round_id FROM aggregation_jobs WHERE round_id = $1{}",
                        super::lock_clause(tx, " FOR UPDATE")
                    );
                    sqlx::query(sqlx::AssertSqlSafe(lock))
                        .bind(&round_id)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(
                        "UPDATE job_partitions SET sealed_key = $1, lease_owner = NULL, \
                         lease_expires_at = NULL, updated_at = $2 \
                         WHERE round_id = $3 AND partition_index = $4",
                    )
                    .bind(&sealed_key)
                    .bind(now)
                    .bind(&round_id)
                    .bind(i64::from(index))
                    .execute(&mut *tx)
                    .await?;
                    let open: i64 = sqlx::query_scalar(
                        "SELECT COUNT(*) FROM job_partitions \
                         WHERE round_id = $1 AND sealed_key IS NULL",
                    )
                    .bind(&round_id)
                    .fetch_one(&mut *tx)
                    .await?;
                    Ok(open == 0)
                })
            })
            .await?;
        if last {
            self.announce_job().await;
        }
        Ok(())
    }

    /// A partition's worker gives it back: transient (the partition is leased again after the
    /// job's backoff) or permanent (the round and task fail, as for the job).
    pub async fn fail_partition(
        &self,
        round_id: &str,
        index: u32,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker, reason) = (
            round_id.to_string(),
            worker.to_string(),
            super::jobs::bounded_reason(reason),
        );
        self.write(move |tx| {
            Box::pin(async move {
                check_partition_lease(&mut *tx, &round_id, index, &worker).await?;
                sqlx::query(
                    "UPDATE job_partitions SET lease_owner = NULL, lease_expires_at = NULL, \
                     updated_at = $1 WHERE round_id = $2 AND partition_index = $3",
                )
                .bind(now)
                .bind(&round_id)
                .bind(i64::from(index))
                .execute(&mut *tx)
                .await?;
                fail_leased(&mut *tx, &round_id, &reason, permanent, Millis(now)).await
            })
        })
        .await
    }

    /// The job's partitions, by index (none for a job not partitioned).
    pub async fn partitions(&self, round_id: &str) -> Result<Vec<StoredPartition>, DbError> {
        let rows: Vec<PartitionRow> = sqlx::query_as(
            "SELECT partition_index, partition_count, sealed_key, lease_owner FROM job_partitions \
             WHERE round_id = $1 ORDER BY partition_index",
        )
        .bind(round_id)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(stored).collect()
    }

    /// The partitions of a task's round `round` (its latest attempt's), by index.
    pub async fn round_partitions(
        &self,
        task_id: &str,
        round: i64,
    ) -> Result<Vec<StoredPartition>, DbError> {
        let rows: Vec<PartitionRow> = sqlx::query_as(
            "SELECT p.partition_index, p.partition_count, p.sealed_key, p.lease_owner \
             FROM job_partitions p JOIN rounds r ON r.id = p.round_id \
             WHERE r.task_id = $1 AND r.round_number = $2 AND r.attempt = \
               (SELECT MAX(attempt) FROM rounds WHERE task_id = $1 AND round_number = $2) \
             ORDER BY p.partition_index",
        )
        .bind(task_id)
        .bind(round)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter().map(stored).collect()
    }
}
