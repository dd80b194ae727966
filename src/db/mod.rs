//! The task database: tenants, tasks, models, rounds, assignments and their state history.
//!
//! Embedded default: SQLite in WAL mode, `synchronous = FULL` (a commit is on disk before it is
//! acknowledged), foreign keys on, a busy timeout. Queries use `$n` placeholders and portable types
//! so the same SQL runs on PostgreSQL. Write transactions start with `BEGIN IMMEDIATE` so a
//! transaction that reads before it writes never fails on a stale snapshot.

mod assignments;
mod blobs;
pub mod device;
mod error;
mod history;
pub mod jobs;
mod models;
mod rounds;
mod tasks;
mod tenants;
pub mod writer;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, SqlitePool};

pub use blobs::StoredBlob;
pub use error::DbError;
pub use history::HistoryRecord;
pub use models::{ModelRecord, NewModel};
pub use rounds::{DeadlineOutcome, RoundRecord};
pub use tasks::{TaskCursor, TaskRecord};
pub use tenants::{NewTenant, TenantRecord};

use crate::states::StateMachine;

/// The connection type of the configured backend.
pub(crate) type Conn = sqlx::SqliteConnection;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// A handle to the task database; cheap to clone.
///
/// SQLite allows one writer at a time. Writes are jobs for one writer task that owns the write
/// connection and commits waiting jobs together (group commit, `writer.rs`): writers queue fairly
/// in the application instead of in SQLite's busy handler, and share fsyncs. Reads use their own
/// pool and run concurrently (WAL).
#[derive(Debug, Clone)]
pub struct Db {
    pool: SqlitePool,
    writer: writer::Writer,
    /// Parsed task definitions by task id (immutable once created), for the check-in hot path.
    specs: std::sync::Arc<
        std::sync::RwLock<
            std::collections::HashMap<String, std::sync::Arc<crate::task_spec::TaskSpec>>,
        >,
    >,
    /// Model version records (immutable once written), for check-in and model downloads.
    models:
        std::sync::Arc<std::sync::RwLock<std::collections::HashMap<(String, i64), ModelRecord>>>,
    /// Raw read-only connections for the check-in's read (see `read_raw`).
    raw_readers: std::sync::Arc<RawReaders>,
}

/// Read-only rusqlite connections to the database file, used synchronously on the calling task:
/// a short indexed read costs tens of microseconds, less than a round trip to a sqlx worker.
#[derive(Debug)]
struct RawReaders {
    path: std::path::PathBuf,
    idle: std::sync::Mutex<Vec<rusqlite::Connection>>,
}

/// Cached model records at most; past it the cache starts over (records are cheap to reread).
const MODEL_CACHE: usize = 100_000;

impl Db {
    /// Opens (creating if missing) the SQLite database at `path` and applies pending migrations.
    pub async fn open_sqlite(path: &Path) -> Result<Self, DbError> {
        let options = SqliteConnectOptions::from_str("sqlite://")?
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let mut connection = options.connect().await?;
        MIGRATOR.run(&mut connection).await?;
        drop(connection);
        // The writer's commits are made durable by its own sync thread (`writer.rs`).
        // ... and checkpointed by its own thread, never during a commit.
        let writer_connection = options
            .clone()
            .synchronous(SqliteSynchronous::Normal)
            .pragma("wal_autocheckpoint", "0")
            .connect()
            .await?;
        // The writer's own rusqlite connection for the raw hot paths (`writer.rs`).
        let raw_writer = rusqlite::Connection::open(path)?;
        raw_writer.busy_timeout(Duration::from_secs(10))?;
        raw_writer.execute_batch(
            "PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON; PRAGMA wal_autocheckpoint = 0",
        )?;
        let writer = writer::Writer::start(writer_connection, raw_writer, path.to_path_buf());
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await?;
        Ok(Self {
            pool,
            writer,
            specs: Default::default(),
            models: Default::default(),
            raw_readers: std::sync::Arc::new(RawReaders {
                path: path.to_path_buf(),
                idle: Default::default(),
            }),
        })
    }

