//! The device path's reads grouped into shared statements (a read group commit): reads of one
//! kind that arrive while a statement of theirs is in flight wait for the next one, which reads
//! all of them at once (each key joined to the kind's one-key query) and answers each with its
//! own rows.
//!
//! A device cycle makes three reads (its check-in's candidate rounds, and the assignment's view
//! for the model download and again for the upload) and a share of a write batch (`batch.rs`:
//! five statements for about 11 cycles), so the reads were three of every four statements the
//! device path sent; each
//! finds a few rows by key in tens of microseconds, and what it costs is the statement itself
//! (its round trip, the backend's wake-up, the protocol on both ends). Grouped, a statement
//! carries every read that arrived while the last one ran.
//!
//! What a device sees does not change: a read's statement starts after the read arrived, so its
//! snapshot is as late as an ungrouped read's would be (a device's upload sees its own
//! check-in, acknowledged before the upload was sent), and every read answers from its own key's
//! rows. A read waits for the statement in flight before its own (and for earlier groups, when
//! more than `MAX_GROUP` keys wait); with no other read in flight it starts at once, as before.
//! One that has not joined a statement within `ACQUIRE_TIMEOUT` fails as a pool's acquire does
//! (503 with `Retry-After`), so an overloaded database sheds reads rather than queueing them; a
//! statement may then wait up to `ACQUIRE_TIMEOUT` again for its connection, and runs for at
//! most `STATEMENT_TIMEOUT` (one statement stuck on a dead connection would otherwise hold up
//! every read of its kind).
//!
//! The statements run in a task of their own, so a caller that goes away (a device that drops its
//! request) neither cancels the others' statement nor strands their answers; a read whose caller
//! left before its statement is not read. A statement that fails answers every read of its group
//! with an error of the same class (503 with `Retry-After` for an outage or a timeout, 507 for a
//! full disk, 500 otherwise), except a failure one key's value could cause (a data exception, a
//! row that does not decode): that group runs again key by key, so the key fails only its own
//! reads, as a write that fails its group commit does (`batch.rs`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::FutureExt as _;
use sqlx::any::AnyRow;
use sqlx::{FromRow, Row};
use tokio::sync::oneshot;

use std::time::Duration;

use super::readers::{ACQUIRE_TIMEOUT, Readers};
use crate::db::DbError;

/// Most keys in one statement.
pub(in crate::db) const MAX_GROUP: usize = 64;

/// How long a statement may run: it reads at most `MAX_GROUP` keys, each by its key, in well
/// under a millisecond a key, so one that runs this long is stuck (a half-open connection, a
/// server that stopped answering), and every read of its kind would wait behind it. It fails
/// its reads as unavailable (503 with `Retry-After`) and its connection is closed.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The column that carries the key a row answers (the grouped SQL adds it).
pub(in crate::db) const GROUP_KEY: &str = "group_key";

/// A row of a grouped statement: the key it answers and the row itself.
struct Keyed<R> {
    key: String,
    row: R,
}

impl<'r, R: FromRow<'r, AnyRow>> FromRow<'r, AnyRow> for Keyed<R> {
    fn from_row(row: &'r AnyRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            key: row.try_get(GROUP_KEY)?,
            row: R::from_row(row)?,
        })
    }
}

type Answer<R> = oneshot::Sender<Result<Vec<R>, DbError>>;

/// A read waiting for a statement.
struct Queued<R> {
    /// Which read it is (increasing: the queue stays in ticket order), to take it out again when
    /// it waits too long.
    ticket: u64,
    key: String,
    answer: Answer<R>,
}

struct Waiting<R> {
    reads: VecDeque<Queued<R>>,
    next_ticket: u64,
    /// Whether a task is running statements (it takes every read that waits before it stops).
    running: bool,
}

/// One kind of grouped read: the statements for each group size and the reads waiting.
pub(in crate::db) struct Grouped<R> {
    /// The kind's name in `confed_db_grouped_read_keys{kind}`.
    kind: &'static str,
    readers: Arc<Readers>,
    /// `statements[i]` reads `2^i` keys (`$1` to `$2^i`); a group of another size is padded with
    /// NULL keys, which match no row, so a connection prepares at most `log2(MAX_GROUP) + 1`
    /// statements per kind.
    statements: Vec<Arc<str>>,
    waiting: Mutex<Waiting<R>>,
    /// Statements run so far (the tests count them).
    statements_run: AtomicU64,
}

impl<R> std::fmt::Debug for Grouped<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grouped").finish_non_exhaustive()
    }
}

/// Clears `running` if the statements' task ends other than by finding no read waiting (its
/// runtime dropped it), so that the next read starts a task again.
struct Running<'a, R> {
    waiting: &'a Mutex<Waiting<R>>,
    armed: bool,
}

