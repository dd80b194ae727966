//! Connections for the device path's reads (a check-in's candidate rounds, an assignment's view),
//! outside sqlx's pool: the statements of `grouped.rs`, each carrying the reads of its kind that
//! arrived while the last one ran.
//!
//! sqlx's pool checks every connection as it comes back (a round trip: PostgreSQL's Sync and
//! ReadyForQuery), because a statement whose future was dropped half way leaves its connection in
//! an unknown state. For a read of a few rows that check costs about as much as the read, and it
//! was a third of a device cycle's round trips. Here a connection whose statement succeeded goes
//! straight back; one whose statement was dropped is checked first, by a task of its own, and
//! goes back if the check passes, not replaced by a new connection (a backend forked and
//! authenticated; `grouped.rs` runs its statements in tasks that callers going away do not
//! cancel, so this is for a read dropped by other means); one whose
//! statement failed is closed (a FATAL from a restarting server arrives as a database error on a
//! connection that is already gone). A connection idle for longer than `PING_IF_IDLE` is checked
//! before it is used (PostgreSQL may have restarted meanwhile), as the pool's are; so after a
//! restart under load, each connection used within that second fails one statement (every read
//! of its group) before it is replaced.
//!
//! At most `at_once` statements (one per kind of grouped read) run at once, each on its own
//! connection, besides the pool's connections (`MAX_POOLED`). A statement that cannot start within
//! `ACQUIRE_TIMEOUT` (waiting for a turn, checking an idle connection, or opening a new one) fails
//! as the pool's acquire does (`PoolTimedOut`: 503 with Retry-After).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{AnyConnection, Connection};
use tokio::sync::Semaphore;

use crate::db::DbError;
use crate::db::writer::BoxFuture;

/// The pool's connections: the partner API, the scheduler, workers, the device path's other
/// writes. With the device reads' two (`DeviceReads`), the device write batcher's and the job
/// listener's, a replica opens at most 11 connections (PostgreSQL's default `max_connections` is 100, shared by every
/// replica).
pub(in crate::db) const MAX_POOLED: u32 = 7;

/// How long a pooled acquire, or a grouped read's statement, waits for a connection; a grouped
/// read also waits at most this long to join a statement (`grouped.rs`).
pub(in crate::db) const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection idle for longer than this is checked (one round trip) before it is used.
pub(in crate::db) const PING_IF_IDLE: Duration = Duration::from_secs(1);

/// The reads' connections to one database.
pub(in crate::db) struct Readers {
    url: String,
    /// Most statements at once, so most connections kept (a check that runs after a dropped
    /// statement may hold one more while it lasts).
    at_once: usize,
    turns: Semaphore,
    /// Connections whose last statement finished, and when.
    idle: Mutex<Vec<(AnyConnection, Instant)>>,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readers").finish_non_exhaustive()
    }
}

/// A connection lent to one read: returned by `finished`; if the read is dropped first, checked
/// and returned by a task of its own.
struct Lent {
    connection: Option<AnyConnection>,
    home: Arc<Readers>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(mut connection) = self.connection.take() else {
            return;
        };
        // Outside a runtime (dropped while one shuts down) the connection just closes.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let home = Arc::clone(&self.home);
        // A ping reads past whatever the dropped statement left unread, up to ReadyForQuery.
        runtime.spawn(async move {
            if let Ok(Ok(())) = tokio::time::timeout(ACQUIRE_TIMEOUT, connection.ping()).await {
                home.put_back(connection);
            }
        });
    }
}

impl Readers {
    /// Connections for at most `at_once` statements at a time: one for each statement its users
    /// keep in flight (`grouped.rs` keeps one per kind).
    pub(in crate::db) fn new(url: &str, at_once: usize) -> Arc<Self> {
        Arc::new(Self {
            url: url.to_string(),
            at_once,
            turns: Semaphore::new(at_once),
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Runs `read` (one statement) on a connection of these; see the module's header for which
    /// connections are kept.
    pub(in crate::db) async fn read<T>(
        self: &Arc<Self>,
        read: impl for<'c> FnOnce(&'c mut AnyConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T, DbError> {
        let (_turn, connection) = tokio::time::timeout(ACQUIRE_TIMEOUT, async {
            let turn = self
                .turns
                .acquire()
                .await
                .map_err(|_| sqlx::Error::PoolClosed)?;
            Ok::<_, sqlx::Error>((turn, self.connection().await?))
        })
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
        let mut lent = Lent {
            connection: Some(connection),
            home: Arc::clone(self),
        };
        let result = match lent.connection.as_mut() {
            Some(connection) => read(connection).await,
            None => Err(sqlx::Error::PoolClosed),
        };
        let connection = lent.connection.take();
        if let (Ok(_), Some(connection)) = (&result, connection) {
            self.put_back(connection);
        }
        Ok(result?)
    }

    fn put_back(&self, connection: AnyConnection) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.at_once {
            idle.push((connection, Instant::now()));
        }
    }

    /// An idle connection (checked if it idled long), or a new one.
    async fn connection(&self) -> Result<AnyConnection, sqlx::Error> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((mut connection, since)) = idle else {
                break;
            };
            if still_usable(&mut connection, since).await {
                return Ok(connection);
            }
        }
        AnyConnection::connect(&self.url).await
    }
}

/// Whether a connection last used at `since` may take a statement: yes if it idled for at most
/// `PING_IF_IDLE`, else if it answers a ping within `ACQUIRE_TIMEOUT` (PostgreSQL may have
/// restarted meanwhile). The readers' and the device write batches' connections both ask this.
pub(super) async fn still_usable(connection: &mut AnyConnection, since: Instant) -> bool {
    since.elapsed() <= PING_IF_IDLE
        || matches!(
            tokio::time::timeout(ACQUIRE_TIMEOUT, connection.ping()).await,
            Ok(Ok(()))
        )
}

#[cfg(test)]
#[path = "readers_tests.rs"]
mod tests;
