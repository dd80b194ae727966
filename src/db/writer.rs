//! Group commit for SQLite. SQLite has one writer and, with `synchronous = FULL`, one fsync per
//! commit, which caps durable writes at the disk's fsync rate no matter how many requests wait.
//! Here every write is a job sent to one writer task, which runs all jobs waiting at that moment
//! in one transaction, each inside its own SAVEPOINT (a failing job rolls back alone), commits
//! once, and only then answers each job. A job's caller hears "done" only after the commit that
//! includes it is on disk: the durability promise is unchanged, the fsync is shared.
//!
//! Jobs come in two kinds. Async jobs use sqlx, where every statement is a round trip to the
//! connection's worker thread. Raw jobs (the device hot paths) run synchronously on the same
//! connection's raw handle through rusqlite, while sqlx's worker is locked out: a batch's raw jobs
//! cost one hand-over in total instead of a few per job. A raw job may end in a `Continuation`
//! (a rare path that needs the async API), which runs in the same savepoint.
//!
//! The fsync also runs beside the next batch instead of before it: the writer connection commits
//! with `synchronous = NORMAL` (SQLite writes the WAL frames but does not fsync them at commit),
//! and a sync thread `fdatasync`s the WAL file and only then answers the jobs of every batch
//! committed before that call. WAL frames are appended in commit order, so one fsync makes every
//! earlier commit durable; SQLite itself still syncs the WAL before each checkpoint and the
//! database after it. Nothing is acknowledged before it is on disk.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use sqlx::{Connection, SqliteConnection};
use tokio::sync::{mpsc, oneshot};

use super::DbError;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Called after the batch's commit is durable, with the commit's error if it failed.
type Completion = Box<dyn FnOnce(Option<&str>) + Send>;

/// An async job over sqlx (any statement, any logic; each sqlx call is a round trip to the
/// connection's worker thread).
type AsyncJob =
    Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, (bool, Completion)> + Send>;

/// A job's synchronous fast path, run on the raw SQLite handle with no thread hop: done, or
/// (rarely) a continuation that needs the async API, run in the same savepoint.
pub enum Raw<T> {
    Done(T),
    Continue(Continuation<T>),
}

/// The async rest of a raw job.
pub type Continuation<T> =
    Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, DbError>> + Send>;

enum RawErased {
    Done(bool, Completion),
    Continue(AsyncJob),
}

type RawJob = Box<dyn FnOnce(&rusqlite::Connection) -> RawErased + Send>;

enum Job {
    Async(AsyncJob),
    Raw(RawJob),
}

/// Most jobs in one transaction.
const MAX_BATCH: usize = 256;
const QUEUE: usize = 4096;

#[derive(Debug, Clone)]
pub struct Writer {
    jobs: mpsc::Sender<Job>,
}

/// The caller's answer channel, as a completion that reports the job's outcome once the commit
/// is durable (or why it is not).
fn completion<T: Send + 'static>(
    outcome: Result<T, DbError>,
    answer: oneshot::Sender<Result<T, DbError>>,
) -> (bool, Completion) {
    let ok = outcome.is_ok();
    let completion: Completion = Box::new(move |commit_error| {
        let _ = answer.send(match (outcome, commit_error) {
            (Ok(value), None) => Ok(value),
            (Ok(_), Some(e)) => Err(DbError::Commit(e.to_string())),
            (Err(e), _) => Err(e),
        });
    });
    (ok, completion)
}

impl Writer {
    /// Starts the writer task on `connection` (opened with `synchronous = NORMAL`), which it
    /// owns from now on, and the sync thread for the WAL file at `wal`.
    pub fn start(connection: SqliteConnection, wal: PathBuf) -> Self {
        let (jobs, receiver) = mpsc::channel(QUEUE);
        let (synced, to_sync) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("confed-wal-sync".into())
            .spawn(move || sync_loop(wal, to_sync))
            .expect("starting the WAL sync thread");
        tokio::spawn(run(connection, receiver, synced));
        Self { jobs }
    }

    async fn submit<T>(
        &self,
        job: Job,
        result: oneshot::Receiver<Result<T, DbError>>,
    ) -> Result<T, DbError> {
        self.jobs
            .send(job)
            .await
            .map_err(|_| DbError::Commit("the database writer has stopped".into()))?;
        result
            .await
            .map_err(|_| DbError::Commit("the database writer dropped a job".into()))?
    }