    pub(crate) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Runs a write job in the writer's next group commit (see `writer.rs`).
    pub(crate) async fn write<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut Conn) -> writer::BoxFuture<'c, Result<T, DbError>>
            + Send
            + 'static,
    {
        self.writer.write(job).await
    }

    /// Runs a short read on a raw read-only connection, synchronously (for the device hot path:
    /// no thread hop). Keep `read` to a few indexed rows.
    pub(crate) fn read_raw<T>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let readers = &self.raw_readers;
        let idle = readers.idle.lock().ok().and_then(|mut idle| idle.pop());
        let connection = match idle {
            Some(connection) => connection,
            None => {
                let connection = rusqlite::Connection::open_with_flags(
                    &readers.path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                        | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
                )?;
                connection.busy_timeout(Duration::from_secs(10))?;
                connection
            }
        };
        let result = read(&connection);
        if let Ok(mut idle) = readers.idle.lock() {
            idle.push(connection);
        }
        result
    }

    /// A model version's record from the cache, or read once (records never change).
    pub(crate) fn cached_model(&self, task_id: &str, version: i64) -> Option<ModelRecord> {
        self.models
            .read()
            .ok()
            .and_then(|m| m.get(&(task_id.to_string(), version)).cloned())
    }

    pub(crate) fn cache_model(&self, record: &ModelRecord) {
        if let Ok(mut models) = self.models.write() {
            if models.len() >= MODEL_CACHE {
                models.clear();
            }
            models.insert((record.task_id.clone(), record.version), record.clone());
        }
    }

    /// Runs a job on the writer's raw SQLite handle in the next group commit (the device hot
    /// paths: no round trip per statement; see `writer.rs`).
    pub(crate) async fn write_raw<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> Result<writer::Raw<T>, DbError> + Send + 'static,
    {
        self.writer.write_raw(job).await
    }

    /// A task's parsed definition, from the cache or parsed from `spec_json` once.
    pub(crate) fn spec_of(
        &self,
        task_id: &str,
        spec_json: &str,
    ) -> Result<std::sync::Arc<crate::task_spec::TaskSpec>, DbError> {
        if let Some(spec) = self.specs.read().ok().and_then(|m| m.get(task_id).cloned()) {
            return Ok(spec);
        }
        let spec: crate::task_spec::TaskSpec = serde_json::from_str(spec_json)
            .map_err(|e| DbError::Corrupt(format!("task {task_id} spec: {e}")))?;
        let spec = std::sync::Arc::new(spec);
        if let Ok(mut cache) = self.specs.write() {
            cache.insert(task_id.to_string(), spec.clone());
        }
        Ok(spec)
    }

    /// How many entities of one kind are in each state (states with none included, as 0).
    pub async fn count_by_state<S: StateMachine>(&self) -> Result<Vec<(S, i64)>, DbError> {
        let sql = format!("SELECT state, COUNT(*) FROM {} GROUP BY state", S::TABLE);
        let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        Ok(S::ALL
            .iter()
            .map(|&state| {
                let count = rows
                    .iter()
                    .find(|(name, _)| name == state.as_str())
                    .map_or(0, |(_, n)| *n);
                (state, count)
            })
            .collect())
    }

    /// Closes every connection, checkpointing the WAL.
    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Moves one entity from `from` to `to` if the transition is allowed and the stored state is still
/// `from` (compare-and-set), and appends the history row, all on the caller's transaction.
pub(crate) async fn transition<S: StateMachine>(
    conn: &mut Conn,
    id: &str,
    from: S,
    to: S,
    reason: &str,
    now: i64,
) -> Result<(), DbError> {
    if !from.can_become(to) {
        return Err(DbError::IllegalTransition {
            entity: S::ENTITY,
            from: from.as_str(),
            to: to.as_str(),
        });
    }
    let update = format!(
        "UPDATE {} SET state = $1, updated_at = $2 WHERE id = $3 AND state = $4",
        S::TABLE
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(update))
        .bind(to.as_str())
        .bind(now)
        .bind(id)
        .bind(from.as_str())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() != 1 {
        let select = format!("SELECT state FROM {} WHERE id = $1", S::TABLE);
        let found: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(select))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        return Err(match found {
            None => DbError::NotFound {
                entity: S::ENTITY,
                id: id.to_string(),
            },
            Some(found) => DbError::StateConflict {
                entity: S::ENTITY,
                id: id.to_string(),
                expected: from.as_str(),
                found,
            },
        });
    }
    let (live, completed) = from.round_counter_deltas(to);
    if live != 0 || completed != 0 {
        sqlx::query(
            "UPDATE rounds SET live_assignments = live_assignments + $1, \
             completed_reports = completed_reports + $2 \
             WHERE id = (SELECT round_id FROM assignments WHERE id = $3)",
        )
        .bind(live)
        .bind(completed)
        .bind(id)
        .execute(&mut *conn)
        .await?;
    }
    history::append(
        conn,
        S::ENTITY,
        id,
        Some(from.as_str()),
        to.as_str(),
        reason,
        now,
    )
    .await
}

pub(crate) fn new_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Id of a history row: time-ordered (UUID v7), so each insert lands at the right edge of the
/// primary-key index. A random id put every history row on a random index page, and the device
/// path writes three per cycle: ~3 more 4 KiB pages per cycle through the WAL and checkpoints.
/// History ids are internal; nothing relies on them being unguessable.
pub(crate) fn new_history_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

pub(crate) fn parse_state<S: StateMachine>(text: &str) -> Result<S, DbError> {
    S::parse(text).ok_or_else(|| DbError::Corrupt(format!("unknown {} state {text:?}", S::ENTITY)))
}
