//! Group commit for SQLite. SQLite has one writer and, with `synchronous = FULL`, one fsync per
//! commit, which caps durable writes at the disk's fsync rate no matter how many requests wait.
//! Here every write is a job sent to one writer task, which runs all jobs waiting at that moment
//! in one transaction, each inside its own SAVEPOINT (a failing job rolls back alone), commits
//! once, and only then answers each job. A job's caller hears "done" only after the commit that
//! includes it is on disk: the durability promise is unchanged, the fsync is shared.

use std::future::Future;
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
    /// Starts the writer task on `connection`, which it owns from now on.
    pub fn start(connection: SqliteConnection) -> Self {
        let (jobs, receiver) = mpsc::channel(QUEUE);
        tokio::spawn(run(connection, receiver));
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

async fn run(mut conn: SqliteConnection, mut jobs: mpsc::Receiver<Job>) {
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
        for completion in completions {
            completion(commit_error.as_deref());
        }
    }
    let _ = conn.close().await;
}
