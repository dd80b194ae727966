//! Group commit for SQLite. SQLite has one writer and, with `synchronous = FULL`, one fsync per
//! commit, which caps durable writes at the disk's fsync rate no matter how many requests wait.
//! Here every write is a job sent to one writer, which runs all jobs waiting at that moment
//! together, each inside its own SAVEPOINT (a failing job rolls back alone), commits, and only
//! then answers each job. A job's caller hears "done" only after the commit that includes it is
//! on disk: the durability promise is unchanged, the fsync is shared.
//!
//! Jobs come in two kinds. Raw jobs (the device store, `sqlite/device.rs`) run synchronously
//! through rusqlite on the writer's own connection, on the writer's own thread: no thread hop per
//! statement, and each job whole in its savepoint. Async jobs (every other write, in SQL shared
//! with PostgreSQL) use sqlx, every statement a round trip to sqlx's worker thread, on a second
//! connection. A batch commits its raw jobs in one transaction, then its async jobs in another;
//! only one of the two connections writes at any time.
//!
//! The fsync runs beside the next batch instead of before it: both connections commit with
//! `synchronous = NORMAL` (SQLite writes the WAL frames but does not fsync them at commit), and a
//! sync thread `fdatasync`s the WAL file and only then answers the jobs of every batch committed
//! before that call. WAL frames are appended in commit order, so one fsync makes every earlier
//! commit durable. Checkpoints run on a thread of their own (`wal_autocheckpoint = 0` on the
//! writer's connections), never inside a commit. Nothing is acknowledged before it is on disk.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use sqlx::Connection;

use super::Conn;
use tokio::sync::{mpsc, oneshot};

use super::{CommitCause, CommitFailure, DbError};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Called after the batch's commit is durable, with the commit's error if it failed.
type Completion = Box<dyn FnOnce(Option<&CommitFailure>) + Send>;

/// An async job over sqlx (any statement, any logic; each sqlx call is a round trip to the
/// connection's worker thread).
type AsyncJob = Box<dyn for<'c> FnOnce(&'c mut Conn) -> BoxFuture<'c, (bool, Completion)> + Send>;

/// A synchronous job on the writer's rusqlite connection: whether it succeeded (its savepoint is
/// released, else rolled back) and how to answer its caller.
type RawJob = Box<dyn FnOnce(&rusqlite::Connection) -> (bool, Completion) + Send>;

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
    /// Successful syncs of the WAL, counted before the jobs they cover are answered.
    wal_syncs: std::sync::Arc<std::sync::atomic::AtomicU64>,
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
            (Ok(_), Some(failure)) => Err(DbError::Commit(failure.clone())),
            (Err(e), _) => Err(e),
        });
    });
    (ok, completion)
}

impl Writer {
    /// Starts the writer on its own thread with its two connections to `database` (both opened
    /// with `synchronous = NORMAL` and `wal_autocheckpoint = 0`), the WAL sync thread and the
    /// checkpoint thread.
    pub fn start(connection: Conn, raw: rusqlite::Connection, database: PathBuf) -> Self {
        let (jobs, receiver) = mpsc::channel(QUEUE);
        let (synced, to_sync) = std::sync::mpsc::channel();
        let (checkpoint, checkpoints) = std::sync::mpsc::sync_channel(1);
        let mut wal = database.as_os_str().to_owned();
        wal.push("-wal");
        let wal = PathBuf::from(wal);
        let wal_syncs = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = wal_syncs.clone();
        std::thread::Builder::new()
            .name("confed-wal-sync".into())
            .spawn(move || sync_loop(wal, to_sync, checkpoint, &counted))
            .expect("starting the WAL sync thread");
        std::thread::Builder::new()
            .name("confed-wal-checkpoint".into())
            .spawn(move || checkpoint_loop(database, checkpoints))
            .expect("starting the WAL checkpoint thread");
        // Its own thread: raw jobs are CPU work that would otherwise hold up request handling on
        // the shared async workers, and be held up by it.
        std::thread::Builder::new()
            .name("confed-db-writer".into())
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(run(connection, raw, receiver, synced)),
                    Err(error) => tracing::error!(%error, "cannot start the database writer"),
                }
            })
            .expect("starting the database writer thread");
        Self { jobs, wal_syncs }
    }

    /// Successful WAL syncs so far.
    pub fn wal_syncs(&self) -> u64 {
        self.wal_syncs.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn submit<T>(
        &self,
        job: Job,
        result: oneshot::Receiver<Result<T, DbError>>,
    ) -> Result<T, DbError> {
        self.jobs.send(job).await.map_err(|_| {
            DbError::Commit(CommitFailure::new(
                CommitCause::Stopped,
                "the database writer has stopped",
            ))
        })?;
        result.await.map_err(|_| {
            DbError::Commit(CommitFailure::new(
                CommitCause::Stopped,
                "the database writer dropped a job",
            ))
        })?
    }

    /// Runs `job` in the next batch; returns its result once the batch's commit is durable.
    pub async fn write<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut Conn) -> BoxFuture<'c, Result<T, DbError>> + Send + 'static,
    {
        let (answer, result) = oneshot::channel();
        let wrapped: AsyncJob =
            Box::new(move |conn| Box::pin(async move { completion(job(conn).await, answer) }));
        self.submit(Job::Async(wrapped), result).await
    }

    /// Runs `job` on the writer's rusqlite connection in the next batch, whole in its own
    /// savepoint (the device store: no round trip per statement).
    pub async fn write_raw<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> Result<T, DbError> + Send + 'static,
    {
        let (answer, result) = oneshot::channel();
        let wrapped: RawJob = Box::new(move |conn| completion(job(conn), answer));
        self.submit(Job::Raw(wrapped), result).await
    }
}

