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
use crate::listen::{ListenError, TlsFiles, serve_app};
use confed_protocol::clock::SystemClock;

#[derive(Debug, Clone)]
pub struct KeyServiceConfig {
    pub id: String,
    pub shares: Vec<PathBuf>,
    pub policy: PathBuf,
    pub listen: SocketAddr,
    pub tls: Option<TlsFiles>,
    pub signing_key: PathBuf,
    pub audit_log: PathBuf,
    pub audience: String,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyServiceRunError {
    #[error(transparent)]
    Setup(#[from] KeyServiceError),
    #[error(transparent)]
    Serve(#[from] ListenError),
}

pub async fn run(
    config: KeyServiceConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), KeyServiceRunError> {
    crate::listen::check_listen(config.listen, config.tls.as_ref())?;
    let policy = AppraisalPolicy::load(&config.policy).map_err(KeyServiceError::from)?;
    let key_source = key_source_for(&policy)?;
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
    tracing::info!(keyservice = %service.id, keys = service.shares.len(), audience = %service.audience, "key service ready");
    serve_app(
        config.listen,
        config.tls.as_ref(),
        super::routes::router(service),
        shutdown,
    )
    .await?;
    Ok(())
}
