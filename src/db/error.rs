use thiserror::Error;

/// Errors of the task database layer.
#[derive(Debug, Error)]
pub enum DbError {
    #[error("database error: {0}")]
    Sqlx(#[from] sqlx::Error),
    /// From the writer's raw fast paths (`writer::Raw`).
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{entity} {id} not found")]
    NotFound { entity: &'static str, id: String },
    #[error("{entity} {id} is {found}, not {expected}")]
    StateConflict {
        entity: &'static str,
        id: String,
        expected: &'static str,
        found: String,
    },
    #[error("a {entity} cannot move from {from} to {to}")]
    IllegalTransition {
        entity: &'static str,
        from: &'static str,
        to: &'static str,
    },
    /// A task would take the tenant over its compute budget (a request to change, so 400).
    #[error("{0}")]
    ComputeBudget(String),
    #[error("quota `{quota}` is {limit}: {detail}")]
    QuotaExceeded {
        quota: &'static str,
        limit: i64,
        detail: String,
    },
    #[error(
        "population {0:?} belongs to another tenant; choose another population, or ask the operator to assign it"
    )]
    PopulationTaken(String),
    #[error("{0} already exists")]
    AlreadyExists(String),
    /// A request the task's definition or state does not allow now (409), saying why.
    #[error("{0}")]
    Conflict(String),
    #[error("the lease on aggregation job {0} is held by another worker (or the job is finished)")]
    LeaseLost(String),
    /// A lease length whose expiry the database cannot record (Unix ms in an i64).
    #[error("a lease of {0:?} is longer than the database can record")]
    LeaseTooLong(std::time::Duration),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("the write was not committed: {0}")]
    Commit(CommitFailure),
    /// The database holds what an earlier release left and this one cannot read: run the
    /// upgrade step the message names first.
    #[error("{0}")]
    Upgrade(&'static str),
    #[error("could not issue a token: {0}")]
    Token(#[from] crate::auth::AuthError),
}

/// Why a write was not committed or not made durable, as callers branch on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitFailure {
    pub cause: CommitCause,
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitCause {
    /// The disk under the database is full (SQLITE_FULL, ENOSPC): 507, retry later.
    DiskFull,
    /// The writer or batcher is gone (shutting down): nothing more is written.
    Stopped,
    /// Anything else the commit or the sync reported.
    Failed,
}

impl std::fmt::Display for CommitFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl CommitFailure {
    pub fn new(cause: CommitCause, detail: impl Into<String>) -> Self {
        Self {
            cause,
            detail: detail.into(),
        }
    }

    /// From an I/O error of the WAL's sync (ENOSPC is a full disk).
    pub fn io(what: &str, error: &std::io::Error) -> Self {
        let cause = if crate::blob::is_disk_full(error) {
            CommitCause::DiskFull
        } else {
            CommitCause::Failed
        };
        Self::new(cause, format!("{what}: {error}"))
    }

    /// From the database's own error (its full-disk codes kept).
    pub fn of(error: DbError) -> Self {
        match error {
            DbError::Commit(failure) => failure,
            other => {
                let cause = if other.is_disk_full() {
                    CommitCause::DiskFull
                } else {
                    CommitCause::Failed
                };
                Self::new(cause, other.to_string())
            }
        }
    }
}

impl DbError {
    /// Counts and logs this error if it is an outage (the disk full, the database unreachable)
    /// and says whether it was: the API and the worker API answer outages with a retry, and
    /// the alerts read these counters (`confed_disk_full_total`,
    /// `confed_database_unavailable_total`).
    pub fn note_outage(&self) -> bool {
        if self.is_disk_full() {
            crate::blob::note_disk_full(self);
            true
        } else if self.is_unavailable() {
            metrics::counter!("confed_database_unavailable_total").increment(1);
            tracing::warn!(error = %self, "task database unavailable");
            true
        } else {
            false
        }
    }

    /// The database could not be reached (no connection within the pool's acquire timeout, the
    /// pool closed, the connection refused or broken): worth a retry (503 with `Retry-After`),
    /// not a server fault (500).
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Sqlx(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => true,
            Self::Sqlx(sqlx::Error::Io(e)) => !crate::blob::is_disk_full(e),
            Self::Sqlx(sqlx::Error::Tls(_)) => true,
            // PostgreSQL going down under a connection: `57P01` admin_shutdown, `57P02`
            // crash_shutdown, `57P03` cannot_connect_now (starting up or shutting down), and the
            // connection exceptions `08000`, `08001`, `08003`, `08006` (not `08P01`, a protocol
            // violation, nor `57P04`, a dropped database: those are faults, not outages), and
            // `53300` too_many_connections (every connection slot taken, by replicas together).
            Self::Sqlx(sqlx::Error::Database(e)) => e.code().is_some_and(|code| {
                matches!(
                    &*code,
                    "57P01" | "57P02" | "57P03" | "08000" | "08001" | "08003" | "08006" | "53300"
                )
            }),
            _ => false,
        }
    }

    /// An error of this one's class (unavailable: 503; a full disk: 507; anything else: 500)
    /// with its text, for another caller of the statement that failed (`DbError` is not
    /// `Clone`: sqlx's errors are not).
    pub(crate) fn of_the_same_class(&self) -> DbError {
        let text = match self {
            Self::Sqlx(error) => error.to_string(),
            other => other.to_string(),
        };
        let io = |kind| Self::Sqlx(sqlx::Error::Io(std::io::Error::new(kind, text.clone())));
        if self.is_disk_full() {
            io(std::io::ErrorKind::StorageFull)
        } else if self.is_unavailable() {
            io(std::io::ErrorKind::ConnectionAborted)
        } else {
            Self::Sqlx(sqlx::Error::Protocol(text))
        }
    }

    /// Whether the database failed because its disk is full: SQLite's SQLITE_FULL ("database or
    /// disk is full"), PostgreSQL's `53100 disk_full`, or ENOSPC from below either.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Self::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => {
                e.code == rusqlite::ErrorCode::DiskFull
            }
            Self::Sqlx(sqlx::Error::Io(e)) => crate::blob::is_disk_full(e),
            Self::Sqlx(sqlx::Error::Database(e)) => {
                e.code().as_deref() == Some("53100")
                    || e.code().as_deref() == Some("13")
                    || e.message().contains("database or disk is full")
            }
            Self::Commit(failure) => failure.cause == CommitCause::DiskFull,
            _ => false,
        }
    }

    /// Whether the error is a unique-constraint violation (e.g. a duplicate tenant name).
    pub(crate) fn is_unique_violation(error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(e) if e.is_unique_violation())
    }
}

