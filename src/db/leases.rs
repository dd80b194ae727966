//! Leases on aggregation jobs and their partitions, in one place: who holds one, when a worker
//! may take one back before it expires, the fencing check every write under a lease makes, and
//! how a lease is extended (docs/architecture.md, "Aggregation: jobs, workers, releases"). Jobs
//! and partitions differ only in their table, their key and what makes one leasable (a job's
//! backoff; a partition's job pending and its result not stored yet): the queries that choose a
//! job or a partition to lease are in `jobs.rs` and `partitions.rs`, with the same `LeaseAsk`.
//!
//! A lease's holder is `<worker>~<arrived><token>`. `arrived` is when the lease request that
//! wrote it arrived (Unix ms, 16 decimal digits) and `token` 12 random hex digits. Every write
//! under a lease names its holder, and every lease writes a new one (a fencing token): whatever
//! an earlier holder still sends is refused as a lost lease.
//!
//! A worker runs one job at a time and asks for a lease only when it holds none, so a lease still
//! held under its name is one it lost track of (a restart, a failure it could not record, a lease
//! answer that never reached it). It takes such a lease back at once:
//! - one held by another incarnation of its name (`name/other` when it is `name/this`): its
//!   process before a restart;
//! - one held under its own id and written by a lease request that arrived no later than this
//!   one. A request that outlived its client (a long poll the worker gave up on, still being
//!   served here or on another replica) is older than the worker's retry, so it cannot take back
//!   the lease the retry got.

use std::time::Duration;

use super::{Conn, DbError};
use crate::clock::Millis;
use crate::states::JobState;

/// Separates a worker id from the rest of its lease's holder; no worker id contains it
/// (`confed::api::workers` checks the ids it accepts).
pub const HOLDER_SEPARATOR: char = '~';

/// One lease request: the holder it writes if it gets a lease, and which leases it may take back.
#[derive(Debug, Clone)]
pub(crate) struct LeaseAsk {
    pub holder: String,
    /// `name/` of a worker `name/incarnation`, else empty: other incarnations' leases.
    pub other_incarnations: String,
    /// `<worker>~`: the leases this worker id holds.
    pub own: String,
    /// When this request arrived, as the holder spells it (16 decimal digits).
    pub arrived: String,
}

impl LeaseAsk {
    pub(crate) fn new(worker: &str, arrived_ms: i64) -> Self {
        let own = format!("{worker}{HOLDER_SEPARATOR}");
        let arrived = format!("{:016}", arrived_ms.max(0));
        let token = uuid::Uuid::new_v4().simple().to_string();
        Self {
            holder: format!("{own}{arrived}{}", &token[..12]),
            other_incarnations: worker
                .split_once('/')
                .map(|(name, _)| format!("{name}/"))
                .unwrap_or_default(),
            own,
            arrived,
        }
    }

    /// The SQL condition under which this request takes back the lease of a row whose columns
    /// are prefixed `p` (e.g. `p.`), before it expired: `limit` (the row's bound on immediate
    /// takebacks) holds, and the lease is another incarnation's, or this worker's from a request
    /// that arrived no later than this one. `$other`, `$own` and `$arrived` are the parameter
    /// numbers `other_incarnations`, `own` and `arrived` are bound to. Equal-length strings of
    /// digits compare alike under any collation, on SQLite and PostgreSQL.
    pub(crate) fn reclaimable_sql(p: &str, limit: &str, other: u8, own: u8, arrived: u8) -> String {
        format!(
            "({limit} AND ((length(${other}) > 0 \
               AND substr({p}lease_owner, 1, length(${other})) = ${other} \
               AND substr({p}lease_owner, 1, length(${own})) <> ${own}) \
             OR (substr({p}lease_owner, 1, length(${own})) = ${own} \
               AND substr({p}lease_owner, length(${own}) + 1, 16) <= ${arrived})))"
        )
    }
}

/// When a lease of `lease` taken at `now` (Unix ms) expires, or `LeaseTooLong` if that is past
/// what the database records.
pub(super) fn expiry(now: Millis, lease: Duration) -> Result<i64, DbError> {
    let now = now.0;
    i64::try_from(lease.as_millis())
        .ok()
        .and_then(|ms| now.checked_add(ms))
        .ok_or(DbError::LeaseTooLong(lease))
}