    /// Runs `job` in the next batch; returns its result once the batch's commit is durable.
    pub async fn write<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, DbError>>
            + Send
            + 'static,
    {
        let (answer, result) = oneshot::channel();
        let wrapped: AsyncJob =
            Box::new(move |conn| Box::pin(async move { completion(job(conn).await, answer) }));
        self.submit(Job::Async(wrapped), result).await
    }

    /// Runs `job` on the raw SQLite handle in the next batch (the hot paths: no round trip per
    /// statement); a `Raw::Continue` finishes with the async API in the same savepoint.
    pub async fn write_raw<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> Result<Raw<T>, DbError> + Send + 'static,
    {
        let (answer, result) = oneshot::channel();
        let wrapped: RawJob = Box::new(move |conn| match job(conn) {
            Ok(Raw::Done(value)) => {
                let (ok, done) = completion(Ok(value), answer);
                RawErased::Done(ok, done)
            }
            Err(error) => {
                let (ok, done) = completion::<T>(Err(error), answer);
                RawErased::Done(ok, done)
            }
            Ok(Raw::Continue(rest)) => RawErased::Continue(Box::new(move |conn| {
                Box::pin(async move { completion(rest(conn).await, answer) })
            })),
        });
        self.submit(Job::Raw(wrapped), result).await
    }
}

/// Runs one or more `;`-separated statements in one round trip to the SQLite worker.
async fn exec(conn: &mut SqliteConnection, sql: &'static str) -> Result<(), String> {
    sqlx::raw_sql(sql)
        .execute(&mut *conn)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// What ends one job's savepoint.
fn end_job(ok: bool) -> &'static str {
    if ok {
        "RELEASE job"
    } else {
        "ROLLBACK TO job; RELEASE job"
    }
}

/// A committed batch waiting for its fsync: its completions and the commit's error, if any.
type Committed = (Vec<Completion>, Option<String>);

/// Answers committed batches after an `fdatasync` of the WAL that covers them. Batches that
/// arrive while one fsync runs share the next.
fn sync_loop(wal: PathBuf, batches: std::sync::mpsc::Receiver<Committed>) {
    let mut file: Option<std::fs::File> = None;
    while let Ok(first) = batches.recv() {
        let mut ready = vec![first];
        ready.extend(batches.try_iter());
        let needs_sync = ready.iter().any(|(_, error)| error.is_none());
        let sync_error = if needs_sync {
            sync(&wal, &mut file).err()
        } else {
            None
        };
        if let Some(error) = &sync_error {
            tracing::error!(%error, "fsync of the WAL failed; the jobs of these batches are refused");
        }
        for (completions, commit_error) in ready {
            let error = commit_error.or_else(|| sync_error.clone());
            for completion in completions {
                completion(error.as_deref());
            }
        }
    }
}

fn sync(wal: &std::path::Path, file: &mut Option<std::fs::File>) -> Result<(), String> {
    if file.is_none() {
        *file =
            Some(std::fs::File::open(wal).map_err(|e| format!("opening {}: {e}", wal.display()))?);
    }
    file.as_ref()
        .map(std::fs::File::sync_data)
        .transpose()
        .map(drop)
        .map_err(|e| format!("fsync of {}: {e}", wal.display()))
}

