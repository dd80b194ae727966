//! The whole system in one process: n key services (each with one share, the dev policy and its
//! own audit log), the task and device APIs, the scheduler, and an enclave worker attesting with
//! the DEV attester. This is what `confed demo` runs and what the end-to-end tests drive.
//!
//! DEV ONLY: the dev attester proves nothing (no TEE), so the privacy of this setup rests on the
//! one process that holds every share. Production runs the enclave in Confidential Space and the
//! key services as separately operated processes (see docs/architecture.md).

pub mod keyservices;
pub mod serve;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use confed_attestation::DevAttester;
use confed_attestation::exchange::generate_signing_key;
use confed_enclave::key_collection::KeyServiceEndpoint;
use confed_enclave::worker::{Worker, WorkerConfig};
use thiserror::Error;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::aggregation::TaskDbJobStore;
use crate::app::{AppState, Limits};
use crate::clock::Clock;
use crate::db::{Db, NewTenant};
use crate::keys::directory::KeyDirectory;
use crate::scheduler::Scheduler;
use confed_protocol::trust::TrustConfig;
use serve::run_worker;

#[derive(Debug, Error)]
pub enum EmbeddedError {
    #[error("{0}")]
    Setup(String),
}

fn setup(e: impl std::fmt::Display) -> EmbeddedError {
    EmbeddedError::Setup(e.to_string())
}

pub struct EmbeddedOptions {
    pub data_dir: PathBuf,
    pub keyservices: u16,
    pub threshold: u16,
    pub clock: Arc<dyn Clock>,
    /// Run an enclave worker in the background (tests that drive workers themselves say no).
    pub background_worker: bool,
    pub scheduler_period: Duration,
    /// Enables the worker API (`/internal/v1`) for out-of-process enclave workers.
    pub worker_token: Option<crate::auth::AdminToken>,
    /// The dev attester's signing key (default: a fresh one). Given, a `confed-enclave --attester
    /// dev` process holding the same key is trusted by these key services.
    pub attester_key: Option<p256::ecdsa::SigningKey>,
    /// The task database (`Db::open`: a PostgreSQL URL or a SQLite path); default
    /// `<data dir>/confed.db`.
    pub database: Option<String>,
    /// GCS (or its emulator) instead of the data directory's blobs and contribution log.
    pub blobs: Option<crate::blob::GcsConfig>,
    /// How large rounds are cut into partitions (default: never).
    pub partitioning: crate::aggregation::partitions::PartitionPolicy,
    /// Where the key services and the API listen on loopback (default: ports the system picks).
    pub ports: Option<crate::ports::PortRange>,
}

pub struct EmbeddedSystem {
    /// Base URL of the task and device APIs.
    pub url: String,
    pub db: Db,
    pub store: Arc<TaskDbJobStore>,
    pub keyservices: Vec<KeyServiceEndpoint>,
    /// What devices trust: the key services' signing keys and the threshold.
    pub trust: TrustConfig,
    pub attester: Arc<DevAttester>,
    pub threshold: u16,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

async fn serve_router(
    router: axum::Router,
    stop: watch::Receiver<bool>,
    ports: Option<crate::ports::PortRange>,
) -> Result<(String, JoinHandle<()>), EmbeddedError> {
    let listener = crate::ports::bind_loopback(ports).await.map_err(setup)?;
    let url = format!("http://{}", listener.local_addr().map_err(setup)?);
    let handle = tokio::spawn(async move {
        let mut stop = stop;
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(error) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(%error, "embedded server stopped");
        }
    });
    Ok((url, handle))
}