/// What a worker leases: a round's aggregation job, or one partition of it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Leased<'a> {
    Job { round_id: &'a str },
    Partition { round_id: &'a str, index: u32 },
}

impl Leased<'_> {
    /// Fails with `LeaseLost` unless `worker` holds this lease, the job is pending and (for a
    /// partition) its result is not stored yet: fencing, so a worker whose lease was taken over
    /// can no longer write anything. Locked on PostgreSQL, so a takeover cannot slip in between
    /// this check and the caller's write.
    pub(super) async fn check(self, conn: &mut Conn, worker: &str) -> Result<(), DbError> {
        let (sql, index) = match self {
            Leased::Job { .. } => (
                format!(
                    "SELECT lease_owner, NULL, state FROM aggregation_jobs WHERE round_id = $1{}",
                    super::lock_clause(conn, " FOR UPDATE")
                ),
                None,
            ),
            Leased::Partition { index, .. } => (
                format!(
                    "SELECT p.lease_owner, p.sealed_key, j.state FROM job_partitions p \
                     JOIN aggregation_jobs j ON j.round_id = p.round_id \
                     WHERE p.round_id = $1 AND p.partition_index = $2{}",
                    super::lock_clause(conn, " FOR UPDATE OF p")
                ),
                Some(i64::from(index)),
            ),
        };
        let mut query = sqlx::query_as(sqlx::AssertSqlSafe(sql)).bind(self.round_id());
        if let Some(index) = index {
            query = query.bind(index);
        }
        let row: Option<(Option<String>, Option<String>, String)> =
            query.fetch_optional(&mut *conn).await?;
        match row {
            Some((Some(owner), None, state))
                if owner == worker && state == JobState::Pending.as_str() =>
            {
                Ok(())
            }
            Some(_) => Err(DbError::LeaseLost(self.to_string())),
            None => Err(DbError::NotFound {
                entity: self.entity(),
                id: self.to_string(),
            }),
        }
    }

    /// Extends this lease (the caller checked it) to `lease` from `now`.
    pub(super) async fn extend(
        self,
        conn: &mut Conn,
        now: Millis,
        lease: Duration,
    ) -> Result<(), DbError> {
        let now = now.0;
        let until = expiry(Millis(now), lease)?;
        let query = match self {
            Leased::Job { round_id } => sqlx::query(
                "UPDATE aggregation_jobs SET lease_expires_at = $1, updated_at = $2 \
                 WHERE round_id = $3",
            )
            .bind(until)
            .bind(now)
            .bind(round_id),
            Leased::Partition { round_id, index } => sqlx::query(
                "UPDATE job_partitions SET lease_expires_at = $1, updated_at = $2 \
                 WHERE round_id = $3 AND partition_index = $4",
            )
            .bind(until)
            .bind(now)
            .bind(round_id)
            .bind(i64::from(index)),
        };
        query.execute(&mut *conn).await?;
        Ok(())
    }

    fn round_id(&self) -> &str {
        match self {
            Leased::Job { round_id } | Leased::Partition { round_id, .. } => round_id,
        }
    }

    fn entity(&self) -> &'static str {
        match self {
            Leased::Job { .. } => "aggregation job",
            Leased::Partition { .. } => "job partition",
        }
    }
}

/// How errors name the lease: the job's round id, or `<round id> partition <index>`.
impl std::fmt::Display for Leased<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Leased::Job { round_id } => f.write_str(round_id),
            Leased::Partition { round_id, index } => write!(f, "{round_id} partition {index}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_names_the_worker_when_its_request_arrived_and_a_fresh_token() {
        let ask = LeaseAsk::new("enclave-a/7f3c", 1_796_473_657_123);
        assert_eq!(ask.other_incarnations, "enclave-a/");
        assert_eq!(ask.own, "enclave-a/7f3c~");
        let (worker, rest) = ask.holder.split_once(HOLDER_SEPARATOR).unwrap();
        assert_eq!(worker, "enclave-a/7f3c");
        assert_eq!(&rest[..16], "0001796473657123");
        assert_eq!(rest.len(), 28);
        assert_ne!(
            LeaseAsk::new("enclave-a/7f3c", 1).holder,
            LeaseAsk::new("enclave-a/7f3c", 1).holder
        );
        assert_eq!(LeaseAsk::new("solo", 5).other_incarnations, "");
    }
}