impl<R> Drop for Running<'_, R> {
    fn drop(&mut self) {
        if self.armed {
            self.waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .running = false;
        }
    }
}

impl<R> Grouped<R>
where
    R: for<'r> FromRow<'r, AnyRow> + Clone + Send + Unpin + 'static,
{
    /// `per_key` is the kind's query for one key, which it names `grouped_keys.key` (as in
    /// `WHERE a.id = grouped_keys.key`); `kind` names it in the metrics.
    pub(in crate::db) fn new(
        kind: &'static str,
        readers: Arc<Readers>,
        per_key: &str,
    ) -> Arc<Self> {
        debug_assert!(per_key.contains("grouped_keys.key") && !per_key.contains(GROUP_KEY));
        let statements = std::iter::successors(Some(1usize), |n| Some(n * 2))
            .take_while(|n| *n <= MAX_GROUP)
            .map(|n| Arc::from(statement(per_key, n)))
            .collect();
        Arc::new(Self {
            kind,
            readers,
            statements,
            waiting: Mutex::new(Waiting {
                reads: VecDeque::new(),
                next_ticket: 0,
                running: false,
            }),
            statements_run: AtomicU64::new(0),
        })
    }

    /// The rows that answer `key`, read in the next statement of this kind.
    pub(in crate::db) async fn read(self: &Arc<Self>, key: String) -> Result<Vec<R>, DbError> {
        let (answer, mut answered) = oneshot::channel();
        let (ticket, start) = {
            let mut waiting = self.lock();
            let ticket = waiting.next_ticket;
            waiting.next_ticket += 1;
            waiting.reads.push_back(Queued {
                ticket,
                key,
                answer,
            });
            (ticket, !std::mem::replace(&mut waiting.running, true))
        };
        if start {
            tokio::spawn(Arc::clone(self).run());
        }
        // A dropped sender: the task ended without answering (its runtime is shutting down).
        let closed = || Err(DbError::Sqlx(sqlx::Error::PoolClosed));
        if let Ok(answer) = tokio::time::timeout(ACQUIRE_TIMEOUT, &mut answered).await {
            return answer.unwrap_or_else(|_| closed());
        }
        {
            let mut waiting = self.lock();
            if let Ok(at) = waiting
                .reads
                .binary_search_by_key(&ticket, |read| read.ticket)
            {
                waiting.reads.remove(at);
                return Err(DbError::Sqlx(sqlx::Error::PoolTimedOut));
            }
        }
        // Already in a statement: its answer comes (within STATEMENT_TIMEOUT).
        answered.await.unwrap_or_else(|_| closed())
    }

    #[cfg(test)]
    fn statements_run(&self) -> u64 {
        self.statements_run.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting<R>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs statements until no read waits. A group's panic (a bug) fails that group's reads
    /// with a server error, not the reads after it.
    async fn run(self: Arc<Self>) {
        let mut running = Running {
            waiting: &self.waiting,
            armed: true,
        };
        loop {
            let Some(mut group) = self.next_group() else {
                running.armed = false;
                return;
            };
            let answered = std::panic::AssertUnwindSafe(self.answer(&mut group))
                .catch_unwind()
                .await;
            if answered.is_err() {
                tracing::error!(keys = group.len(), "a grouped database read panicked");
                let bug = sqlx::Error::Protocol("a grouped database read failed (a bug)".into());
                send(
                    group.into_values().flatten().collect(),
                    Err(DbError::Sqlx(bug)),
                );
            }
        }
    }

    /// The reads of the next statement, by key: every read that waits, up to `MAX_GROUP`
    /// distinct keys (reads of one key share its rows, so they do not count twice), skipping
    /// reads whose callers went away. `None` (and no task running) when none waits.
    fn next_group(&self) -> Option<HashMap<String, Vec<Answer<R>>>> {
        let mut waiting = self.lock();
        let mut group: HashMap<String, Vec<Answer<R>>> = HashMap::new();
        while let Some(read) = waiting.reads.front() {
            if group.len() == MAX_GROUP && !group.contains_key(&read.key) {
                break;
            }
            if let Some(Queued { key, answer, .. }) = waiting.reads.pop_front()
                && !answer.is_closed()
            {
                group.entry(key).or_default().push(answer);
            }
        }
        if group.is_empty() {
            waiting.running = false;
            return None;
        }
        Some(group)
    }

    /// Answers a group (taking each key's reads out of it as they are answered): one statement
    /// for all its keys; if that fails in a way one key's value could cause, each key alone, so
    /// that a key whose read fails (none should: populations and references are checked before
    /// they are read) fails only its own reads.
    async fn answer(&self, group: &mut HashMap<String, Vec<Answer<R>>>) {
        let keys: Vec<String> = group.keys().cloned().collect();
        let error = match self.fetch(keys).await {
            Ok(mut rows) => {
                for (key, answers) in group.drain() {
                    send(answers, Ok(rows.remove(&key).unwrap_or_default()));
                }
                return;
            }
            Err(error) if group.len() > 1 && may_be_one_keys(&error) => error,
            Err(error) => {
                send(group.drain().flat_map(|(_, a)| a).collect(), Err(error));
                return;
            }
        };
        tracing::warn!(%error, keys = group.len(), "a grouped database read failed; reading each key alone");
        let keys: Vec<String> = group.keys().cloned().collect();
        for key in keys {
            let rows = self.fetch(vec![key.clone()]).await;
            let rows = rows.map(|mut rows| rows.remove(&key).unwrap_or_default());
            let outage = rows
                .as_ref()
                .err()
                .filter(|e| e.is_unavailable())
                .map(DbError::of_the_same_class);
            send(group.remove(&key).unwrap_or_default(), rows);
            if let Some(outage) = outage {
                // The database went away meanwhile: the rest would each wait for it too.
                send(group.drain().flat_map(|(_, a)| a).collect(), Err(outage));
                return;
            }
        }
    }

    /// One statement for `keys` (distinct): their rows, by key.
    async fn fetch(&self, keys: Vec<String>) -> Result<HashMap<String, Vec<R>>, DbError> {
        let size = keys.len().next_power_of_two();
        let sql = Arc::clone(&self.statements[size.trailing_zeros() as usize]);
        self.statements_run.fetch_add(1, Ordering::Relaxed);
        // The keys each statement answers: how much the grouping saves (operations.md).
        metrics::histogram!("confed_db_grouped_read_keys", "kind" => self.kind)
            .record(keys.len() as f64);
        let rows = self
            .readers
            .read(move |conn| {
                Box::pin(async move {
                    // The statement is built from the kind's fixed SQL and placeholders only.
                    let mut query = sqlx::query_as::<_, Keyed<R>>(sqlx::AssertSqlSafe(&*sql));
                    // A NULL key matches no row: the padding answers nothing.
                    for index in 0..size {
                        query = query.bind(keys.get(index).cloned());
                    }
                    tokio::time::timeout(STATEMENT_TIMEOUT, query.fetch_all(conn))
                        .await
                        .map_err(|_| sqlx::Error::PoolTimedOut)?
                })
            })
            .await?;
        let mut by_key: HashMap<String, Vec<R>> = HashMap::new();
        for Keyed { key, row } in rows {
            by_key.entry(key).or_default().push(row);
        }
        Ok(by_key)
    }
}

/// Whether a group's failure may be owed to one key's value, and so worth reading key by key:
/// a data exception (SQLSTATE class 22, such as a value the server cannot take as text) or a
/// row that did not decode. Anything else (an outage, overload, a cancelled statement, the
/// server's own fault) would fail each key alone too, and reading them one by one would only
/// multiply the load on a database that is struggling.
fn may_be_one_keys(error: &DbError) -> bool {
    match error {
        DbError::Sqlx(sqlx::Error::Database(e)) => {
            e.code().is_some_and(|code| code.starts_with("22"))
        }
        DbError::Sqlx(sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_)) => true,
        _ => false,
    }
}

