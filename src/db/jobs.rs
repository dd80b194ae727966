//! Aggregation jobs: created with the round's move to AGGREGATING, leased by enclave workers,
//! committed in two steps (the release with AGGREGATING -> APPLYING, the next model with
//! APPLYING -> COMPLETED), each one transaction guarded by the lease.

use std::time::Duration;

use super::leases::{LeaseAsk, Leased, expiry};
use super::{Conn, Db, DbError, models, rounds, tasks, transition};
use crate::clock::Millis;
use crate::states::{JobState, RoundState, TaskState};

/// The one text of "create the job of the round that just closed" (in the transaction that
/// moved it to AGGREGATING), with the engine's placeholders for the round id and the time: the
/// sqlx paths and both engines' device stores use it.
pub(crate) fn create_job_sql(round_id: &str, now: &str) -> String {
    format!(
        "INSERT INTO aggregation_jobs (round_id, task_id, state, not_before, created_at, updated_at) \
         SELECT id, task_id, '{pending}', {now}, {now}, {now} FROM rounds WHERE id = {round_id}",
        pending = JobState::Pending.as_str()
    )
}

static CREATE_JOB: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| create_job_sql("$1", "$2"));
/// A pending job whose partitions (if it has any) are all stored: its root can run.
pub(super) const PARTITIONS_STORED: &str = "NOT EXISTS (SELECT 1 FROM job_partitions p \
     WHERE p.round_id = aggregation_jobs.round_id AND p.sealed_key IS NULL)";

/// The earliest of: a leasable job's retry time or lease expiry, and a partition's (under its
/// job's retry time). A job waiting for its partitions is not due by itself.
static NEXT_JOB_DUE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT MIN(due) FROM ( \
           SELECT CASE WHEN lease_expires_at IS NOT NULL AND lease_expires_at > not_before \
             THEN lease_expires_at ELSE not_before END AS due \
           FROM aggregation_jobs WHERE state = '{pending}' AND {PARTITIONS_STORED} \
           UNION ALL \
           SELECT CASE WHEN p.lease_expires_at IS NOT NULL AND p.lease_expires_at > j.not_before \
             THEN p.lease_expires_at ELSE j.not_before END AS due \
           FROM job_partitions p JOIN aggregation_jobs j ON j.round_id = p.round_id \
           WHERE j.state = '{pending}' AND p.sealed_key IS NULL) AS dues",
        pending = JobState::Pending.as_str()
    )
});
static FAILING_JOBS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT COUNT(*) FROM aggregation_jobs WHERE state = '{}' AND failures >= $1",
        JobState::Pending.as_str()
    )
});
/// A done job holds no lease (its state is set by `transition`, which records it).
const LEASE_GIVEN_UP: &str = "UPDATE aggregation_jobs SET lease_owner = NULL, \
     lease_expires_at = NULL WHERE round_id = $1";

/// Longest failure reason kept, in characters: it comes from the worker-token holder and is shown
/// to the task's partner (`failure_reason`).
pub const MAX_REASON_CHARS: usize = 1000;

/// `reason`, cut to `MAX_REASON_CHARS` characters (with an ellipsis when cut).
pub(super) fn bounded_reason(reason: &str) -> String {
    match reason.char_indices().nth(MAX_REASON_CHARS) {
        Some((end, _)) => format!("{}…", &reason[..end]),
        None => reason.to_string(),
    }
}

/// Transient failures after which a job is reported as failing (logged as an error, counted in
/// `confed_aggregation_jobs_failing`); it is still retried.
pub const ALERT_AFTER_FAILURES: i64 = 5;
/// Longest wait between retries of a transiently failing job.
pub const MAX_RETRY_BACKOFF_MS: i64 = 300_000;

/// How long a job waits after its `failures`-th transient failure: 2, 4, 8 ... s, at most 5 min.
pub fn retry_backoff_ms(failures: i64) -> i64 {
    (1000i64 << failures.clamp(1, 20)).min(MAX_RETRY_BACKOFF_MS)
}

