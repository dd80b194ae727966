//! `confed serve`: opens the data directory, starts the scheduler and serves the API over plain
//! HTTP (loopback only) or TLS (rustls), and shuts down gracefully.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::watch;

use crate::app::{AppState, Limits};
use crate::auth::AdminToken;
use crate::blob::BlobError;
use crate::clock::{Clock, SystemClock};
use crate::db::{Db, DbError, NewTenant};
use crate::keys::directory::KeyDirectory;
use crate::scheduler::Scheduler;

pub use confed_serving::{ListenError, TlsFiles, bind_app, check_listen, serve_app, serve_bound};

/// What one `confed serve` process does. Several processes with different roles can share one
/// PostgreSQL database: API replicas behind a load balancer, one or more schedulers (their
/// passes are guarded updates, so two never close a round twice), and enclave workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Role {
    /// The partner, device and worker HTTP APIs.
    Api,
    /// Round deadlines and assignment expiry.
    Scheduler,
    /// The in-process enclave worker (embedded key services and the dev attester only; in
    /// production, enclave workers are `confed-enclave` processes in Confidential Space).
    EnclaveWorker,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Api, Role::Scheduler, Role::EnclaveWorker];
}

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// At least one; `Role::ALL` unless the operator chose.
    pub roles: Vec<Role>,
    pub data_dir: PathBuf,
    /// The task database when it is not the data directory's SQLite file: a PostgreSQL URL.
    pub database: Option<String>,
    /// Google Cloud Storage instead of the data directory's blobs and contribution log.
    pub blobs: Option<crate::blob::GcsConfig>,
    /// Key services whose signed key sets go into assignments (base URLs).
    pub keyservices: Vec<String>,
    pub listen: SocketAddr,
    pub tls: Option<TlsFiles>,
    pub admin: Option<AdminToken>,
    /// Enables the worker API for `confed-enclave` processes.
    pub worker_token: Option<AdminToken>,
    pub limits: Limits,
    pub scheduler_period: Duration,
    /// How long a closed round's contributions are kept (docs/operations.md, "Retention").
    pub retention: Duration,
    /// Which fitting task a checking-in device serves first.
    pub scheduling: crate::scheduling::SchedulingPolicy,
    /// How large rounds are cut into partitions for several enclave workers.
    pub partitioning: crate::aggregation::partitions::PartitionPolicy,
    /// Loopback ports the embedded key services take (none: any free ones).
    pub embedded_ports: Option<crate::ports::PortRange>,
}

/// How often the retention pass runs.
const RETENTION_PERIOD: Duration = Duration::from_secs(120);
/// A contribution-log segment written more recently than this is never deleted: far longer than
/// the request timeout, which bounds the gap between a record's write and its row's commit.
const RETENTION_IDLE: Duration = Duration::from_secs(600);

#[derive(Debug, Error)]
pub enum ServeError {
    #[error(
        "--role enclave-worker runs the in-process worker, which only the embedded key services trust (dev attester); with --keyservice, run confed-enclave in a TEE instead"
    )]
    WorkerNeedsEmbeddedKeyServices,
    #[error("cannot use data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Listen(#[from] ListenError),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
    #[cfg(feature = "embedded")]
    #[error(transparent)]
    Embedded(#[from] crate::embedded::serve::EmbeddedError),
    #[error(
        "no --keyservice given, and this confed was built without the `embedded` feature (in-process key services and enclave worker): pass --keyservice URL for each key service, and run enclave workers as confed-enclave processes"
    )]
    NotEmbedded,
}

/// The database file inside a data directory.
pub fn database_path(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("confed.db")
}