/// Answers every read of one key: the rows to each, or the error to the first and one of its
/// class to the others.
fn send<R: Clone>(answers: Vec<Answer<R>>, result: Result<Vec<R>, DbError>) {
    match result {
        Ok(rows) => {
            for answer in answers {
                let _ = answer.send(Ok(rows.clone()));
            }
        }
        Err(error) => {
            let mut answers = answers.into_iter();
            let first = answers.next();
            for answer in answers {
                let _ = answer.send(Err(error.of_the_same_class()));
            }
            if let Some(answer) = first {
                let _ = answer.send(Err(error));
            }
        }
    }
}

/// The statement that reads `n` keys (`$1` to `$n`, text) with the one-key query `per_key`:
/// each key joined laterally to its own run of `per_key`. `OFFSET 0` keeps the subquery from
/// being merged into a join over every key, so each key is planned as the one-key statement
/// is, by its primary key or index. (An `IN ($1, ...)` list was merged: its prepared
/// statement's generic plan, made while a new database's tables were small, scanned all of
/// `assignments` and kept doing so as it grew: 2-5 ms a statement at 8-16 keys, where one key
/// took 0.05 ms.)
fn statement(per_key: &str, n: usize) -> String {
    let keys = (1..=n)
        .map(|i| format!("(CAST(${i} AS TEXT))"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT grouped_keys.key AS {GROUP_KEY}, one.* FROM (VALUES {keys}) AS grouped_keys(key) \
         CROSS JOIN LATERAL ({per_key} OFFSET 0) AS one"
    )
}

#[cfg(test)]
#[path = "grouped_tests.rs"]
mod tests;
