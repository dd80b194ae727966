//! The embedded default's key services: n of them, in this process, on loopback, each holding
//! one share of every key, with the dev policy (compiled in) and its own audit log. State lives in
//! the data directory and survives restarts: the ceremony's share files (a new key is made when
//! the newest one nears its end), each service's signing key, the audit logs.
//!
//! DEV ONLY: one process holds every share, so whoever runs it can decrypt everything. The
//! production layout is n separately operated `confed keyservice` processes.

use std::path::Path;
use std::sync::Arc;

use confed_attestation::{AppraisalPolicy, DevAttester, KeySource};
use confed_enclave::key_collection::KeyServiceEndpoint;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{EmbeddedError, serve_router, setup};
use crate::clock::Clock;
use crate::keys::ceremony::{CeremonyOptions, KEY_SET_FILE, generate};
use crate::keys::{HeldShare, KeySetFile, ShareFile};
use crate::keyservice::masking_key::load_or_create_masking_key;
use crate::keyservice::{KeyService, KeyServiceParts, load_or_create_signing_key, routes};
use confed_protocol::trust::{TrustConfig, TrustedEntry};

/// The dev appraisal policy, compiled in so the embedded system runs from any directory.
const DEV_POLICY: &str = include_str!("../../policies/dev.toml");

/// How long an embedded key is valid.
const KEY_LIFETIME_SECONDS: i64 = 90 * 86_400;
/// A new key is made when the newest one ends sooner than this (longer than the longest round
/// deadline plus the key services' release grace, so no round is left with an expiring key).
const RENEW_BEFORE_SECONDS: i64 = 14 * 86_400;

pub struct EmbeddedKeyServices {
    pub endpoints: Vec<KeyServiceEndpoint>,
    /// What devices trust: the services' signing keys and the threshold.
    pub trust: TrustConfig,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Makes sure `dir/ceremony` holds a key valid for a while (running a ceremony if not) and
/// returns every share file's contents.
fn ensure_keys(
    dir: &Path,
    shares: u16,
    threshold: u16,
    now: i64,
) -> Result<Vec<HeldShare>, EmbeddedError> {
    let ceremony = dir.join("ceremony");
    let key_set = ceremony.join(KEY_SET_FILE);
    let newest_end = if key_set.exists() {
        KeySetFile::load(&key_set)
            .map_err(setup)?
            .keys
            .iter()
            .filter(|k| k.shares == shares && k.threshold == threshold)
            .map(|k| k.not_after)
            .max()
    } else {
        None
    };
    if newest_end.is_none_or(|end| end < now + RENEW_BEFORE_SECONDS) {
        let outcome = generate(&CeremonyOptions {
            shares,
            threshold,
            out_dir: ceremony.clone(),
            not_before: now - 60,
            not_after: now + KEY_LIFETIME_SECONDS,
        })
        .map_err(setup)?;
        tracing::info!(key = %outcome.key.key_id, "embedded key services: new key made");
    }
    let mut held = Vec::new();
    for entry in std::fs::read_dir(&ceremony).map_err(setup)? {
        let path = entry.map_err(setup)?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if name.starts_with("share-") && name.ends_with(".json") {
            let share = ShareFile::load(&path).map_err(setup)?;
            if share.key.shares == shares && share.key.threshold == threshold {
                held.push(share);
            }
        }
    }
    Ok(held)
}

/// Starts `count` key services (threshold `threshold`) trusting `attester`, state in `dir`,
/// listening on loopback ports of `ports` (any free ones without).
pub async fn start(
    dir: &Path,
    count: u16,
    threshold: u16,
    clock: Arc<dyn Clock>,
    attester: &DevAttester,
    stop: watch::Receiver<bool>,
    ports: Option<crate::ports::PortRange>,
) -> Result<EmbeddedKeyServices, EmbeddedError> {
    let policy = AppraisalPolicy::from_toml(DEV_POLICY).map_err(setup)?;
    let mut shares = ensure_keys(dir, count, threshold, clock.now_seconds().0)?;
    let mut services = EmbeddedKeyServices {
        endpoints: Vec::new(),
        trust: TrustConfig {
            threshold: usize::from(threshold),
            keyservices: Vec::new(),
            shares: Some(usize::from(count)),
            // The embedded system is for development: its devices accept whatever the enclave
            // itself would (a device of a real deployment states its own, tighter limits).
            limits: confed_protocol::policy::DeviceLimits::ENCLAVE,
            tenant_id: None,
            token_issuers: Vec::new(),
            require_masking: false,
            require_distributed_noise: false,
        },
        tasks: Vec::new(),
    };
    for index in 1..=count {
        let id = format!("ks{index}");
        let (mine, rest): (Vec<HeldShare>, Vec<HeldShare>) = shares
            .into_iter()
            .partition(|s| u16::from(s.index) == index);
        shares = rest;
        let signing_key =
            load_or_create_signing_key(&dir.join(format!("{id}-signing.pem"))).map_err(setup)?;
        services.trust.keyservices.push(TrustedEntry {
            id: id.clone(),
            verifying_key: confed_attestation::exchange::encode_verifying_key(
                signing_key.verifying_key(),
            ),
        });
        let service = KeyService::new(KeyServiceParts {
            id: id.clone(),
            audience: format!("confed-keyservice/{id}"),
            signing_key,
            shares: mine,
            policy: policy.clone(),
            key_source: KeySource::fixed(attester.jwks()),
            audit_log: dir.join(format!("audit-{id}.jsonl")),
            clock: clock.clone(),
        })
        .map_err(setup)?
        .with_masking_key(
            load_or_create_masking_key(&dir.join(format!("{id}-masking.key"))).map_err(setup)?,
        );
        let (url, handle) = serve_router(routes::router(service), stop.clone(), ports).await?;
        services.tasks.push(handle);
        services.endpoints.push(KeyServiceEndpoint { id, url });
    }
    Ok(services)
}