/// Runs one or more `;`-separated statements in one round trip to the SQLite worker.
async fn exec(conn: &mut Conn, sql: &'static str) -> Result<(), CommitFailure> {
    sqlx::raw_sql(sql)
        .execute(&mut *conn)
        .await
        .map(|_| ())
        .map_err(|e| CommitFailure::of(DbError::Sqlx(e)))
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
type Committed = (Vec<Completion>, Option<CommitFailure>);

/// Answers committed batches after an `fdatasync` of the WAL that covers them. Batches that
/// arrive while one fsync runs share the next.
/// The WAL size past which the checkpoint thread copies it into the database.
const CHECKPOINT_BYTES: u64 = 64 << 20;

/// The writer connections' settings: commits made durable by the sync thread, checkpoints by
/// the checkpoint thread, and the WAL cut back to `CHECKPOINT_BYTES` when the next write restarts
/// it after a checkpoint (`journal_size_limit`). Without the limit SQLite reuses the file but
/// never shrinks it: one large retention delete left a 1.17 GB WAL for good.
pub(crate) const WRITER_PRAGMAS: &str = "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; \
     PRAGMA wal_autocheckpoint = 0; PRAGMA journal_size_limit = 67108864";

fn sync_loop(
    wal: PathBuf,
    batches: std::sync::mpsc::Receiver<Committed>,
    checkpoint: std::sync::mpsc::SyncSender<()>,
    wal_syncs: &std::sync::atomic::AtomicU64,
) {
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
        } else if needs_sync {
            wal_syncs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        for (completions, commit_error) in ready {
            let error = commit_error.or_else(|| sync_error.clone());
            for completion in completions {
                completion(error.as_ref());
            }
        }
        let wal_bytes = file
            .as_ref()
            .and_then(|f| f.metadata().ok())
            .map_or(0, |m| m.len());
        if wal_bytes > CHECKPOINT_BYTES {
            // A checkpoint already asked for and not yet done covers this one.
            let _ = checkpoint.try_send(());
        }
    }
}

/// Copies the WAL into the database when asked, on a connection of its own, so the writer never
/// does (its connection has `wal_autocheckpoint = 0`): a checkpoint syncs the WAL and the
/// database file, which would stall every waiting request. PASSIVE: it never blocks the writer
/// or readers, and SQLite restarts the WAL once a checkpoint has copied all of it.
fn checkpoint_loop(database: PathBuf, requests: std::sync::mpsc::Receiver<()>) {
    let mut connection: Option<rusqlite::Connection> = None;
    while requests.recv().is_ok() {
        if connection.is_none() {
            match rusqlite::Connection::open(&database) {
                Ok(c) => connection = Some(c),
                Err(error) => {
                    tracing::error!(%error, "cannot open the database to checkpoint its WAL");
                    continue;
                }
            }
        }
        if let Some(c) = &connection
            && let Err(error) = c.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
        {
            tracing::warn!(%error, "WAL checkpoint failed; the next one retries");
        }
    }
}

fn sync(wal: &std::path::Path, file: &mut Option<std::fs::File>) -> Result<(), CommitFailure> {
    if file.is_none() {
        *file = Some(
            std::fs::File::open(wal)
                .map_err(|e| CommitFailure::io(&format!("opening {}", wal.display()), &e))?,
        );
    }
    file.as_ref()
        .map(std::fs::File::sync_data)
        .transpose()
        .map(drop)
        .map_err(|e| CommitFailure::io(&format!("fsync of {}", wal.display()), &e))
}

