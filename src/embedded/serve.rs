//! The embedded default inside `confed serve`: without `--keyservice`, three key services and an
//! enclave worker run in the server's process (DEV attester only), and `run_worker` drives that
//! worker over the task database.

use std::sync::Arc;
use std::time::Duration;

use confed_enclave::worker::{Worker, WorkerConfig};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::aggregation::TaskDbJobStore;
use crate::clock::Clock;
use crate::db::Db;
use crate::keys::directory::KeyDirectory;
use crate::keys::directory::REFRESH_PERIOD;

/// Why the embedded key services and worker did not start.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error("cannot use data directory {path}: {source}")]
    DataDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the embedded key services: {0}")]
    Start(String),
}

/// The embedded default without `--keyservice`: three key services (any two reconstruct a key)
/// and an enclave worker in this process, attesting with the DEV attester; state in
/// `DATA_DIR/embedded`, and the device trust file at `DATA_DIR/embedded/trust.json`.
pub async fn start_enclave(
    data_dir: &std::path::Path,
    clock: &Arc<dyn Clock>,
    keys: &KeyDirectory,
    stop: watch::Receiver<bool>,
    ports: Option<crate::ports::PortRange>,
) -> Result<(WorkerConfig, Vec<JoinHandle<()>>), EmbeddedError> {
    let embedded = data_dir.join("embedded");
    std::fs::create_dir_all(&embedded).map_err(|source| EmbeddedError::DataDir {
        path: embedded.clone(),
        source,
    })?;
    let token_clock = clock.clone();
    // Kept in the data directory (which already holds the embedded key services' shares), so a
    // `confed-enclave --attester dev --dev-key <it>` can stand in for the in-process worker.
    let attester_key = embedded.join("dev-attester.pem");
    let attester = Arc::new(
        confed_attestation::DevAttester::from_key_file(
            &attester_key,
            Arc::new(move || token_clock.now_seconds().0),
        )
        .map_err(EmbeddedError::Start)?,
    );
    let services =
        super::keyservices::start(&embedded, 3, 2, clock.clone(), &attester, stop, ports)
            .await
            .map_err(|e| EmbeddedError::Start(confed_protocol::errors::with_causes(&e)))?;
    let urls: Vec<String> = services.endpoints.iter().map(|e| e.url.clone()).collect();
    keys.refresh(
        &confed_protocol::http::client(Duration::from_secs(10)),
        &urls,
    )
    .await;
    keys.spawn_refresh(urls, REFRESH_PERIOD);
    let trust_file = embedded.join("trust.json");
    let trust = serde_json::to_vec_pretty(&services.trust)
        .map_err(|e| EmbeddedError::Start(confed_protocol::errors::with_causes(&e)))?;
    std::fs::write(&trust_file, trust).map_err(|source| EmbeddedError::DataDir {
        path: trust_file.clone(),
        source,
    })?;
    println!(
        "confed: no --keyservice given: 3 key services (any 2 reconstruct a key) and an enclave worker run in this process with the DEV attester; nothing here is confidential. Device trust file: {}",
        trust_file.display()
    );
    println!(
        "confed: dev attester key (for confed-enclave --attester dev --dev-key): {}",
        attester_key.display()
    );
    println!(
        "confed: embedded key services: {}",
        services
            .endpoints
            .iter()
            .map(|e| format!("{}={}", e.id, e.url))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let worker = WorkerConfig {
        // A new incarnation per process: after a crash, this worker takes its job back at once.
        id: format!("embedded-enclave-worker/{}", uuid::Uuid::new_v4().simple()),
        lease: Duration::from_secs(60),
        key_services: services.endpoints,
        threshold: 2,
        attester,
        key_timeout: Duration::from_secs(10),
        batch: 256,
        batch_bytes: 16 << 20,
    };
    Ok((worker, services.tasks))
}

/// Runs `worker` until `shutdown`: a job right after a job, at once when this process closes a
/// round (`Db::job_ready`), otherwise a poll every `idle` (jobs created by other processes).
pub async fn run_worker(
    worker: Worker<TaskDbJobStore>,
    db: Db,
    idle: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let busy = match worker.run_once().await {
            Ok(Some(outcome)) => {
                tracing::info!(task = %outcome.task_id, round = outcome.round, step = outcome.step(),
                    partition = ?outcome.partition, included = outcome.included,
                    excluded = outcome.excluded, epsilon_spent = ?outcome.epsilon_spent,
                    seconds = outcome.phases.after_lease().as_secs_f64(), phases = %outcome.phases, "round aggregated");
                true
            }
            Ok(None) => false,
            Err(error) => {
                tracing::warn!(%error, "aggregation job not finished; it will be retried");
                false
            }
        };
        if busy {
            continue;
        }
        tokio::select! {
            _ = tokio::time::sleep(idle) => {}
            _ = db.job_ready() => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            break;
        }
    }
}
