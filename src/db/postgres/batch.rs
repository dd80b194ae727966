//! The device writes that lock a round's row (check-ins and reports), grouped into shared
//! transactions on one connection per process.
//!
//! The writes that arrive while a batch runs wait for the next one, which runs them in a single
//! transaction and commits once; each caller is answered after that commit, so a write is
//! acknowledged only once durable. Every check-in and every completed report of a round locks
//! that round's row (for capacity, and to close the round exactly once), and a batch holds it
//! through its commit's WAL flush, so what a batch does between its first lock and its commit
//! bounds a round's device cycles. A batch of more than one write therefore runs them as sets
//! (`sets.rs`): one statement applies all its uploads, one locks all its rounds in id order, one
//! applies all its check-ins and completions; five round trips in all with BEGIN and COMMIT
//! (three more for a round that closes), where one statement per write took a batch's size
//! plus two. What the sets leave (a late or repeated report, other reports) runs its own
//! statement afterwards in the same transaction. The batches run on a connection of their own
//! (`BatchConnection`), not the pool's.
//!
//! Two batches (two replicas) lock their rounds in the same order, so they wait for each other
//! but do not deadlock over rounds; the single statements that run after the sets lock no round
//! the sets have not (`sets.rs` names the one cycle left, over one assignment written through
//! two replicas at once). The scheduler's expiry sweep locks rounds on its own: PostgreSQL's
//! detector breaks a deadlock with either after `deadlock_timeout` (1 s by default) by aborting
//! one transaction, and the aborted batch runs again (`run_batch`). While a batch waits, this
//! process's other device writes wait too. (A `SET LOCAL lock_timeout` would bound the wait; as
//! its own statement its round trip cost 10 % of the device cycles here; it could now ride in
//! `BATCH_BEGIN` at no cost, but is not set: a bounded wait would fail and rerun batches that a
//! slow commit of another replica only delayed.)
//!
//! A job may run twice: if a job of a batch fails (a database error aborts the whole
//! transaction), the batch is rolled back, that job runs again alone (its caller gets its own
//! answer), and the others run together again; if a set, the commit or the transaction fails,
//! the batch runs together once more, then every job alone. A job run alone runs its single
//! statement, not its set. So one job's fault reaches its caller only, and a write that always
//! fails costs its batch one retry (a set that always fails, two and a run one by one).
//! Jobs are therefore `Fn`, and must do nothing but SQL on the connection they are given. A
//! panic ends its batch (its callers get an error), not the queue.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use sqlx::{AnyConnection, Connection};
use tokio::sync::{mpsc, oneshot};

use super::readers::{ACQUIRE_TIMEOUT, still_usable};
use super::sets::{self, SetItem, SetOutcome};
use crate::db::writer::BoxFuture;
use crate::db::{CommitCause, CommitFailure, Conn, DbError};

/// Most jobs in one transaction.
const MAX_BATCH: usize = 128;
const QUEUE: usize = 4096;

type Run = Box<dyn for<'c> Fn(&'c mut Conn) -> BoxFuture<'c, Result<(), DbError>> + Send + Sync>;
type Settle = Box<dyn Fn(&SetOutcome) -> bool + Send + Sync>;

struct Queued {
    run: Run,
    /// The job as a member of its batch's sets (`sets.rs`), and how it takes the sets' answer
    /// (`false`: the sets left it to `run`).
    set: Option<(SetItem, Settle)>,
    /// Called once, after the commit that covers the job's last run (or with its error).
    answer: Box<dyn FnOnce(Result<(), DbError>) + Send + Sync>,
}

/// The handle that queues jobs; the batch task stops when the last handle is dropped.
#[derive(Debug, Clone)]
pub(in crate::db) struct Batcher {
    jobs: mpsc::Sender<Queued>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Queued")
    }
}

impl Batcher {
    /// Starts the batch task, with a connection of its own to the database at `url`.
    pub(in crate::db) fn start(url: &str) -> Self {
        let (jobs, queue) = mpsc::channel(QUEUE);
        tokio::spawn(run_batches(BatchConnection::new(Arc::from(url)), queue));
        Self { jobs }
    }