#[cfg(test)]
mod commit_failure_tests {
    use super::*;

    #[test]
    fn an_error_copied_for_another_caller_keeps_its_class() {
        let outage = DbError::Sqlx(sqlx::Error::PoolTimedOut);
        assert!(outage.of_the_same_class().is_unavailable());
        let full = DbError::Sqlx(sqlx::Error::Io(std::io::Error::from_raw_os_error(
            libc::ENOSPC,
        )));
        assert!(
            full.of_the_same_class().is_disk_full(),
            "507, not 503 or 500"
        );
        let fault = DbError::Sqlx(sqlx::Error::RowNotFound);
        assert!(!fault.of_the_same_class().is_unavailable());
        assert!(!fault.of_the_same_class().is_disk_full());
        assert!(
            fault
                .of_the_same_class()
                .to_string()
                .contains(&sqlx::Error::RowNotFound.to_string())
        );
    }

    #[test]
    fn a_full_disk_is_known_by_its_code_not_by_the_text_of_a_message() {
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let full = DbError::Commit(CommitFailure::io("fsync of t.db-wal", &enospc));
        assert!(full.is_disk_full());
        let eio = std::io::Error::from_raw_os_error(libc::EIO);
        assert!(!DbError::Commit(CommitFailure::io("fsync of t.db-wal", &eio)).is_disk_full());
        let sqlite_full = DbError::Sqlite(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_FULL),
            None,
        ));
        assert_eq!(CommitFailure::of(sqlite_full).cause, CommitCause::DiskFull);
        // A message that merely says so is not a full disk.
        let said = CommitFailure::new(CommitCause::Failed, "No space left on device");
        assert!(!DbError::Commit(said).is_disk_full());
    }
}