/// Opens the task database: `database` (a PostgreSQL URL) if given, else the data directory's
/// SQLite file (created if missing). The flag is `true` for a SQLite file that did not exist
/// before (a first start, which gets a demo tenant); a shared PostgreSQL database never gets
/// one: its operator creates tenants (`confed tenant create`, the admin API).
pub async fn open_data_dir(
    data_dir: &std::path::Path,
    database: Option<&str>,
) -> Result<(Db, bool), ServeError> {
    let data_dir_error = |source| ServeError::DataDir {
        path: data_dir.to_path_buf(),
        source,
    };
    owner_only_dir(data_dir).map_err(data_dir_error)?;
    if let Some(url) = database {
        return Ok((Db::open(url).await?, false));
    }
    let path = database_path(data_dir);
    let fresh = !path.exists();
    let db = Db::open_sqlite(&path).await?;
    // SQLite creates its files with the process umask; they hold tenant token digests.
    for suffix in ["", "-wal", "-shm"] {
        let file = std::path::PathBuf::from(format!("{}{suffix}", path.display()));
        if file.exists() {
            owner_only(&file, 0o600).map_err(data_dir_error)?;
        }
    }
    Ok((db, fresh))
}

/// Creates `dir` (and its parents) owner-only, or tightens an existing one to 0700: it holds
/// tenant token digests, contributions and (embedded) key shares.
pub fn owner_only_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    owner_only(dir, 0o700)
}

