//! `confed keyservice`: one operator's key service process.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use confed_attestation::AppraisalPolicy;

use super::{
    KeyService, KeyServiceError, KeyServiceParts, key_source_for, load_or_create_signing_key,
    load_shares,
};
use confed_protocol::clock::SystemClock;
use confed_serving::{ListenError, TlsFiles, serve_app};

#[derive(Debug, Clone)]
pub struct KeyServiceConfig {
    pub id: String,
    pub shares: Vec<PathBuf>,
    pub policy: PathBuf,
    pub listen: SocketAddr,
    pub tls: Option<TlsFiles>,
    pub signing_key: PathBuf,
    pub audit_log: PathBuf,
    /// The masking key file (`masking_key.rs`), if this service takes part in masked tasks.
    pub masking_key: Option<PathBuf>,
    pub audience: String,
    /// The peers file (`peers.rs`), if any.
    pub peers: Option<PathBuf>,
    pub witness_quorum: Option<usize>,
    pub witness_pull: std::time::Duration,
    /// Serve `/metrics` and `/readyz` here (plain HTTP, or TLS with the service's files) instead
    /// of on `listen`, which then keeps only `/healthz` besides the API.
    pub ops_listen: Option<SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyServiceRunError {
    #[error(transparent)]
    Setup(#[from] KeyServiceError),
    #[error(transparent)]
    Serve(#[from] ListenError),
    #[error(transparent)]
    Peers(#[from] crate::peers::PeersError),
    #[error(transparent)]
    Audit(#[from] crate::audit::AuditError),
}

/// Takes the exclusive lock `<log>.lock` for the life of the returned file: one writer per
/// audit log (a second key service, or `audit acknowledge-loss` while the service runs, is
/// refused instead of interleaving records). The lock is named after the log's canonical path,
/// so a symlink (or `..`) to a log in use finds the same lock.
pub fn lock_log(log: &std::path::Path) -> Result<std::fs::File, crate::audit::AuditError> {
    // A log not created yet has no canonical path; its directory has.
    let canonical = match std::fs::canonicalize(log) {
        Ok(path) => path,
        Err(_) => match (log.parent(), log.file_name()) {
            (Some(dir), Some(name)) => std::fs::canonicalize(if dir.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                dir
            })
            .map(|dir| dir.join(name))
            .unwrap_or_else(|_| log.to_path_buf()),
            _ => log.to_path_buf(),
        },
    };
    let lock = PathBuf::from(format!("{}.lock", canonical.display()));
    let io = |source| crate::audit::AuditError::Io {
        path: lock.clone(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(crate::audit::AuditError::InUse {
            path: log.to_path_buf(),
            lock,
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

pub async fn run(
    config: KeyServiceConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), KeyServiceRunError> {
    confed_serving::check_listen(config.listen, config.tls.as_ref())?;
    let policy = AppraisalPolicy::load(&config.policy).map_err(KeyServiceError::from)?;
    let key_source = key_source_for(&policy)?;
    let _lock = lock_log(&config.audit_log)?;
    tracing::info!(policy = %policy.name, path = %config.policy.display(), "appraisal policy loaded");
    let service = KeyService::new(KeyServiceParts {
        id: config.id.clone(),
        audience: config.audience.clone(),
        signing_key: load_or_create_signing_key(&config.signing_key)?,
        shares: load_shares(&config.shares)?,
        policy,
        key_source,
        audit_log: config.audit_log.clone(),
        clock: Arc::new(SystemClock),
    })?;
    let service = match &config.masking_key {
        Some(path) => {
            service.with_masking_key(crate::masking_key::load_or_create_masking_key(path)?)
        }
        None => service,
    };
    let service = match &config.peers {
        Some(path) => {
            let peers = crate::peers::load(path, &service.id)?;
            let peers = crate::peers::Peers::new(peers, config.witness_quorum);
            tracing::info!(
                peers = peers.list.len(),
                quorum = peers.quorum,
                "peers configured: granting once a quorum of them said this log is not behind"
            );
            service.with_peers(peers)
        }
        None => {
            tracing::warn!(
                "no --peers: a restore of this service's whole state from an older copy is \
                 detected only by comparing its head with signed heads kept elsewhere"
            );
            service
        }
    };
    confed_ops::install(confed_ops::BuildInfo {
        process: "confed-keyservice",
        version: env!("CARGO_PKG_VERSION"),
    });
    zero_metrics(&service);
    let _peer_tasks = service.spawn_peer_tasks(config.witness_pull);
    tracing::info!(keyservice = %service.id, keys = service.shares.len(), audience = %service.audience, "key service ready");
    let app = match config.ops_listen {
        None => super::routes::router(service),
        Some(addr) => {
            let bound = confed_serving::bind_ops_only(addr, config.tls.as_ref())
                .await?
                .quiet();
            let ops = super::routes::ops_router(&service);
            tracing::info!(listen = %addr, "serving /metrics, /healthz and /readyz apart from the API");
            tokio::spawn(async move {
                if let Err(error) =
                    confed_serving::serve_bound(bound, ops, std::future::pending()).await
                {
                    tracing::error!(%error, "the operator listener stopped");
                }
            });
            super::routes::api_router(service)
                .route("/healthz", axum::routing::get(|| async { "ok" }))
        }
    };
    serve_app(config.listen, config.tls.as_ref(), app, shutdown).await?;
    Ok(())
}

/// Every series the shipped alert rules watch exists from the start (at 0), so an alert on it
/// is never silently "no data", and a renamed metric fails CI's rules check
/// (deploy/monitoring/).
fn zero_metrics(service: &KeyService) {
    metrics::gauge!("confed_keyservice_rolled_back").set(0.0);
    for why in ["rate", "repeat"] {
        metrics::counter!("confed_keyservice_refusals_unrecorded_total", "why" => why).absolute(0);
    }
    for decision in ["granted", "refused"] {
        metrics::counter!("confed_keyservice_decisions_total", "decision" => decision).absolute(0);
    }
    if let Some(peers) = &service.peers {
        for peer in &peers.list {
            metrics::counter!("confed_keyservice_peer_rewinds_seen_total", "peer" => peer.id.clone())
                .absolute(0);
        }
    }
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    #[test]
    fn a_symlink_to_a_log_in_use_finds_the_same_lock() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.jsonl");
        std::fs::write(&log, b"").unwrap();
        let link = dir.path().join("link.jsonl");
        std::os::unix::fs::symlink(&log, &link).unwrap();
        let _held = lock_log(&log).unwrap();
        assert!(matches!(
            lock_log(&link),
            Err(crate::audit::AuditError::InUse { .. })
        ));
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let dotted = dir.path().join("sub/../audit.jsonl");
        assert!(matches!(
            lock_log(&dotted),
            Err(crate::audit::AuditError::InUse { .. })
        ));
    }
}
