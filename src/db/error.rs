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
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("the write was not committed: {0}")]
    Commit(String),
    #[error("could not issue a token: {0}")]
    Token(#[from] crate::auth::AuthError),
}

impl DbError {
    /// Whether the database failed because its disk is full: SQLite's SQLITE_FULL ("database or
    /// disk is full"), PostgreSQL's `53100 disk_full`, or ENOSPC from below either.
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
            // violation, nor `57P04`, a dropped database: those are faults, not outages).
            Self::Sqlx(sqlx::Error::Database(e)) => e.code().is_some_and(|code| {
                matches!(
                    &*code,
                    "57P01" | "57P02" | "57P03" | "08000" | "08001" | "08003" | "08006"
                )
            }),
            _ => false,
        }
    }

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
            Self::Commit(message) => {
                message.contains("database or disk is full")
                    || message.contains("No space left on device")
            }
            _ => false,
        }
    }

    /// Whether the error is a unique-constraint violation (e.g. a duplicate tenant name).
    pub(crate) fn is_unique_violation(error: &sqlx::Error) -> bool {
        matches!(error, sqlx::Error::Database(e) if e.is_unique_violation())
    }
}