    /// Runs `job` in the next batch, as `item` of its sets: `settle` turns what the sets decided
    /// into the job's answer, or `None` to run `job` (in the same transaction, after the sets).
    /// Run alone (after a fault in its batch), the job runs `job`. Returns once the batch's
    /// commit is durable.
    pub(in crate::db) async fn write<T, S, F>(
        &self,
        item: SetItem,
        settle: S,
        job: F,
    ) -> Result<T, DbError>
    where
        T: Send + 'static,
        S: Fn(&SetOutcome) -> Option<T> + Send + Sync + 'static,
        F: for<'c> Fn(&'c mut Conn) -> BoxFuture<'c, Result<T, DbError>> + Send + Sync + 'static,
    {
        let slot: Arc<Mutex<Option<T>>> = Arc::new(Mutex::new(None));
        let filled = Arc::clone(&slot);
        let run: Run = Box::new(move |conn| {
            let filled = Arc::clone(&filled);
            let job = job(conn);
            Box::pin(async move {
                let value = job.await?;
                *filled.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
                Ok(())
            })
        });
        let settled = Arc::clone(&slot);
        let settle: Settle = Box::new(move |outcome| match settle(outcome) {
            Some(value) => {
                *settled.lock().unwrap_or_else(|e| e.into_inner()) = Some(value);
                true
            }
            None => false,
        });
        let (sender, receiver) = oneshot::channel();
        let answer = Box::new(move |outcome: Result<(), DbError>| {
            let value = outcome.and_then(|()| {
                slot.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take()
                    .ok_or_else(|| {
                        DbError::Commit(CommitFailure::new(
                            CommitCause::Failed,
                            "a batched job left no result",
                        ))
                    })
            });
            let _ = sender.send(value);
        });
        let queued = Queued {
            run,
            set: Some((item, settle)),
            answer,
        };
        self.jobs.send(queued).await.map_err(|_| {
            DbError::Commit(CommitFailure::new(
                CommitCause::Stopped,
                "the device write batcher has stopped",
            ))
        })?;
        receiver.await.map_err(|_| {
            DbError::Commit(CommitFailure::new(
                CommitCause::Stopped,
                "the device write batcher dropped a job",
            ))
        })?
    }
}

/// The batches' own connection, outside the pool: sqlx's pool checks every connection as it
/// comes back (a round trip for each batch), where this one is checked only after it idled
/// (`still_usable`). A transaction that failed in a statement and rolled back keeps it (a
/// deadlock broken by PostgreSQL, the commonest failure under load, should not cost a new
/// backend); any other failure closes it (a FATAL error from a restarting server, I/O, a failed
/// rollback or commit), and the next batch opens a new one.
struct BatchConnection {
    url: Arc<str>,
    open: Option<(AnyConnection, Instant)>,
}

/// How every batch's transaction begins, in one simple query (no extra round trip). The sets
/// name every row by its primary key, but PostgreSQL plans a prepared statement once for all
/// (its generic plan, after five runs) from the statistics of the tables at that moment: on a
/// new database, whose last ANALYZE saw empty tables, it chose sequential scans of
/// `assignments` and kept them while the table grew (a completion set went from 0.8 ms to 20 ms
/// in a run of 6,000 devices, until autovacuum's next ANALYZE replanned it). Every statement a
/// batch runs reads rows by key, so a scan of a whole table is never its best plan; with this
/// setting the planner takes one only where no index serves (`enable_seqscan` is a cost, not a
/// ban: a statement that cannot avoid a scan gets a huge cost, so it would also pass
/// `jit_above_cost` and be JIT-compiled each run; none of the batches' statements is one).
/// `SET LOCAL` ends with the transaction, so behind a pooler in transaction mode
/// (PgBouncer) no other client inherits it.
const BATCH_BEGIN: &str = "BEGIN; SET LOCAL enable_seqscan = off";

impl BatchConnection {
    fn new(url: Arc<str>) -> Self {
        Self { url, open: None }
    }

    /// The open connection (checked if it idled long), or a new one; the check and the connect
    /// each within `ACQUIRE_TIMEOUT`.
    async fn get(&mut self) -> Result<&mut AnyConnection, sqlx::Error> {
        if let Some((connection, since)) = &mut self.open
            && !still_usable(connection, *since).await
        {
            self.open = None;
        }
        if self.open.is_none() {
            let connection =
                tokio::time::timeout(ACQUIRE_TIMEOUT, AnyConnection::connect(&self.url))
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)??;
            self.open = Some((connection, Instant::now()));
        }
        match &mut self.open {
            Some((connection, _)) => Ok(connection),
            None => Err(sqlx::Error::PoolClosed),
        }
    }

    /// After a transaction: keeps the connection (used now) if `usable`, else closes it.
    fn finished(&mut self, usable: bool) {
        match (usable, &mut self.open) {
            (true, Some((_, since))) => *since = Instant::now(),
            _ => self.open = None,
        }
    }
}

async fn run_batches(mut connection: BatchConnection, mut queue: mpsc::Receiver<Queued>) {
    while let Some(first) = queue.recv().await {
        let batch = crate::db::writer::take_batch(first, &mut queue, MAX_BATCH);
        // Each batch in its own task: a panicking job must not end this loop (every later device
        // write would then fail). Its batch's callers get an error (their answers are dropped),
        // the connection it held is closed, and the next batch runs on a new one.
        let url = Arc::clone(&connection.url);
        match tokio::spawn(async move {
            run_batch(&mut connection, batch).await;
            connection
        })
        .await
        {
            Ok(returned) => connection = returned,
            Err(_) => {
                tracing::error!(
                    "a device write batch panicked; its writes were answered with an error"
                );
                connection = BatchConnection::new(url);
            }
        }
    }
}

