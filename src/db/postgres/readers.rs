//! Connections for the device path's reads (a check-in's candidate rounds, an assignment's view):
//! one statement each, three per device cycle, outside sqlx's pool.
//!
//! sqlx's pool checks every connection as it comes back (a round trip: PostgreSQL's Sync and
//! ReadyForQuery), because a statement whose future was dropped half way leaves its connection in
//! an unknown state. For a read of a few rows that check costs about as much as the read, and it
//! is a third of a device cycle's round trips. Here a connection goes back only after its
//! statement finished, or failed with an answer from the server; one whose statement was dropped
//! (the caller went away), or that failed in any other way, is closed instead. So no connection
//! goes back unfinished, and none is checked twice. A connection idle for longer than
//! `PING_IF_IDLE` is checked before it is used (PostgreSQL may have restarted meanwhile), as the
//! pool's are.
//!
//! At most `MAX_READERS` connections are open here, on top of the pool's; a read that waits longer
//! than the pool's acquire timeout for one fails as the pool's does (`PoolTimedOut`: 503 with
//! Retry-After), and so does a new connection PostgreSQL does not accept within it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::{AnyConnection, Connection};
use tokio::sync::Semaphore;

use crate::db::DbError;
use crate::db::writer::BoxFuture;

/// Most connections open for these reads (PostgreSQL's default `max_connections` is 100, shared
/// by every replica).
const MAX_READERS: usize = 16;

/// How long a read waits for a connection, or for PostgreSQL to accept a new one.
pub(in crate::db) const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection idle for longer than this is checked (one round trip) before it is used.
pub(in crate::db) const PING_IF_IDLE: Duration = Duration::from_secs(1);

/// The reads' connections to one database.
pub(in crate::db) struct Readers {
    url: String,
    permits: Semaphore,
    /// Connections whose last statement finished, and when.
    idle: Mutex<Vec<(AnyConnection, Instant)>>,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readers").finish_non_exhaustive()
    }
}

impl Readers {
    pub(in crate::db) fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            permits: Semaphore::new(MAX_READERS),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Runs `read` (one statement) on a connection of these; see the module's header for which
    /// connections are kept.
    pub(in crate::db) async fn read<T>(
        &self,
        read: impl for<'c> FnOnce(&'c mut AnyConnection) -> BoxFuture<'c, Result<T, sqlx::Error>>,
    ) -> Result<T, DbError> {
        let _permit = tokio::time::timeout(ACQUIRE_TIMEOUT, self.permits.acquire())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?
            .map_err(|_| sqlx::Error::PoolClosed)?;
        let mut connection = self.connection().await?;
        let result = read(&mut connection).await;
        // A database error is the server's answer to a finished statement: the connection is
        // ready for the next one. Anything else (I/O, protocol, decoding) may have left it
        // mid-message.
        if matches!(&result, Ok(_) | Err(sqlx::Error::Database(_))) {
            self.idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((connection, Instant::now()));
        }
        Ok(result?)
    }

    /// An idle connection (checked if it idled long), or a new one.
    async fn connection(&self) -> Result<AnyConnection, DbError> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((mut connection, since)) = idle else {
                break;
            };
            if since.elapsed() <= PING_IF_IDLE || connection.ping().await.is_ok() {
                return Ok(connection);
            }
        }
        let connecting = AnyConnection::connect(&self.url);
        Ok(tokio::time::timeout(ACQUIRE_TIMEOUT, connecting)
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)??)
    }
}