impl EmbeddedSystem {
    pub async fn start(options: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        confed_protocol::http::install_crypto_provider();
        let dir = &options.data_dir;
        std::fs::create_dir_all(dir).map_err(setup)?;
        let clock = options.clock.clone();
        let token_clock = clock.clone();
        let attester = Arc::new(DevAttester::new(
            options
                .attester_key
                .clone()
                .unwrap_or_else(generate_signing_key),
            Arc::new(move || token_clock.now_seconds().0),
        ));
        let (stop, stop_rx) = watch::channel(false);
        let services = keyservices::start(
            dir,
            options.keyservices,
            options.threshold,
            clock.clone(),
            &attester,
            stop_rx.clone(),
            options.ports,
        )
        .await?;
        let mut tasks = services.tasks;
        let keyservices = services.endpoints;
        let db = match &options.database {
            Some(location) => Db::open(location).await,
            None => Db::open_sqlite(&dir.join("confed.db")).await,
        }
        .map_err(setup)?
        .with_clock(clock.clone());
        db.refuse_contributions_in_the_database()
            .await
            .map_err(setup)?;
        let (blobs, contributions) = crate::blob::open_stores(dir, options.blobs.as_ref())
            .await
            .map_err(setup)?;
        let keys = KeyDirectory::default();
        let urls: Vec<String> = keyservices.iter().map(|k| k.url.clone()).collect();
        keys.refresh(
            &confed_protocol::http::client(Duration::from_secs(10)),
            &urls,
        )
        .await;
        let (mask_preparer, preparing) = crate::uploads::mask_prepare::MaskPreparer::spawn(
            db.clone(),
            blobs.clone(),
            (keys.clone(), urls.clone()),
            stop_rx.clone(),
        );
        tasks.extend(preparing);
        let state = AppState {
            db: db.clone(),
            blobs: blobs.clone(),
            contributions: contributions.clone(),
            admin: None,
            limits: Limits::default(),
            keys: keys.clone(),
            registry: Default::default(),
            worker_token: options.worker_token.clone(),
            console: Default::default(),
            scheduling: Default::default(),
            partitioning: options.partitioning,
            device_auth: Default::default(),
            mask_preparer,
        };
        let (url, handle) =
            serve_router(crate::web::router(state), stop_rx.clone(), options.ports).await?;
        tasks.push(handle);
        tasks.push(tokio::spawn(
            Scheduler::new(db.clone()).run(options.scheduler_period, stop_rx.clone()),
        ));
        let store = Arc::new(TaskDbJobStore {
            db: db.clone(),
            blobs,
            contributions,
            keys,
            partitioning: options.partitioning,
        });
        let system = Self {
            url,
            db,
            store,
            keyservices,
            trust: services.trust,
            attester,
            threshold: options.threshold,
            stop,
            tasks,
        };
        let mut system = system;
        if options.background_worker {
            let worker = system.worker("enclave-worker-1");
            system.tasks.push(tokio::spawn(run_worker(
                worker,
                system.db.clone(),
                Duration::from_millis(200),
                stop_rx,
            )));
        }
        Ok(system)
    }

    /// A new enclave worker over this system's store and key services.
    pub fn worker(&self, id: &str) -> Worker<TaskDbJobStore> {
        Worker::new(self.store.clone(), self.worker_config(id))
    }

    /// How this system's workers are configured (60 s leases, the dev attester).
    pub fn worker_config(&self, id: &str) -> WorkerConfig {
        WorkerConfig {
            id: id.to_string(),
            lease: Duration::from_secs(60),
            key_services: self.keyservices.clone(),
            threshold: self.threshold,
            attester: self.attester.clone(),
            key_timeout: Duration::from_secs(10),
            batch: 256,
            batch_bytes: 16 << 20,
        }
    }

    /// Creates a tenant and returns its API token.
    pub async fn tenant(&self, name: &str) -> Result<String, EmbeddedError> {
        let (_, token) = self
            .db
            .create_tenant(&NewTenant {
                name: name.into(),
                max_active_tasks: 10,
                max_report_goal: 100_000,
                max_device_hours: crate::api::admin::DEFAULT_MAX_DEVICE_HOURS,
            })
            .await
            .map_err(setup)?;
        Ok(token.as_str().to_string())
    }

    /// Stops the servers, scheduler and worker, and closes the database.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        self.db.close().await;
    }
}