/// A job a worker just leased.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedJob {
    pub round_id: String,
    /// What every later write under this lease names (`lease_holder`).
    pub holder: String,
    /// The job's plan as stored after this lease (`aggregation_jobs.partitions`): 1 for one job,
    /// else its partitions; `None` when it is not planned (a `LeasePlan::Later` lease of a job
    /// not planned yet, or after an operator's resume cleared the plan).
    pub plan: Option<u32>,
}

/// Whether a lease also plans a job not planned yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeasePlan {
    /// The caller plans it after the lease (`plan_job`): its rounds may be cut into partitions.
    Later,
    /// As one job (one worker aggregates it), in the lease's own transaction: for a deployment
    /// that never cuts a round, one commit fewer on every round's path.
    Whole,
}

/// Everything a worker needs to run a job, as stored.
#[derive(Debug, Clone)]
pub struct JobContext {
    pub task: tasks::TaskRecord,
    pub round: rounds::RoundRecord,
    pub key_id: Option<String>,
    pub model: models::ModelRecord,
    pub release: Option<ReleaseRecord>,
    /// The release of round `round - 1`, for tasks that clip adaptively (its manifest gives this
    /// round's clip norm) or run BLT noise (it names the state this round continues); `None`
    /// otherwise and for round 1.
    pub previous_release: Option<ReleaseRecord>,
}

/// A completed contribution as a job lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredContribution {
    pub assignment_ref: String,
    pub blob_key: String,
    /// Lowercase hex BLAKE3 of the bytes, for an upload through the server.
    pub blake3_hex: Option<String>,
}

/// A committed release of one round (read by column name: the `releases` table's columns).
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ReleaseRecord {
    pub round_id: String,
    pub task_id: String,
    pub round_number: i64,
    pub average_key: String,
    pub average_sha256: String,
    pub manifest_key: String,
    pub manifest_json: String,
    pub included: i64,
    pub excluded: i64,
    pub epsilon_spent: f64,
    pub created_at: i64,
    /// The release's proof of origin (`confed_attestation::release::ReleaseProof`, JSON).
    pub proof_json: Option<String>,
}

