//! The task database: tenants, tasks, models, rounds, assignments and their state history.
//!
//! Two engines behind one `Db`, chosen at open time:
//! - SQLite (the embedded default): WAL mode, nothing acknowledged before it is on disk, foreign
//!   keys on, a busy timeout. SQLite has one writer: writes are jobs for one writer thread that
//!   commits waiting jobs together (group commit, `writer.rs`); the device hot paths run on its
//!   raw rusqlite handle. Reads use their own pool and run concurrently (WAL).
//! - PostgreSQL (scale-out): any number of servers and workers share one database. A write job
//!   is a transaction on a pooled connection; races between replicas are settled by row locks
//!   (guarded `UPDATE`s, which PostgreSQL re-checks after waiting on the row, and `FOR UPDATE
//!   SKIP LOCKED` where work is handed out).
//!
//! Queries go through sqlx's `Any` driver with `$n` placeholders and types both engines share
//! (BIGINT, TEXT, BYTEA/BLOB), so the same SQL runs on both wherever it can; the few
//! engine-specific statements branch on `Db::engine`. Migrations for each engine live in
//! `migrations/<engine>/`.

mod assignments;
mod blobs;
pub mod device;
mod error;
pub mod evaluations;
mod history;
pub mod jobs;
pub mod leases;
mod listing;
mod models;
pub mod partitions;
pub mod populations;
mod postgres;
pub mod progress;
mod resume;
mod retention;
mod rounds;
mod sessions;
mod sqlite;
mod tasks;
mod tenants;
pub mod writer;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Connection, Executor};

pub use error::{CommitCause, CommitFailure, DbError};
pub use evaluations::{EvaluationPoint, point_of};
pub use history::HistoryRecord;
pub use models::{ModelRecord, NewModel};
pub use resume::Resumed;
pub use rounds::{DeadlineOutcome, RoundRecord};
pub use tasks::{TaskCursor, TaskRecord};
pub use tenants::{NewTenant, TenantRecord};

use crate::clock::{Clock, Millis, SystemClock};
use crate::states::StateMachine;

/// The connection type of both engines (sqlx's `Any` driver).
pub(crate) type Conn = sqlx::AnyConnection;

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

/// Which engine a `Db` runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

/// A handle to the task database; cheap to clone.
#[derive(Debug, Clone)]
pub struct Db {
    pool: AnyPool,
    sqlite: Option<SqliteParts>,
    /// Parsed task definitions by task id (immutable once created), for the check-in hot path.
    specs: std::sync::Arc<
        std::sync::RwLock<
            std::collections::HashMap<String, std::sync::Arc<crate::task_spec::TaskSpec>>,
        >,
    >,
    /// Model version records (immutable once written), for check-in and model downloads.
    models:
        std::sync::Arc<std::sync::RwLock<std::collections::HashMap<(String, i64), ModelRecord>>>,
    /// Signalled when this process created an aggregation job (a round closed), so an in-process
    /// worker leases it at once instead of at its next poll.
    jobs_created: Arc<tokio::sync::Notify>,
    /// PostgreSQL: the task that raises `jobs_created` when another replica closes a round.
    _job_listener: Option<Arc<postgres::notify::Listener>>,
    /// PostgreSQL: the group-commit queue of the device writes that lock a round's row.
    device_batches: Option<postgres::batch::Batcher>,
    /// PostgreSQL: the device path's reads, grouped into shared statements
    /// (`postgres/grouped.rs`) on connections of their own (`postgres/readers.rs`).
    device_reads: Option<Arc<postgres::device::DeviceReads>>,
    /// The store's time: every write stamps and compares with it (`now`), so a caller cannot
    /// hand one write a time another did not see. The system clock unless `with_clock`.
    clock: Arc<dyn Clock>,
}

/// What only the SQLite engine has: the group-commit writer and raw read connections.
#[derive(Debug, Clone)]
struct SqliteParts {
    writer: writer::Writer,
    /// Raw read-only connections for the check-in's read (see `read_raw`).
    raw_readers: Arc<RawReaders>,
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

/// Per-connection SQLite settings (journal mode is a property of the file, set at migration).
const SQLITE_PRAGMAS: &str =
    "PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 10000; PRAGMA synchronous = FULL";

/// An sqlx URL for the SQLite file at `path` (`?` `#` `%` escaped: the rest of a path is
/// taken literally).
fn sqlite_url(path: &Path) -> String {
    let mut url = String::from("sqlite://");
    for c in path.display().to_string().chars() {
        match c {
            '%' => url.push_str("%25"),
            '?' => url.push_str("%3F"),
            '#' => url.push_str("%23"),
            ' ' => url.push_str("%20"),
            c => url.push(c),
        }
    }
    url.push_str("?mode=rwc");
    url
}

impl Db {
    /// This handle (and its clones) with `clock` as the store's time: the server's clock, or a
    /// test's manual one.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The store's time now (Unix ms).
    pub fn now(&self) -> Millis {
        self.clock.now_millis()
    }

