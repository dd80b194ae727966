//! Group commit for SQLite. SQLite has one writer and, with `synchronous = FULL`, one fsync per
//! commit, which caps durable writes at the disk's fsync rate no matter how many requests wait.
//! Here every write is a job sent to one writer task, which runs all jobs waiting at that moment
//! in one transaction, each inside its own SAVEPOINT (a failing job rolls back alone), commits
//! once, and only then answers each job. A job's caller hears "done" only after the commit that
//! includes it is on disk: the durability promise is unchanged, the fsync is shared.
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

/// Called after the batch's commit, with the commit's error if it failed.
type Completion = Box<dyn FnOnce(Option<&str>) + Send>;

type Job =
    Box<dyn for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, (bool, Completion)> + Send>;

/// Most jobs in one transaction.
const MAX_BATCH: usize = 256;
const QUEUE: usize = 4096;

#[derive(Debug, Clone)]
pub struct Writer {
    jobs: mpsc::Sender<Job>,
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

    /// Runs `job` in the next batch; returns its result once the batch's commit is durable.
    pub async fn write<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut SqliteConnection) -> BoxFuture<'c, Result<T, DbError>>
            + Send
            + 'static,
    {
        let (answer, result) = oneshot::channel();
        let wrapped: Job = Box::new(move |conn| {
            Box::pin(async move {
                let outcome = job(conn).await;
                let ok = outcome.is_ok();
                let completion: Completion = Box::new(move |commit_error| {
                    let _ = answer.send(match (outcome, commit_error) {
                        (Ok(value), None) => Ok(value),
                        (Ok(_), Some(e)) => Err(DbError::Commit(e.to_string())),
                        (Err(e), _) => Err(e),
                    });
                });
                (ok, completion)
            })
        });
        self.jobs
            .send(wrapped)
            .await
            .map_err(|_| DbError::Commit("the database writer has stopped".into()))?;
        result
            .await
            .map_err(|_| DbError::Commit("the database writer dropped a job".into()))?
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

/// What ends one job and opens the savepoint of the next, in one round trip.
fn between_jobs(ok: bool, last: bool) -> &'static str {
    match (ok, last) {
        (true, false) => "RELEASE job; SAVEPOINT job",
        (true, true) => "RELEASE job",
        (false, false) => "ROLLBACK TO job; RELEASE job; SAVEPOINT job",
        (false, true) => "ROLLBACK TO job; RELEASE job",
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
        let mut completions = Vec::with_capacity(size);
        let mut failure = exec(&mut conn, "BEGIN IMMEDIATE; SAVEPOINT job")
            .await
            .err();
        for (index, job) in batch.into_iter().enumerate() {
            if failure.is_some() {
                // The transaction or a savepoint failed: the rest of the batch does not run, and
                // dropping a job tells its caller so.
                continue;
            }
            let (ok, completion) = job(&mut conn).await;
            if let Err(e) = exec(&mut conn, between_jobs(ok, index + 1 == size)).await {
                failure = Some(e);
            }
            completions.push(completion);
        }
        let commit_error = match failure {
            None => exec(&mut conn, "COMMIT").await.err(),
            Some(error) => {
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
