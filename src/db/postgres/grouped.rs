//! The device path's reads grouped into shared statements (a read group commit): reads of one
//! kind that arrive while a statement of theirs is in flight wait for the next one, which reads
//! all of them at once (each key joined to the kind's one-key query) and answers each with its
//! own rows.
//!
//! A device cycle makes three reads (its check-in's candidate rounds, and the assignment's view
//! for the model download and again for the upload) and shares about half a write batch
//! (`batch.rs`), so the reads were three of every four statements the device path sent; each
//! finds a few rows by key in tens of microseconds, and what it costs is the statement itself
//! (its round trip, the backend's wake-up, the protocol on both ends). Grouped, a statement
//! carries every read that arrived while the last one ran.
//!
//! What a device sees does not change: a read's statement starts after the read arrived, so its
//! snapshot is as late as an ungrouped read's would be (a device's upload sees its own
//! check-in, acknowledged before the upload was sent), and every read answers from its own key's
//! rows. A read waits for the statement in flight before its own (and for earlier groups, when
//! more than `MAX_GROUP` wait); with no other read in flight it starts at once, as before. One
//! that has not joined a statement within `ACQUIRE_TIMEOUT` fails as a pool's acquire does
//! (503 with `Retry-After`), so an overloaded database sheds reads rather than queueing them.
//!
//! The statements run in a task of their own, so a caller that goes away (a device that drops its
//! request) neither cancels the others' statement nor strands their answers. A statement that
//! fails because the database is unavailable answers every read of its group with an error of
//! that class (503 with `Retry-After`); one that fails otherwise runs again for each key alone,
//! so a key whose read fails (500) fails only its own reads, as a write that fails its group
//! commit does (`batch.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::FutureExt as _;
use sqlx::any::AnyRow;
use sqlx::{FromRow, Row};
use tokio::sync::oneshot;

use super::readers::{ACQUIRE_TIMEOUT, Readers};
use crate::db::DbError;

/// Most reads in one statement.
pub(in crate::db) const MAX_GROUP: usize = 64;

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
    /// Which read it is, to take it out again when it waits too long.
    ticket: u64,
    key: String,
    answer: Answer<R>,
}

struct Waiting<R> {
    reads: Vec<Queued<R>>,
    next_ticket: u64,
    /// Whether a task is running statements (it takes every read that waits before it stops).
    running: bool,
}

/// One kind of grouped read: the statements for each group size and the reads waiting.
pub(in crate::db) struct Grouped<R> {
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

impl<R> Grouped<R>
where
    R: for<'r> FromRow<'r, AnyRow> + Clone + Send + Unpin + 'static,
{
    /// `per_key` is the kind's query for one key, which it names `k.key` (as in
    /// `WHERE a.id = k.key`).
    pub(in crate::db) fn new(readers: Arc<Readers>, per_key: &str) -> Arc<Self> {
        let statements = std::iter::successors(Some(1usize), |n| Some(n * 2))
            .take_while(|n| *n <= MAX_GROUP)
            .map(|n| Arc::from(statement(per_key, n)))
            .collect();
        Arc::new(Self {
            readers,
            statements,
            waiting: Mutex::new(Waiting {
                reads: Vec::new(),
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
            waiting.reads.push(Queued {
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
            if let Some(at) = waiting.reads.iter().position(|read| read.ticket == ticket) {
                waiting.reads.remove(at);
                return Err(DbError::Sqlx(sqlx::Error::PoolTimedOut));
            }
        }
        // Already in a statement: its answer comes.
        answered.await.unwrap_or_else(|_| closed())
    }

    #[cfg(test)]
    fn statements_run(&self) -> u64 {
        self.statements_run.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting<R>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs statements until no read waits; a group's panic fails that group (its answers are
    /// dropped), not the reads after it.
    async fn run(self: Arc<Self>) {
        loop {
            let group = {
                let mut waiting = self.lock();
                if waiting.reads.is_empty() {
                    waiting.running = false;
                    return;
                }
                let take = waiting.reads.len().min(MAX_GROUP);
                waiting.reads.drain(..take).collect::<Vec<_>>()
            };
            let _ = std::panic::AssertUnwindSafe(self.answer(group))
                .catch_unwind()
                .await;
        }
    }

    /// Answers a group: one statement for all its keys; if that fails other than for an
    /// outage, each key alone, so that a key whose read fails (none should: populations and
    /// references are checked before they are read) fails only its own reads.
    async fn answer(&self, group: Vec<Queued<R>>) {
        let mut by_key: HashMap<String, Vec<Answer<R>>> = HashMap::new();
        for Queued { key, answer, .. } in group {
            by_key.entry(key).or_default().push(answer);
        }
        let keys: Vec<String> = by_key.keys().cloned().collect();
        let alone = match self.fetch(keys).await {
            Ok(mut rows) => {
                for (key, answers) in by_key {
                    let rows = rows.remove(&key).unwrap_or_default();
                    send(answers, Ok(rows));
                }
                return;
            }
            Err(error) if by_key.len() > 1 && !error.is_unavailable() => by_key,
            Err(error) => {
                send(by_key.into_values().flatten().collect(), Err(error));
                return;
            }
        };
        for (key, answers) in alone {
            let rows = self.fetch(vec![key.clone()]).await;
            send(
                answers,
                rows.map(|mut rows| rows.remove(&key).unwrap_or_default()),
            );
        }
    }

    /// One statement for `keys` (distinct): their rows, by key.
    async fn fetch(&self, keys: Vec<String>) -> Result<HashMap<String, Vec<R>>, DbError> {
        let size = keys.len().next_power_of_two();
        let sql = Arc::clone(&self.statements[size.trailing_zeros() as usize]);
        self.statements_run.fetch_add(1, Ordering::Relaxed);
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
                    query.fetch_all(conn).await
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
                let _ = answer.send(Err(like(&error)));
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
        "SELECT k.key AS {GROUP_KEY}, one.* FROM (VALUES {keys}) AS k(key) \
         CROSS JOIN LATERAL ({per_key} OFFSET 0) AS one"
    )
}

/// An error of `error`'s class, with its text, for another read of the same statement
/// (`DbError` is not `Clone`: sqlx's errors are not).
fn like(error: &DbError) -> DbError {
    let text = match error {
        DbError::Sqlx(error) => error.to_string(),
        other => other.to_string(),
    };
    if error.is_unavailable() {
        DbError::Sqlx(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            text,
        )))
    } else {
        DbError::Sqlx(sqlx::Error::Protocol(text))
    }
}

#[cfg(test)]
#[path = "grouped_tests.rs"]
mod tests;