    /// Opens the task database `location` names: a `postgres://` or `postgresql://` URL, or
    /// else the path of a SQLite file (created if missing). Applies pending migrations.
    pub async fn open(location: &str) -> Result<Self, DbError> {
        if location.starts_with("postgres://") || location.starts_with("postgresql://") {
            Self::open_postgres(location).await
        } else {
            Self::open_sqlite(Path::new(location)).await
        }
    }

    /// Which engine this database runs on.
    pub fn engine(&self) -> Engine {
        if self.sqlite.is_some() {
            Engine::Sqlite
        } else {
            Engine::Postgres
        }
    }

    /// Opens (creating if missing) the SQLite database at `path` and applies pending migrations.
    pub async fn open_sqlite(path: &Path) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        let url = sqlite_url(path);
        let mut connection = sqlx::AnyConnection::connect(&url).await?;
        sqlx::raw_sql("PRAGMA journal_mode = WAL")
            .execute(&mut connection)
            .await?;
        sqlx::raw_sql(SQLITE_PRAGMAS)
            .execute(&mut connection)
            .await?;
        SQLITE_MIGRATOR.run(&mut connection).await?;
        drop(connection);
        // The writer's commits are made durable by its own sync thread (`writer.rs`) and
        // checkpointed by its own thread, never during a commit.
        let mut writer_connection = sqlx::AnyConnection::connect(&url).await?;
        sqlx::raw_sql("PRAGMA busy_timeout = 10000")
            .execute(&mut writer_connection)
            .await?;
        sqlx::raw_sql(writer::WRITER_PRAGMAS)
            .execute(&mut writer_connection)
            .await?;
        // The writer's own rusqlite connection for the raw hot paths (`writer.rs`).
        let raw_writer = rusqlite::Connection::open(path)?;
        raw_writer.busy_timeout(Duration::from_secs(10))?;
        raw_writer.execute_batch(writer::WRITER_PRAGMAS)?;
        let writer = writer::Writer::start(writer_connection, raw_writer, path.to_path_buf());
        let pool = AnyPoolOptions::new()
            .max_connections(8)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute(sqlx::raw_sql(SQLITE_PRAGMAS)).await?;
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        Ok(Self {
            pool,
            sqlite: Some(SqliteParts {
                writer,
                raw_readers: Arc::new(RawReaders {
                    path: path.to_path_buf(),
                    idle: Default::default(),
                }),
            }),
            specs: Default::default(),
            clock: Arc::new(SystemClock),
            models: Default::default(),
            jobs_created: Default::default(),
            _job_listener: None,
            device_batches: None,
            device_reads: None,
        })
    }

    /// Connects to PostgreSQL at `url` and applies pending migrations (sqlx's migrator holds an
    /// advisory lock meanwhile, so replicas starting together migrate once).
    pub async fn open_postgres(url: &str) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        // A request that cannot get a connection within 2 s answers 503 with Retry-After
        // (`DbError::is_unavailable`) instead of holding the client 30 s for a 500. sqlx checks
        // every connection as it returns to the pool (a round trip), so one that failed is
        // dropped there; a connection idle for longer than `PING_IF_IDLE` is checked again
        // before it is handed out, so one that PostgreSQL dropped while it was down is replaced
        // rather than failing the next request. A connection used within that second is not
        // checked again (the second round trip per statement cost a sixth of the device
        // cycles): after a restart under load, each such connection fails one request (503)
        // before it is replaced.
        let pool = AnyPoolOptions::new()
            .max_connections(postgres::readers::MAX_POOLED)
            .acquire_timeout(postgres::readers::ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for > postgres::readers::PING_IF_IDLE {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect(url)
            .await?;
        POSTGRES_MIGRATOR.run(&pool).await?;
        let jobs_created = Arc::new(tokio::sync::Notify::new());
        let listener = postgres::notify::listen(url, Arc::clone(&jobs_created)).await;
        let device_batches = postgres::batch::Batcher::start(url);
        Ok(Self {
            pool,
            sqlite: None,
            specs: Default::default(),
            clock: Arc::new(SystemClock),
            models: Default::default(),
            jobs_created,
            _job_listener: listener.map(Arc::new),
            device_batches: Some(device_batches),
            device_reads: Some(Arc::new(postgres::device::DeviceReads::new(url))),
        })
    }

    pub(crate) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Tells an in-process worker that a job is ready to lease (call once its row is committed,
    /// or on SQLite, queued before the worker's lease: the single writer orders them). A permit
    /// is kept if no worker is waiting, so a busy worker looks again when it is done.
    pub(crate) fn job_created(&self) {
        self.jobs_created.notify_one();
    }

    /// `job_created`, after the commit, for every process: on PostgreSQL the other replicas hear
    /// it too (`postgres::notify`). A failed announcement is logged, not returned: the job is
    /// committed and other processes still find it at their next poll.
    pub async fn announce_job(&self) {
        self.job_created();
        if self.sqlite.is_none()
            && let Err(error) = sqlx::query(postgres::notify::ANNOUNCE_SQL)
                .bind(postgres::notify::CHANNEL)
                .execute(&self.pool)
                .await
        {
            tracing::warn!(%error, "could not announce a new aggregation job to other replicas");
        }
    }

    /// The signal `job_created` raises, for a closure that outlives `&self` (the SQLite writer's).
    pub(crate) fn job_signal(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.jobs_created)
    }

    /// Completes when this process created an aggregation job since the last call.
    pub async fn job_ready(&self) {
        self.jobs_created.notified().await;
    }

    /// Runs a write job atomically: in the SQLite writer's next group commit (see `writer.rs`),
    /// or as one PostgreSQL transaction. Either way it returns once the commit is durable.
    pub(crate) async fn write<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut Conn) -> writer::BoxFuture<'c, Result<T, DbError>>
            + Send
            + 'static,
    {
        match &self.sqlite {
            Some(sqlite) => sqlite.writer.write(job).await,
            None => {
                let mut tx = self.pool.begin().await?;
                match job(&mut tx).await {
                    Ok(value) => {
                        tx.commit().await?;
                        Ok(value)
                    }
                    Err(error) => {
                        // Roll back now: a dropped transaction is rolled back only when its
                        // connection is next used, and until then keeps its row locks (a job
                        // row locked by a refused renewal was skipped by the next lease).
                        let _ = tx.rollback().await;
                        Err(error)
                    }
                }
            }
        }
    }