/// Each batch: its raw jobs in one transaction on the rusqlite connection, then its async jobs in
/// one transaction through sqlx (only if there are any). Order
/// inside a batch does not matter: its jobs were concurrent requests.
async fn run(
    mut conn: Conn,
    raw_conn: rusqlite::Connection,
    mut jobs: mpsc::Receiver<Job>,
    synced: std::sync::mpsc::Sender<Committed>,
) {
    while let Some(first) = jobs.recv().await {
        let batch = take_batch(first, &mut jobs, MAX_BATCH);
        let size = batch.len();
        let mut raw = Vec::new();
        let mut asyncs = Vec::new();
        for job in batch {
            match job {
                Job::Raw(job) => raw.push(job),
                Job::Async(job) => asyncs.push(job),
            }
        }
        if !raw.is_empty() {
            let (completions, error) = run_raw(&raw_conn, raw);
            send(&synced, completions, error);
        }
        if !asyncs.is_empty() {
            let (completions, error) = run_async(&mut conn, asyncs).await;
            send(&synced, completions, error);
        }
        metrics::histogram!("confed_db_batch_jobs").record(size as f64);
    }
    let _ = conn.close().await;
}

/// Hands committed jobs to the sync thread (or, if it is gone, answers them with an error).
fn send(
    synced: &std::sync::mpsc::Sender<Committed>,
    completions: Vec<Completion>,
    commit_error: Option<CommitFailure>,
) {
    if let Some(error) = &commit_error {
        tracing::error!(%error, jobs = completions.len(), "database batch failed; every job in it is refused");
    }
    if let Err(std::sync::mpsc::SendError((completions, error))) =
        synced.send((completions, commit_error))
    {
        let error = error.unwrap_or_else(|| {
            CommitFailure::new(CommitCause::Stopped, "the WAL sync thread has stopped")
        });
        for completion in completions {
            completion(Some(&error));
        }
    }
}

/// Raw jobs in one transaction, each in its own savepoint; returns their completions and the
/// transaction's error if it did not commit.
fn run_raw(
    conn: &rusqlite::Connection,
    jobs: Vec<RawJob>,
) -> (Vec<Completion>, Option<CommitFailure>) {
    let mut completions = Vec::with_capacity(jobs.len());
    let sql = |statement: &str| {
        conn.execute_batch(statement)
            .map_err(|e| CommitFailure::of(DbError::Sqlite(e)))
    };
    let mut failure = sql("BEGIN IMMEDIATE").err();
    for job in jobs {
        if failure.is_some() {
            // Dropping a job tells its caller that it did not run.
            continue;
        }
        if let Err(e) = sql("SAVEPOINT job") {
            failure = Some(e);
            continue;
        }
        let (ok, done) = job(conn);
        completions.push(done);
        if let Err(e) = sql(end_job(ok)) {
            failure = Some(e);
        }
    }
    let error = match failure {
        None => sql("COMMIT").err(),
        Some(error) => Some(error),
    };
    if error.is_some() {
        let _ = sql("ROLLBACK");
    }
    (completions, error)
}

/// Async jobs in one transaction through sqlx, each in its own savepoint.
async fn run_async(
    conn: &mut Conn,
    jobs: Vec<AsyncJob>,
) -> (Vec<Completion>, Option<CommitFailure>) {
    let mut completions = Vec::with_capacity(jobs.len());
    let mut failure = exec(conn, "BEGIN IMMEDIATE").await.err();
    for job in jobs {
        if failure.is_some() {
            continue;
        }
        if let Err(e) = exec(conn, "SAVEPOINT job").await {
            failure = Some(e);
            continue;
        }
        let (ok, done) = job(conn).await;
        if let Err(e) = exec(conn, end_job(ok)).await {
            failure = Some(e);
        }
        completions.push(done);
    }
    let error = match failure {
        None => exec(conn, "COMMIT").await.err(),
        Some(error) => {
            let _ = exec(conn, "ROLLBACK").await;
            Some(error)
        }
    };
    (completions, error)
}