/// Raw jobs run first, as many as possible in one hold of the connection's handle; async jobs
/// (and raw jobs' continuations) then run through sqlx. Order inside a batch does not matter:
/// its jobs were concurrent requests.
async fn run(
    mut conn: SqliteConnection,
    mut jobs: mpsc::Receiver<Job>,
    synced: std::sync::mpsc::Sender<Committed>,
) {
    while let Some(first) = jobs.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let size = batch.len();
        let (raw, asyncs): (Vec<Job>, Vec<Job>) =
            batch.into_iter().partition(|j| matches!(j, Job::Raw(_)));
        let mut raw: std::collections::VecDeque<RawJob> = raw
            .into_iter()
            .filter_map(|j| match j {
                Job::Raw(r) => Some(r),
                Job::Async(_) => None,
            })
            .collect();
        let mut completions = Vec::with_capacity(size);
        let mut failure = None;
        let mut began = false;
        // `Some(error or none)` once the raw path committed the batch itself.
        let mut committed: Option<Option<String>> = None;
        while failure.is_none() && committed.is_none() && !raw.is_empty() {
            // Hold the handle for every raw job up to the first continuation; a batch without
            // async work begins and commits on the handle too: one hand-over in all.
            let ends_batch = asyncs.is_empty();
            match run_raw(&mut conn, &mut raw, &mut completions, !began, ends_batch).await {
                Err(error) => failure = Some(error),
                Ok(segment) => {
                    began = true;
                    committed = segment.committed;
                    if let Some(rest) = segment.continuation {
                        let (ok, done) = rest(&mut conn).await;
                        if let Err(e) = exec(&mut conn, end_job(ok)).await {
                            failure = Some(e);
                        }
                        completions.push(done);
                    }
                }
            }
        }
        if !began && failure.is_none() {
            failure = exec(&mut conn, "BEGIN IMMEDIATE").await.err();
        }
        for job in asyncs {
            let Job::Async(job) = job else { continue };
            if failure.is_some() {
                // The transaction or a savepoint failed: the rest of the batch does not run, and
                // dropping a job tells its caller so.
                continue;
            }
            if let Err(e) = exec(&mut conn, "SAVEPOINT job").await {
                failure = Some(e);
                continue;
            }
            let (ok, done) = job(&mut conn).await;
            if let Err(e) = exec(&mut conn, end_job(ok)).await {
                failure = Some(e);
            }
            completions.push(done);
        }
        let commit_error = match (committed, failure) {
            (Some(outcome), None) => outcome,
            (None, None) => exec(&mut conn, "COMMIT").await.err(),
            (_, Some(error)) => {
                let _ = exec(&mut conn, "ROLLBACK").await;
                Some(error)
            }
        };
        if let Some(error) = &commit_error {
            tracing::error!(%error, jobs = size, "database batch failed; every job in it is refused");
        }
        metrics::histogram!("confed_db_batch_jobs").record(size as f64);
        if let Err(std::sync::mpsc::SendError((completions, error))) =
            synced.send((completions, commit_error))
        {
            let error = error.unwrap_or_else(|| "the WAL sync thread has stopped".into());
            for completion in completions {
                completion(Some(&error));
            }
        }
    }
    let _ = conn.close().await;
}

/// What one hold of the raw handle did.
struct Segment {
    /// A raw job's async rest, its savepoint still open.
    continuation: Option<AsyncJob>,
    /// The batch was committed on the handle (with the commit's error, if any).
    committed: Option<Option<String>>,
}