/// Runs `batch` together (a write alone by its single statement: a set would pay a lock
/// statement first); if one job fails, answers it alone and runs the others together again (so a
/// write that always fails costs its batch one retry, not a run one by one); if a set, the
/// commit or the transaction fails (most often a deadlock with another replica's batch or the
/// expiry sweep, which PostgreSQL broke by aborting this one), runs the batch together once more,
/// and if that fails too, each job alone.
async fn run_batch(connection: &mut BatchConnection, mut batch: Vec<Queued>) {
    let mut failed_together = false;
    loop {
        let sets = if batch.len() == 1 {
            Sets::Skip
        } else {
            Sets::Use
        };
        match run_together(connection, &batch, sets).await {
            Ok(()) => {
                batch.into_iter().for_each(|job| (job.answer)(Ok(())));
                return;
            }
            Err((Some(failed), error)) if batch.len() > 1 => {
                tracing::debug!(%error, jobs = batch.len(), "a device write failed in a shared transaction; running it alone");
                let job = batch.remove(failed);
                let alone = run_together(connection, std::slice::from_ref(&job), Sets::Skip).await;
                (job.answer)(alone.map_err(|(_, error)| error));
            }
            Err((_, error)) if batch.len() == 1 => {
                if let Some(job) = batch.pop() {
                    (job.answer)(Err(error));
                }
                return;
            }
            Err((None, error)) if !failed_together => {
                tracing::debug!(%error, jobs = batch.len(), "a device write batch failed; running it again");
                failed_together = true;
            }
            Err((None, error)) => {
                tracing::warn!(%error, jobs = batch.len(), "a device write batch failed twice; running its jobs one by one");
                for job in batch {
                    let alone =
                        run_together(connection, std::slice::from_ref(&job), Sets::Skip).await;
                    (job.answer)(alone.map_err(|(_, error)| error));
                }
                return;
            }
            Err((Some(_), error)) => {
                let failure = CommitFailure::of(error);
                batch
                    .into_iter()
                    .for_each(|job| (job.answer)(Err(DbError::Commit(failure.clone()))));
                return;
            }
        }
    }
}

/// Whether a batch runs its jobs' sets (`Use`) or only their single statements (`Skip`: a job
/// run alone after a fault takes the path that does not depend on the sets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sets {
    Use,
    Skip,
}

/// `jobs` in one transaction, committed: first their sets, then, in order, each job the sets did
/// not answer. Rolled back at the first error, which comes back with the index of the job that
/// failed (`None`: the sets, the commit or the transaction itself failed).
async fn run_together(
    connection: &mut BatchConnection,
    jobs: &[Queued],
    sets: Sets,
) -> Result<(), (Option<usize>, DbError)> {
    let open = match connection.get().await {
        Ok(open) => open,
        Err(error) => {
            connection.finished(false);
            return Err((None, error.into()));
        }
    };
    let (outcome, usable) = transaction(open, jobs, sets).await;
    connection.finished(usable);
    outcome
}

/// `run_together`'s transaction on `connection`, and whether the connection is fit for the next
/// one: after a commit, or after a statement's plain database error and a rollback that went
/// through.
async fn transaction(
    connection: &mut AnyConnection,
    jobs: &[Queued],
    sets: Sets,
) -> (Result<(), (Option<usize>, DbError)>, bool) {
    let mut tx = match connection.begin_with(BATCH_BEGIN).await {
        Ok(tx) => tx,
        Err(error) => return (Err((None, error.into())), false),
    };
    let mut settled = vec![false; jobs.len()];
    if sets == Sets::Use && jobs.iter().any(|job| job.set.is_some()) {
        let items: Vec<Option<&SetItem>> = jobs
            .iter()
            .map(|job| job.set.as_ref().map(|(item, _)| item))
            .collect();
        match sets::run(&mut tx, &items).await {
            Ok(outcomes) => {
                for ((job, outcome), settled) in jobs.iter().zip(outcomes).zip(&mut settled) {
                    if let (Some((_, settle)), Some(outcome)) = (&job.set, outcome) {
                        *settled = settle(&outcome);
                    }
                }
            }
            Err(error) => {
                let usable = tx.rollback().await.is_ok() && leaves_connection_usable(&error);
                return (Err((None, error)), usable);
            }
        }
    }
    for (index, job) in jobs.iter().enumerate() {
        if settled[index] {
            continue;
        }
        if let Err(error) = (job.run)(&mut tx).await {
            // Now, not when the connection is next used: until then it keeps its row locks.
            let usable = tx.rollback().await.is_ok() && leaves_connection_usable(&error);
            return (Err((Some(index), error)), usable);
        }
    }
    match tx.commit().await {
        Ok(()) => (Ok(()), true),
        Err(error) => (Err((None, error.into())), false),
    }
}

/// Whether a statement's failure leaves its connection as it was: an error PostgreSQL reported
/// (a deadlock, a constraint) does, unless it is one of a server going away; any other sqlx
/// error (transport, protocol, and, to be safe, decoding) closes it. An error of the job's own
/// (not sqlx's) did not touch it.
fn leaves_connection_usable(error: &DbError) -> bool {
    match error {
        DbError::Sqlx(sqlx::Error::Database(_)) => !error.is_unavailable(),
        DbError::Sqlx(_) => false,
        _ => true,
    }
}