/// `first` and whatever else `queue` holds right now, up to `max` in all: the jobs that arrived
/// while the last batch ran (the SQLite writer's and PostgreSQL's group commit both batch so).
pub(in crate::db) fn take_batch<T>(first: T, queue: &mut mpsc::Receiver<T>, max: usize) -> Vec<T> {
    let mut batch = vec![first];
    while batch.len() < max {
        match queue.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer on a fresh database in `dir` holding table `t`; `database` is where its sync
    /// thread looks for the WAL (a wrong path makes every sync fail).
    async fn writer_on_table(dir: &std::path::Path, database: std::path::PathBuf) -> Writer {
        let mut conn = connection(dir).await;
        sqlx::raw_sql("CREATE TABLE t (v BIGINT)")
            .execute(&mut conn)
            .await
            .unwrap();
        Writer::start(conn, raw(dir), database)
    }

    /// The writer's raw connection, as `Db::open_sqlite` opens it.
    fn raw(dir: &std::path::Path) -> rusqlite::Connection {
        let c = rusqlite::Connection::open(dir.join("t.db")).unwrap();
        c.execute_batch(WRITER_PRAGMAS).unwrap();
        c
    }

    async fn connection(dir: &std::path::Path) -> Conn {
        sqlx::any::install_default_drivers();
        let mut conn = Conn::connect(&super::super::sqlite_url(&dir.join("t.db")))
            .await
            .unwrap();
        sqlx::raw_sql("PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL")
            .execute(&mut conn)
            .await
            .unwrap();
        conn
    }

    fn insert(
        value: i64,
    ) -> impl for<'c> FnOnce(&'c mut Conn) -> BoxFuture<'c, Result<(), DbError>> + Send + 'static
    {
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

    /// Each answer comes after a WAL sync that covers it: the sync count has grown by the time
    /// a write returns (an answer sent before its sync would find the count unchanged).
    #[tokio::test]
    async fn writes_are_answered_once_the_wal_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer_on_table(dir.path(), dir.path().join("t.db")).await;
        for value in 1..=3 {
            let before = writer.wal_syncs();
            writer.write(insert(value)).await.unwrap();
            assert!(
                writer.wal_syncs() > before,
                "write {value} answered before a sync"
            );
        }
        let before = writer.wal_syncs();
        writer
            .write_raw(|c| {
                c.execute("INSERT INTO t (v) VALUES (4)", [])?;
                Ok(())
            })
            .await
            .unwrap();
        assert!(
            writer.wal_syncs() > before,
            "a raw write answered before a sync"
        );
    }

    fn count(dir: &std::path::Path) -> i64 {
        let c = rusqlite::Connection::open(dir.join("t.db")).unwrap();
        c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))
            .unwrap()
    }

    #[tokio::test]
    async fn raw_jobs_commit_or_roll_back_alone() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer_on_table(dir.path(), dir.path().join("t.db")).await;
        let done = writer.write_raw(|c| {
            c.execute("INSERT INTO t (v) VALUES (1)", [])?;
            Ok(7)
        });
        let failed = writer.write_raw(|c| -> Result<(), DbError> {
            c.execute("INSERT INTO t (v) VALUES (2)", [])?;
            Err(DbError::Corrupt("refused after writing".into()))
        });
        let also = writer.write_raw(|c| {
            c.execute("INSERT INTO t (v) VALUES (3)", [])?;
            Ok(3)
        });
        let (done, failed, also) = tokio::join!(done, failed, also);
        assert_eq!(done.unwrap(), 7);
        assert!(matches!(failed, Err(DbError::Corrupt(_))));
        assert_eq!(also.unwrap(), 3);
        // 1 and 3 stayed; the failed job's 2 was rolled back with its savepoint.
        assert_eq!(count(dir.path()), 2);
    }

    #[tokio::test]
    async fn a_batch_of_raw_jobs_commits_on_the_raw_connection() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer_on_table(dir.path(), dir.path().join("t.db")).await;
        let jobs = (0..20).map(|v| {
            writer.write_raw(move |c| {
                c.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
                Ok(())
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

    /// A large delete (a retention pass) grew the WAL to 1.17 GB, which never shrank. After its
    /// checkpoint, the next write cuts it back to the limit.
    #[tokio::test]
    async fn a_wal_grown_by_a_large_write_is_cut_back_after_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer_on_table(dir.path(), dir.path().join("t.db")).await;
        let wal = dir.path().join("t.db-wal");
        writer
            .write_raw(|c| {
                for _ in 0..80 {
                    c.execute("INSERT INTO t (v) VALUES (randomblob(1048576))", [])?;
                }
                Ok(())
            })
            .await
            .unwrap();
        let grown = std::fs::metadata(&wal).unwrap().len();
        assert!(grown > CHECKPOINT_BYTES, "{grown}");
        // The checkpoint thread was asked (the WAL is over its size); wait for it, bounded.
        let started = std::time::Instant::now();
        loop {
            writer
                .write_raw(|c| {
                    c.execute("INSERT INTO t (v) VALUES (1)", [])?;
                    Ok(())
                })
                .await
                .unwrap();
            let size = std::fs::metadata(&wal).unwrap().len();
            if size <= CHECKPOINT_BYTES {
                break;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "the WAL is still {size} bytes"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// If the WAL cannot be synced, nothing is acknowledged: every job of the batch is refused.
    #[tokio::test]
    async fn a_failed_wal_sync_refuses_the_jobs_instead_of_acknowledging_them() {
        let dir = tempfile::tempdir().unwrap();
        let writer = writer_on_table(dir.path(), dir.path().join("missing-dir").join("t.db")).await;
        let error = writer.write(insert(1)).await.unwrap_err();
        assert!(
            matches!(&error, DbError::Commit(f) if f.cause == CommitCause::Failed && f.detail.contains("missing-dir")),
            "{error}"
        );
    }
}