/// Inserts the job of a round that just moved to AGGREGATING (same transaction).
pub(crate) async fn create(conn: &mut Conn, round_id: &str, now: Millis) -> Result<(), DbError> {
    let now = now.0;
    sqlx::query(sqlx::AssertSqlSafe(CREATE_JOB.as_str()))
        .bind(round_id)
        .bind(now)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Fails with `LeaseLost` unless `worker` holds the job's lease (`Leased::check`).
pub(super) async fn check_lease(
    conn: &mut Conn,
    round_id: &str,
    worker: &str,
) -> Result<(), DbError> {
    Leased::Job { round_id }.check(conn, worker).await
}

pub(super) async fn load_release(
    conn: &mut Conn,
    round_id: &str,
) -> Result<Option<ReleaseRecord>, DbError> {
    Ok(sqlx::query_as(
        "SELECT round_id, task_id, round_number, average_key, average_sha256, manifest_key, \
         manifest_json, included, excluded, epsilon_spent, created_at, proof_json \
         FROM releases WHERE round_id = $1",
    )
    .bind(round_id)
    .fetch_optional(&mut *conn)
    .await?)
}

/// The release a worker asks to commit.
#[derive(Debug, Clone)]
pub struct NewRelease {
    pub average_key: String,
    pub average_sha256: String,
    pub manifest_key: String,
    pub manifest_json: String,
    pub included: i64,
    pub excluded: i64,
    pub epsilon_spent: f64,
    /// The proof the front end verified before committing (JSON).
    pub proof_json: String,
}

impl Db {
    /// Leases the oldest ready job (never leased, its lease expired, or one this worker lost
    /// track of: `lease_holder`), past its backoff, and with every partition stored if it was
    /// cut into any, for a request that arrived `now`. The answer's `holder` is what every later
    /// write names.
    pub async fn lease_job(
        &self,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<LeasedJob>, DbError> {
        self.lease_job_for(worker, self.now().0, lease).await
    }

    /// `lease_job_planning` that plans nothing (`LeasePlan::Later`).
    pub async fn lease_job_for(
        &self,
        worker: &str,
        arrived: i64,
        lease: Duration,
    ) -> Result<Option<LeasedJob>, DbError> {
        self.lease_job_planning(worker, arrived, lease, LeasePlan::Later)
            .await
    }

    /// `lease_job` for a request that arrived at `arrived` (a long poll asks again and again,
    /// and keeps the time it arrived); with `LeasePlan::Whole`, a job not planned yet is planned
    /// as one job in the same transaction.
    pub async fn lease_job_planning(
        &self,
        worker: &str,
        arrived: i64,
        lease: Duration,
        plan: LeasePlan,
    ) -> Result<Option<LeasedJob>, DbError> {
        let plan_whole: Option<i64> = (plan == LeasePlan::Whole).then_some(1);
        let now = self.now().0;
        let ask = LeaseAsk::new(worker, arrived);
        let until = expiry(Millis(now), lease)?;
        let taken = self
            .write(move |tx| {
                Box::pin(async move {
                    // The guard is repeated outside the subquery: the update is a compare-and-set.
                    // On PostgreSQL the candidate is also locked with SKIP LOCKED, so concurrent
                    // workers each get a different job instead of queueing on the same row.
                    // A lease this worker lost track of is taken back at once (`lease_holder`), while
                    // the job has had fewer than 4 leases more than failures: a job that keeps killing
                    // its worker then waits for its lease like any other, and does not hold every
                    // later round behind it.
                    let free = format!(
                        "(lease_expires_at IS NULL OR lease_expires_at <= $3 OR {})",
                        LeaseAsk::reclaimable_sql("", "attempts - failures < 4", 4, 5, 6)
                    );
                    let sql = format!(
                        "UPDATE aggregation_jobs SET lease_owner = $1, lease_expires_at = $2, \
                     attempts = attempts + 1, updated_at = $3, \
                     partitions = COALESCE(partitions, $7) \
                     WHERE round_id = (SELECT round_id FROM aggregation_jobs \
                       WHERE state = '{pending}' AND not_before <= $3 AND {free} \
                       AND {PARTITIONS_STORED} \
                       ORDER BY created_at, round_id LIMIT 1{}) \
                     AND state = '{pending}' AND {free} \
                     RETURNING round_id, partitions",
                        super::lock_clause(tx, " FOR UPDATE SKIP LOCKED"),
                        pending = JobState::Pending.as_str(),
                    );
                    let row: Option<(String, Option<i64>)> =
                        sqlx::query_as(sqlx::AssertSqlSafe(sql))
                            .bind(&ask.holder)
                            .bind(until)
                            .bind(now)
                            .bind(&ask.other_incarnations)
                            .bind(&ask.own)
                            .bind(&ask.arrived)
                            .bind(plan_whole)
                            .fetch_optional(&mut *tx)
                            .await?;
                    Ok(row.map(|(round_id, plan)| (round_id, ask.holder, plan)))
                })
            })
            .await?;
        // Checked after the commit: a corrupt plan fails this lease only, where failing the
        // transaction would leave the job first in line and block every job behind it.
        taken
            .map(|(round_id, holder, plan)| {
                Ok(LeasedJob {
                    round_id,
                    holder,
                    plan: plan.map(super::partitions::to_u32).transpose()?,
                })
            })
            .transpose()
    }

    /// When the next pending job becomes leasable (Unix ms): the earliest over pending jobs of
    /// its `not_before` (a failed attempt's retry) or, later, its current lease's expiry. `None`
    /// when no job is pending. What a waiting lease sleeps until.
    pub async fn next_job_due(&self) -> Result<Option<i64>, DbError> {
        Ok(
            sqlx::query_scalar::<_, Option<i64>>(sqlx::AssertSqlSafe(NEXT_JOB_DUE.as_str()))
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Pending jobs that failed transiently at least `failures` times in a row.
    pub async fn failing_jobs(&self, failures: i64) -> Result<i64, DbError> {
        Ok(
            sqlx::query_scalar(sqlx::AssertSqlSafe(FAILING_JOBS.as_str()))
                .bind(failures)
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Extends `worker`'s lease on a job; `LeaseLost` if another worker took it over.
    pub async fn renew_job(
        &self,
        round_id: &str,
        worker: &str,
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
                leased.extend(&mut *tx, Millis(now), lease).await
            })
        })
        .await
    }

    /// What a job is (read-only): its task, round, key, model and releases, but not its
    /// contributions (`job_contributions`), which only a lease hands out: every later write of
    /// the job reads its context again, and a round's listing grows with its contributions.
    pub async fn job_context(&self, round_id: &str) -> Result<JobContext, DbError> {
        let mut conn = self.pool().acquire().await?;
        let round = rounds::load_one(&mut conn, round_id).await?;
        let task = tasks::load_any(&mut conn, &round.task_id).await?;
        let key_id: Option<String> = sqlx::query_scalar("SELECT key_id FROM rounds WHERE id = $1")
            .bind(round_id)
            .fetch_one(&mut *conn)
            .await?;
        let base = task.spec.base_model_version(round.round_number);
        let model = models::load(&mut conn, &task.id, base).await?;
        let release = load_release(&mut conn, round_id).await?;
        let continues = task.spec.privacy.adaptive_clipping.is_some() || task.spec.privacy.is_blt();
        let previous_release = match continues {
            true if round.round_number > 1 => {
                let previous: Option<String> = sqlx::query_scalar(
                    "SELECT round_id FROM releases WHERE task_id = $1 AND round_number = $2",
                )
                .bind(&task.id)
                .bind(round.round_number - 1)
                .fetch_optional(&mut *conn)
                .await?;
                match previous {
                    Some(id) => load_release(&mut conn, &id).await?,
                    None => None,
                }
            }
            _ => None,
        };
        Ok(JobContext {
            task,
            round,
            key_id,
            model,
            release,
            previous_release,
        })
    }

    /// Records the round's release and moves it AGGREGATING -> APPLYING, in one transaction.
    /// The same release again is accepted (a retried commit); a different one is refused.
    pub async fn commit_release(
        &self,
        round_id: &str,
        worker: &str,
        release: NewRelease,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker) = (round_id.to_string(), worker.to_string());
        self.write(move |tx| {
            Box::pin(async move {
                // The same release again is accepted before the lease is looked at: an analytics
                // round completes (and gives its lease up) in the commit, so a worker retrying a
                // commit whose answer it lost must hear that it is done, not that it lost.
                if let Some(existing) = load_release(&mut *tx, &round_id).await? {
                    return if existing.average_sha256 == release.average_sha256 {
                        Ok(())
                    } else {
                        Err(DbError::AlreadyExists(format!(
                            "a different release of round {round_id}"
                        )))
                    };
                }
                check_lease(&mut *tx, &round_id, &worker).await?;
                let round = rounds::load_one(&mut *tx, &round_id).await?;
                let reason = format!(
                    "noised average released: {} contributions included, {} excluded",
                    release.included, release.excluded
                );
                transition(
                    &mut *tx,
                    &round_id,
                    RoundState::Aggregating,
                    RoundState::Applying,
                    &reason,
                    Millis(now),
                )
                .await?;
                sqlx::query(
                    "INSERT INTO releases (round_id, task_id, round_number, average_key, average_sha256, \
                     manifest_key, manifest_json, included, excluded, epsilon_spent, created_at, \
                     proof_json) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
                )
                .bind(&round_id)
                .bind(&round.task_id)
                .bind(round.round_number)
                .bind(&release.average_key)
                .bind(&release.average_sha256)
                .bind(&release.manifest_key)
                .bind(&release.manifest_json)
                .bind(release.included)
                .bind(release.excluded)
                .bind(release.epsilon_spent)
                .bind(now)
                .bind(&release.proof_json)
                .execute(&mut *tx)
                .await?;
                // An analytics round's release is its result: nothing to apply, so the round
                // completes (and the next opens) in the same transaction.
                let task = tasks::load_any(&mut *tx, &round.task_id).await?;
                if task.spec.analytics.is_some() {
                    let done = "result released (analytics: no model to apply)";
                    let version = round.round_number;
                    complete_round(&mut *tx, &round_id, &task, version, done, None, Millis(now))
                        .await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// Whether `worker` holds the lease of the job of `round_id` (`LeaseLost` otherwise).
    pub async fn check_job_lease(&self, round_id: &str, worker: &str) -> Result<(), DbError> {
        let mut conn = self.pool().acquire().await?;
        check_lease(&mut conn, round_id, worker).await
    }

    /// Records model version `round_number`, completes the round (APPLYING -> COMPLETED) and the
    /// job, and opens the next round or, after the last planned round or when `early_stop` (the
    /// task's early-stopping rule's verdict, `evaluation::early_stop_verdict`) gives a reason,
    /// completes the task.
    pub async fn commit_model(
        &self,
        round_id: &str,
        worker: &str,
        model: models::NewModel,
        early_stop: Option<String>,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker) = (round_id.to_string(), worker.to_string());
        self.write(move |tx| {
            Box::pin(async move {
                check_lease(&mut *tx, &round_id, &worker).await?;
                let round = rounds::load_one(&mut *tx, &round_id).await?;
                let task = tasks::load_any(&mut *tx, &round.task_id).await?;
                let version = round.round_number;
                models::insert(&mut *tx, &task.id, version, &model, Millis(now)).await?;
                sqlx::query("UPDATE tasks SET model_version = $1, updated_at = $2 WHERE id = $3")
                    .bind(version)
                    .bind(now)
                    .bind(&task.id)
                    .execute(&mut *tx)
                    .await?;
                let done = format!("model version {version} stored");
                complete_round(
                    &mut *tx,
                    &round_id,
                    &task,
                    version,
                    &done,
                    early_stop,
                    Millis(now),
                )
                .await
            })
        })
        .await
    }

    /// Gives a failed job back. A transient failure is retried after a backoff; a permanent one,
    /// or one out of attempts, fails the round and its task (the reason is in both histories).
    pub async fn fail_job(
        &self,
        round_id: &str,
        worker: &str,
        reason: &str,
        permanent: bool,
    ) -> Result<(), DbError> {
        let now = self.now().0;
        let (round_id, worker, reason) = (
            round_id.to_string(),
            worker.to_string(),
            bounded_reason(reason),
        );
        self.write(move |tx| {
            Box::pin(async move {
                check_lease(&mut *tx, &round_id, &worker).await?;
                fail_leased(&mut *tx, &round_id, &reason, permanent, Millis(now)).await
            })
        })
        .await
    }

    /// The committed releases of one tenant's task, by round.
    pub async fn releases(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<Vec<ReleaseRecord>, DbError> {
        let mut conn = self.pool().acquire().await?;
        tasks::load(&mut conn, tenant_id, task_id).await?;
        drop(conn);
        self.releases_of_task(task_id).await
    }

    /// The committed releases of any task, by round.
    pub async fn releases_of_task(&self, task_id: &str) -> Result<Vec<ReleaseRecord>, DbError> {
        let mut conn = self.pool().acquire().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT round_id FROM releases WHERE task_id = $1 ORDER BY round_number",
        )
        .bind(task_id)
        .fetch_all(&mut *conn)
        .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.extend(load_release(&mut conn, &id).await?);
        }
        Ok(out)
    }
}

/// Fails a job whose lease the caller checked (the job's, or one of its partitions'): a
/// transient failure waits for a retry (the job's backoff, whichever part of it failed), a
/// permanent one fails the round and the task.
pub(super) async fn fail_leased(
    tx: &mut Conn,
    round_id: &str,
    reason: &str,
    permanent: bool,
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    if !permanent {
        // Transient (a key service down, a full disk, the network): retried without
        // limit, the wait doubling up to 5 minutes; a crash takeover is no failure.
        let failures: i64 = sqlx::query_scalar(
            "UPDATE aggregation_jobs SET failures = failures + 1, lease_owner = NULL, \
             lease_expires_at = NULL, last_error = $1, updated_at = $2 \
             WHERE round_id = $3 RETURNING failures",
        )
        .bind(reason)
        .bind(now)
        .bind(round_id)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query("UPDATE aggregation_jobs SET not_before = $1 WHERE round_id = $2")
            .bind(now + retry_backoff_ms(failures))
            .bind(round_id)
            .execute(&mut *tx)
            .await?;
        if failures >= ALERT_AFTER_FAILURES {
            tracing::error!(round = %round_id, failures, %reason,
                "an aggregation job keeps failing; it is retried every few minutes \
                 until the cause is fixed (docs/operations.md, \"Failed rounds\")");
        }
        return Ok(());
    }
    // The round first, as in commit_model: its row's lock orders this against a concurrent
    // cancel or resume, whose history rows share the round's id with the job's.
    let round = rounds::load_one(&mut *tx, round_id).await?;
    let why = format!("aggregation failed: {reason}");
    rounds::close(
        &mut *tx,
        round_id,
        round.state,
        RoundState::Failed,
        &why,
        Millis(now),
    )
    .await?;
    transition(
        &mut *tx,
        round_id,
        JobState::Pending,
        JobState::Failed,
        reason,
        Millis(now),
    )
    .await?;
    sqlx::query(
        "UPDATE aggregation_jobs SET lease_owner = NULL, lease_expires_at = NULL, \
         last_error = $1 WHERE round_id = $2",
    )
    .bind(reason)
    .bind(round_id)
    .execute(&mut *tx)
    .await?;
    let task = tasks::load_any(&mut *tx, &round.task_id).await?;
    if task.state == TaskState::Open {
        let why = format!("round {} {why}", round.round_number);
        transition(
            &mut *tx,
            &task.id,
            TaskState::Open,
            TaskState::Failed,
            &why,
            Millis(now),
        )
        .await?;
    }
    Ok(())
}

/// Completes round `version` of `task` (APPLYING -> COMPLETED) and its job, gives up the lease,
/// and opens the next round or, after the last planned round or when `early_stop` gives a
/// reason, completes the task: what a committed model does for training, and a committed
/// release for analytics (which has no model to wait for).
async fn complete_round(
    tx: &mut Conn,
    round_id: &str,
    task: &tasks::TaskRecord,
    version: i64,
    done: &str,
    early_stop: Option<String>,
    now: Millis,
) -> Result<(), DbError> {
    rounds::close(
        &mut *tx,
        round_id,
        RoundState::Applying,
        RoundState::Completed,
        done,
        now,
    )
    .await?;
    transition(
        &mut *tx,
        round_id,
        JobState::Pending,
        JobState::Done,
        done,
        now,
    )
    .await?;
    sqlx::query(LEASE_GIVEN_UP)
        .bind(round_id)
        .execute(&mut *tx)
        .await?;
    if task.state != TaskState::Open {
        return Ok(());
    }
    let more_rounds = version < i64::from(task.spec.rounds);
    if more_rounds && let Some(reason) = early_stop {
        return transition(
            &mut *tx,
            &task.id,
            TaskState::Open,
            TaskState::Completed,
            &reason,
            now,
        )
        .await;
    }
    if more_rounds {
        sqlx::query("UPDATE tasks SET current_round = $1 WHERE id = $2")
            .bind(version + 1)
            .bind(&task.id)
            .execute(&mut *tx)
            .await?;
        rounds::open(&mut *tx, task, version + 1, 1, now).await?;
        Ok(())
    } else {
        transition(
            &mut *tx,
            &task.id,
            TaskState::Open,
            TaskState::Completed,
            &format!("all {version} rounds completed"),
            now,
        )
        .await
    }
}