    /// PostgreSQL's grouped device reads.
    pub(in crate::db) fn device_reads(&self) -> Result<&postgres::device::DeviceReads, DbError> {
        self.device_reads.as_deref().ok_or_else(|| {
            DbError::Corrupt("a PostgreSQL-only path was called on SQLite (a bug)".into())
        })
    }

    /// `write` for a job that may share its transaction with others, as `item` of their sets
    /// (`settle` reads the sets' answer; `None`: run `job`), and run again alone if the shared
    /// one fails (`postgres::batch`: PostgreSQL's device writes); on SQLite, `write` (its writer
    /// batches every job already).
    pub(in crate::db) async fn batched_write<T, S, F>(
        &self,
        item: postgres::sets::SetItem,
        settle: S,
        job: F,
    ) -> Result<T, DbError>
    where
        T: Send + 'static,
        S: Fn(&postgres::sets::SetOutcome) -> Option<T> + Send + Sync + 'static,
        F: for<'c> Fn(&'c mut Conn) -> writer::BoxFuture<'c, Result<T, DbError>>
            + Send
            + Sync
            + 'static,
    {
        match &self.device_batches {
            Some(batches) => batches.write(item, settle, job).await,
            None => self.write(job).await,
        }
    }

    /// Runs a short read on a raw read-only connection, synchronously (for the device hot path:
    /// no thread hop). Keep `read` to a few indexed rows.
    pub(crate) fn read_raw<T>(
        &self,
        read: impl FnOnce(&rusqlite::Connection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let readers = &self.sqlite_parts()?.raw_readers;
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

    /// Runs a job on the writer's raw SQLite handle in the next group commit, whole in its own
    /// savepoint (the device store: no round trip per statement; see `writer.rs`).
    pub(crate) async fn write_raw<T, F>(&self, job: F) -> Result<T, DbError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Connection) -> Result<T, DbError> + Send + 'static,
    {
        self.sqlite_parts()?.writer.write_raw(job).await
    }

    fn sqlite_parts(&self) -> Result<&SqliteParts, DbError> {
        self.sqlite.as_ref().ok_or_else(|| {
            DbError::Corrupt("a SQLite-only path was called on PostgreSQL (a bug)".into())
        })
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

    /// Closes every connection (on SQLite, checkpointing the WAL).
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
    now: Millis,
) -> Result<(), DbError> {
    let now = now.0;
    if !from.can_become(to) {
        return Err(DbError::IllegalTransition {
            entity: S::ENTITY,
            from: from.as_str(),
            to: to.as_str(),
        });
    }
    let update = format!(
        "UPDATE {} SET state = $1, updated_at = $2 WHERE {} = $3 AND state = $4",
        S::TABLE,
        S::KEY
    );
    let done = sqlx::query(sqlx::AssertSqlSafe(update))
        .bind(to.as_str())
        .bind(now)
        .bind(id)
        .bind(from.as_str())
        .execute(&mut *conn)
        .await?;
    if done.rows_affected() != 1 {
        let select = format!("SELECT state FROM {} WHERE {} = $1", S::TABLE, S::KEY);
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
        Millis(now),
    )
    .await
}

/// `clause` (a row-locking suffix such as ` FOR UPDATE`) on PostgreSQL; nothing on SQLite, whose
/// single writer already runs every write transaction alone.
pub(crate) fn lock_clause(conn: &Conn, clause: &'static str) -> &'static str {
    if conn.backend_name() == "PostgreSQL" {
        clause
    } else {
        ""
    }
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