fn owner_only(path: &std::path::Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let current = std::fs::metadata(path)?.permissions().mode() & 0o777;
    if current & 0o077 != 0 {
        tracing::warn!(path = %path.display(), from = format!("{current:o}"), to = format!("{mode:o}"),
            "tightening permissions to owner-only");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Runs the server until `shutdown` completes, then drains requests, stops the scheduler and
/// closes the database.
pub async fn serve(
    config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let has = |role| config.roles.contains(&role);
    if has(Role::EnclaveWorker) && !config.keyservices.is_empty() {
        return Err(ServeError::WorkerNeedsEmbeddedKeyServices);
    }
    // Before anything is created or printed: without the embedded default there are no key
    // services to fall back on.
    #[cfg(not(feature = "embedded"))]
    if (has(Role::Api) || has(Role::EnclaveWorker)) && config.keyservices.is_empty() {
        return Err(ServeError::NotEmbedded);
    }
    // Every role listens: the API on its routes, the others for /metrics, /healthz and
    // /readyz alone. Bound before the data directory is created or a token printed, so a busy
    // port stops a first start before it leaves anything behind.
    let bound = if has(Role::Api) {
        bind_app(config.listen, config.tls.as_ref()).await?
    } else {
        confed_serving::bind_ops_only(config.listen, config.tls.as_ref()).await?
    };
    // Before any role runs: their first records must reach the recorder.
    crate::api::ops::install_metrics();
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let (db, fresh) = open_data_dir(&config.data_dir, config.database.as_deref()).await?;
    let db = db.with_clock(clock.clone());
    // Every role: a scheduler's retention would otherwise delete the rows naming them.
    db.refuse_contributions_in_the_database().await?;
    if fresh {
        create_demo_tenant(&db).await?;
    } else if has(Role::Api) && config.database.is_none() {
        // The demo token was shown once, on the first start: say how to get another.
        let tenants = db.list_tenants().await?.len();
        println!(
            "confed: {tenants} tenant(s) in {dir}; a new one, with its token: confed tenant create NAME --data-dir {dir}",
            dir = config.data_dir.display()
        );
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut background = Vec::new();
    let mut app = None;
    let mut open_contributions = None;
    if has(Role::Api) || has(Role::EnclaveWorker) {
        let (blobs, contributions) =
            crate::blob::open_stores(&config.data_dir, config.blobs.as_ref()).await?;
        open_contributions = Some(contributions.clone());
        let keys = KeyDirectory::default();
        let embedded_worker = if config.keyservices.is_empty() {
            // Refused at the start already; kept so this branch never runs without key services.
            #[cfg(not(feature = "embedded"))]
            return Err(ServeError::NotEmbedded);
            #[cfg(feature = "embedded")]
            {
                let (worker_config, tasks) = crate::embedded::serve::start_enclave(
                    &config.data_dir,
                    &clock,
                    &keys,
                    stop_rx.clone(),
                    config.embedded_ports,
                )
                .await?;
                background.extend(tasks);
                Some(worker_config)
            }
        } else {
            keys.spawn_refresh(
                config.keyservices.clone(),
                crate::keys::directory::REFRESH_PERIOD,
            );
            None
        };
        if has(Role::Api) {
            // The key services a masked round's uploads are handed to ahead of its sums.
            let keyservice_urls = match &embedded_worker {
                #[cfg(feature = "embedded")]
                Some(worker_config) => worker_config
                    .key_services
                    .iter()
                    .map(|e| e.url.clone())
                    .collect(),
                _ => config.keyservices.clone(),
            };
            let (mask_preparer, preparing) = crate::uploads::mask_prepare::MaskPreparer::spawn(
                db.clone(),
                blobs.clone(),
                (keys.clone(), keyservice_urls),
                stop_rx.clone(),
            );
            background.extend(preparing);
            app = Some(crate::web::router(AppState {
                db: db.clone(),
                blobs: blobs.clone(),
                contributions: contributions.clone(),
                admin: config.admin.clone(),
                limits: config.limits,
                keys: keys.clone(),
                registry: Default::default(),
                worker_token: config.worker_token.clone(),
                console: crate::app::ConsoleSettings {
                    secure_cookies: config.tls.is_some(),
                    ..Default::default()
                },
                scheduling: config.scheduling,
                partitioning: config.partitioning,
                device_auth: Default::default(),
                mask_preparer,
            }));
        }
        #[cfg(feature = "embedded")]
        if let (true, Some(worker_config)) = (has(Role::EnclaveWorker), embedded_worker) {
            let store = crate::aggregation::TaskDbJobStore {
                db: db.clone(),
                blobs,
                contributions,
                keys: keys.clone(),
                partitioning: config.partitioning,
            };
            let worker = confed_enclave::worker::Worker::new(Arc::new(store), worker_config);
            background.push(tokio::spawn(crate::embedded::serve::run_worker(
                worker,
                db.clone(),
                Duration::from_secs(1),
                stop_rx.clone(),
            )));
        }
        #[cfg(not(feature = "embedded"))]
        let _: Option<std::convert::Infallible> = embedded_worker;
    }
    if has(Role::Scheduler) {
        let retention = crate::retention::Retention::new(
            db.clone(),
            open_contributions,
            config.retention,
            RETENTION_IDLE,
        );
        background.push(tokio::spawn(
            retention.run(RETENTION_PERIOD, stop_rx.clone()),
        ));
        background.push(tokio::spawn(
            Scheduler::new(db.clone()).run(config.scheduler_period, stop_rx),
        ));
    }
    tracing::info!(roles = ?config.roles, admin_api = config.admin.is_some(), data_dir = %config.data_dir.display(), "starting");
    let app = match app {
        Some(app) => app,
        None => {
            println!(
                "confed: running {:?} (no API role: serving /metrics, /healthz and /readyz only)",
                config.roles
            );
            let probed = db.clone();
            let readiness: confed_ops::Readiness = Arc::new(move || {
                let db = probed.clone();
                Box::pin(async move {
                    db.count_by_state::<crate::states::TaskState>()
                        .await
                        .map(drop)
                        .map_err(|error| {
                            // The details (host, user) go to the log, not to whoever probes.
                            tracing::warn!(%error, "readiness: the task database does not answer");
                            "the task database does not answer (the log says why)".to_string()
                        })
                })
            });
            confed_serving::ops::ops_router("scheduler", readiness)
        }
    };
    let result = serve_bound(bound, app, shutdown).await;
    tracing::info!("stopping the background roles");
    let _ = stop_tx.send(true);
    for task in background {
        let _ = task.await;
    }
    db.close().await;
    tracing::info!("shut down cleanly");
    Ok(result?)
}

/// On the first start of an empty data directory, a tenant `demo` lets a new user try the API at
/// once. Its token is printed this once, on stdout, and never logged.
async fn create_demo_tenant(db: &Db) -> Result<(), ServeError> {
    let demo = NewTenant {
        name: "demo".into(),
        max_active_tasks: crate::api::admin::DEFAULT_MAX_ACTIVE_TASKS,
        max_report_goal: crate::api::admin::DEFAULT_MAX_REPORT_GOAL,
        max_device_hours: crate::api::admin::DEFAULT_MAX_DEVICE_HOURS,
    };
    let (_, token) = db.create_tenant(&demo).await?;
    println!(
        "confed: new data directory; created tenant `demo`. Its API token, shown only this once:"
    );
    println!("CONFED_DEMO_TOKEN={}", token.as_str());
    Ok(())
}