/// Runs raw jobs on the connection's raw handle, each in its own savepoint, until they are all
/// done or one needs to continue through sqlx. With `begin`, the batch's transaction starts here;
/// with `commit`, a segment that runs every remaining raw job also commits it.
async fn run_raw(
    conn: &mut SqliteConnection,
    raw: &mut std::collections::VecDeque<RawJob>,
    completions: &mut Vec<Completion>,
    begin: bool,
    commit: bool,
) -> Result<Segment, String> {
    let mut locked = conn.lock_handle().await.map_err(|e| e.to_string())?;
    // SAFETY: the handle is a live `sqlite3*` that sqlx's worker does not touch while `locked`
    // is held; the rusqlite wrapper does not close it on drop and is dropped before `locked`.
    let handle = unsafe { rusqlite::Connection::from_handle(locked.as_raw_handle().as_ptr()) }
        .map_err(|e| e.to_string())?;
    let sql = |statement: &str| handle.execute_batch(statement).map_err(|e| e.to_string());
    if begin {
        sql("BEGIN IMMEDIATE")?;
    }
    let mut segment = Segment {
        continuation: None,
        committed: None,
    };
    while let Some(job) = raw.pop_front() {
        sql("SAVEPOINT job")?;
        match job(&handle) {
            RawErased::Done(ok, done) => {
                sql(end_job(ok))?;
                completions.push(done);
            }
            RawErased::Continue(rest) => {
                segment.continuation = Some(rest);
                break;
            }
        }
    }
    if commit && segment.continuation.is_none() {
        let outcome = sql("COMMIT").err();
        if outcome.is_some() {
            let _ = sql("ROLLBACK");
        }
        segment.committed = Some(outcome);
    }
    drop(handle);
    drop(locked);
    Ok(segment)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::ConnectOptions;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};

    async fn connection(dir: &std::path::Path) -> SqliteConnection {
        SqliteConnectOptions::new()
            .filename(dir.join("t.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .connect()
            .await
            .unwrap()
    }

    fn insert(
        value: i64,
    ) -> impl for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<(), DbError>>
    + Send
    + 'static {
        move |conn| {
            Box::pin(async move {
                sqlx::query("INSERT INTO t (v) VALUES ($1)")
                    .bind(value)
                    .execute(&mut *conn)
                    .await?;
                Ok(())
            })
        }
    }

    #[tokio::test]
    async fn writes_are_answered_once_the_wal_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connection(dir.path()).await;
        sqlx::raw_sql("CREATE TABLE t (v BIGINT)")
            .execute(&mut conn)
            .await
            .unwrap();
        let writer = Writer::start(conn, dir.path().join("t.db-wal"));
        writer.write(insert(1)).await.unwrap();
        writer.write(insert(2)).await.unwrap();
    }

    fn count(dir: &std::path::Path) -> i64 {
        let c = rusqlite::Connection::open(dir.join("t.db")).unwrap();
        c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
            .unwrap()
    }

    #[tokio::test]
    async fn raw_jobs_commit_roll_back_alone_and_continue_through_sqlx() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connection(dir.path()).await;
        sqlx::raw_sql("CREATE TABLE t (v BIGINT)")
            .execute(&mut conn)
            .await
            .unwrap();
        let writer = Writer::start(conn, dir.path().join("t.db-wal"));
        let done = writer.write_raw(|c| {
            c.execute("INSERT INTO t (v) VALUES (1)", [])?;
            Ok(Raw::Done(7))
        });
        let failed = writer.write_raw(|c| -> Result<Raw<()>, DbError> {
            c.execute("INSERT INTO t (v) VALUES (2)", [])?;
            Err(DbError::Corrupt("refused after writing".into()))
        });
        let continued = writer.write_raw(|c| {
            c.execute("INSERT INTO t (v) VALUES (3)", [])?;
            let rest: Continuation<i64> = Box::new(|conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO t (v) VALUES (4)")
                        .execute(&mut *conn)
                        .await?;
                    Ok(4)
                })
            });
            Ok(Raw::Continue(rest))
        });
        let (done, failed, continued) = tokio::join!(done, failed, continued);
        assert_eq!(done.unwrap(), 7);
        assert!(matches!(failed, Err(DbError::Corrupt(_))));
        assert_eq!(continued.unwrap(), 4);
        // 1, 3 and 4 stayed; the failed job's 2 was rolled back with its savepoint.
        assert_eq!(count(dir.path()), 3);
    }

    #[tokio::test]
    async fn a_batch_of_raw_jobs_begins_and_commits_on_the_handle() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connection(dir.path()).await;
        sqlx::raw_sql("CREATE TABLE t (v BIGINT)")
            .execute(&mut conn)
            .await
            .unwrap();
        let writer = Writer::start(conn, dir.path().join("t.db-wal"));
        let jobs = (0..20).map(|v| {
            writer.write_raw(move |c| {
                c.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
                Ok(Raw::Done(()))
            })
        });
        for result in futures_util::future::join_all(jobs).await {
            result.unwrap();
        }
        assert_eq!(count(dir.path()), 20);
        // And the connection is usable by sqlx afterwards (no transaction left open).
        writer.write(insert(99)).await.unwrap();
        assert_eq!(count(dir.path()), 21);
    }

    /// If the WAL cannot be synced, nothing is acknowledged: every job of the batch is refused.
    #[tokio::test]
    async fn a_failed_wal_sync_refuses_the_jobs_instead_of_acknowledging_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = connection(dir.path()).await;
        sqlx::raw_sql("CREATE TABLE t (v BIGINT)")
            .execute(&mut conn)
            .await
            .unwrap();
        let writer = Writer::start(conn, dir.path().join("missing-dir").join("t.db-wal"));
        let error = writer.write(insert(1)).await.unwrap_err();
        assert!(
            matches!(&error, DbError::Commit(m) if m.contains("missing-dir")),
            "{error}"
        );
    }
}
