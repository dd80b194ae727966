//! A key service: one operator's process holding one Shamir share of each task key. It vouches for
//! the public keys (signed key set), challenges enclaves with nonces, appraises their attestation
//! against its own policy and releases its share, HPKE-sealed to the enclave's ephemeral key, only
//! when every check passes and its release ledger admits the release commitment (one per round).
//! Every decision goes to a hash-chained audit log first; the ledger is rebuilt from it.

pub mod acknowledge;
pub mod audit;
pub mod checkpoint;
pub mod cli;
pub mod error;
mod extract;
pub mod fetcher;
pub mod keys;
pub mod ledger;
pub mod masking_key;

pub mod nonces;
pub mod peers;
pub mod refusals;
mod release;
pub mod rollback;
pub mod routes;
pub mod serve;
mod unmask;
mod unmask_answers;
mod unmask_prepare;
pub mod unmask_prepared;
mod unmask_sums;
pub mod witness;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use confed_attestation::jwk::Jwks;
use confed_attestation::{AppraisalPolicy, KeySource};
use p256::ecdsa::SigningKey;
use p256::pkcs8::{DecodePrivateKey, EncodePrivateKey, LineEnding};
use thiserror::Error;

use crate::keys::{HeldShare, KeyError, ShareFile, valid_id};
use confed_protocol::clock::Clock;

/// Shares stay releasable this long after their key expires, so rounds that collected under a key
/// shortly before its expiry can still be aggregated (longer than the longest round deadline).
pub const DEFAULT_RELEASE_GRACE_SECONDS: i64 = 8 * 24 * 3600;

#[derive(Debug, Error)]
pub enum KeyServiceError {
    #[error("key service id {0:?} must be 1-64 of A-Z a-z 0-9 . _ -")]
    BadId(String),
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("two share files hold key {0}; give each key once")]
    DuplicateKey(String),
    #[error("no share files given: pass --share FILE for each key this service holds")]
    NoShares,
    #[error(transparent)]
    Policy(#[from] confed_attestation::policy::PolicyError),
    #[error("cannot load the policy's key set {path}")]
    Jwks {
        path: String,
        #[source]
        source: BoxError,
    },
    #[error("signing key {path}")]
    SigningKey {
        path: String,
        #[source]
        source: BoxError,
    },
    #[error("masking key {path}")]
    MaskingKey {
        path: String,
        #[source]
        source: BoxError,
    },
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
}

/// A cause of any error type (a file's I/O error, a PEM or JWKS parse error), kept as the cause.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Everything the routes share.
#[derive(Debug, Clone)]
pub struct KeyService {
    pub id: String,
    pub audience: String,
    pub signing_key: Arc<SigningKey>,
    pub shares: Arc<BTreeMap<String, HeldShare>>,
    pub policy: Arc<AppraisalPolicy>,
    pub key_source: KeySource,
    pub nonces: Arc<Mutex<nonces::NonceStore>>,
    /// The audit log and the release ledger rebuilt from it: one lock, so a ledger decision
    /// and its durable record are one step.
    pub audit: Arc<Mutex<(audit::AuditLog, ledger::Ledger)>>,
    pub clock: Arc<dyn Clock>,
    pub release_grace_seconds: i64,
    /// Which refusals are written to the audit log (`refusals.rs`).
    pub refusals: Arc<Mutex<refusals::RefusalBudget>>,
    /// The key services that witness this one's audit head, and that it witnesses
    /// (`peers.rs`); `None` when none are configured.
    pub peers: Option<Arc<peers::Peers>>,
    /// The latest head of each peer this service witnessed (`witness.rs`).
    pub witnesses: Arc<Mutex<witness::WitnessStore>>,
    /// Whether this service grants: closed until a quorum of peers answered after a start, and
    /// for good when one shows a rollback (`rollback.rs`).
    pub gate: Arc<rollback::GrantGate>,
    /// Notified after every appended record: the witness task pushes the new head to the peers.
    pub head_changed: Arc<tokio::sync::Notify>,
    /// The `loss_acknowledged` records found so far, by the head they name: peers ask for them
    /// at every pull after a loss, and each is read from the log once (`witness::acknowledgement`).
    pub acknowledgements: Arc<Mutex<BTreeMap<(u64, String), audit::Record>>>,
    /// The key devices seal mask seeds to (`masking_key.rs`); `None`: this service takes no
    /// part in masked tasks, and its key set says so by naming none.
    pub masking_key: Option<Arc<confed_protocol::hpke::PrivateKey>>,
    /// One mask-sum computation at a time (`unmask.rs`): each holds its sums in memory and
    /// expands a stream per input and group. Per service, not per process: the embedded default
    /// runs three in one process, which in production run on machines of their own.
    pub summing: Arc<tokio::sync::Semaphore>,
    /// Mask sums added ahead while rounds collect (`unmask_prepare.rs`), used by their sums.
    pub prepared: Arc<Mutex<unmask_prepared::PreparedRounds>>,
    /// One batch of preparation at a time (`unmask_prepare.rs`), beside the sums' queue: a
    /// sums request waits only for a batch of its own round.
    pub preparing: Arc<tokio::sync::Semaphore>,
}

/// What a key service is built from (files and settings, no network).
pub struct KeyServiceParts {
    pub id: String,
    pub audience: String,
    pub signing_key: SigningKey,
    pub shares: Vec<HeldShare>,
    pub policy: AppraisalPolicy,
    pub key_source: KeySource,
    pub audit_log: PathBuf,
    pub clock: Arc<dyn Clock>,
}

impl KeyService {
    pub fn new(parts: KeyServiceParts) -> Result<Self, KeyServiceError> {
        if !valid_id(&parts.id) {
            return Err(KeyServiceError::BadId(parts.id));
        }
        if parts.shares.is_empty() {
            return Err(KeyServiceError::NoShares);
        }
        let mut shares = BTreeMap::new();
        for share in parts.shares {
            let key_id = share.key.key_id.clone();
            if shares.insert(key_id.clone(), share).is_some() {
                return Err(KeyServiceError::DuplicateKey(key_id));
            }
        }
        let mut ledger = ledger::Ledger::default();
        let signing_key = Arc::new(parts.signing_key);
        let (audit, verified_from) = audit::AuditLog::open_checkpointed(
            &parts.audit_log,
            &parts.id,
            signing_key.clone(),
            &mut ledger,
        )?;
        let closed = ledger.compact(parts.clock.now_seconds().0);
        tracing::info!(
            keyservice = %parts.id,
            verified_from = ?verified_from,
            records = audit.head().records,
            head = %audit.head().hash,
            committed_rounds = ledger.rounds(),
            closed_tasks = ledger.closed_tasks(),
            closed_now = closed,
            "audit log verified, release ledger rebuilt"
        );
        Ok(Self {
            id: parts.id,
            audience: parts.audience,
            signing_key,
            shares: Arc::new(shares),
            policy: Arc::new(parts.policy),
            key_source: parts.key_source,
            nonces: Arc::default(),
            audit: Arc::new(Mutex::new((audit, ledger))),
            clock: parts.clock,
            release_grace_seconds: DEFAULT_RELEASE_GRACE_SECONDS,
            refusals: Arc::default(),
            peers: None,
            witnesses: Arc::new(Mutex::new(witness::WitnessStore::open(&parts.audit_log))),
            gate: Arc::new(rollback::GrantGate::open()),
            head_changed: Arc::default(),
            acknowledgements: Arc::default(),
            masking_key: None,
            summing: Arc::new(tokio::sync::Semaphore::new(1)),
            prepared: Arc::default(),
            preparing: Arc::new(tokio::sync::Semaphore::new(1)),
        })
    }

    /// Takes part in masked tasks with `key` (`masking_key.rs`).
    pub fn with_masking_key(mut self, key: confed_protocol::hpke::PrivateKey) -> Self {
        self.masking_key = Some(Arc::new(key));
        self
    }

    /// Witnesses `peers` and is witnessed by them: grants nothing until `peers.quorum` of them
    /// said what they witnessed of this service (`spawn_peer_tasks` asks them).
    pub fn with_peers(mut self, peers: peers::Peers) -> Self {
        self.gate = Arc::new(rollback::GrantGate::waiting_for(peers.quorum));
        self.peers = Some(Arc::new(peers));
        self
    }

    /// Starts asking the peers what they witnessed of this service, and the witness loop
    /// (pushes after every record, pulls every `pull_every`). Nothing without peers.
    pub fn spawn_peer_tasks(
        &self,
        pull_every: std::time::Duration,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let Some(peers) = self.peers.clone() else {
            return Vec::new();
        };
        vec![
            tokio::spawn(rollback::ask_until_answered(self.clone(), peers.clone())),
            tokio::spawn(witness::run(self.clone(), peers, pull_every)),
        ]
    }

    /// Unix seconds now, as the key service's records (key validity, ledger entries, audit
    /// times) hold them.
    pub fn now_seconds(&self) -> i64 {
        self.clock.now_seconds().0
    }
}

/// Loads share files.
pub fn load_shares(paths: &[PathBuf]) -> Result<Vec<HeldShare>, KeyServiceError> {
    paths
        .iter()
        .map(|p| ShareFile::load(p).map_err(Into::into))
        .collect()
}

/// The policy's key source: its JWKS file, or its discovery URL fetched over HTTPS.
pub fn key_source_for(policy: &AppraisalPolicy) -> Result<KeySource, KeyServiceError> {
    if let Some(path) = &policy.token.jwks_file {
        let jwks_error = |source: BoxError| KeyServiceError::Jwks {
            path: path.display().to_string(),
            source,
        };
        let text = std::fs::read_to_string(path).map_err(|e| jwks_error(e.into()))?;
        let jwks = Jwks::from_json(&text).map_err(|e| jwks_error(e.into()))?;
        return Ok(KeySource::fixed(jwks));
    }
    let url = policy.token.discovery_url.clone().unwrap_or_default();
    let fetcher = fetcher::HttpJwksFetcher::new().map_err(|reason| KeyServiceError::Jwks {
        path: url.clone(),
        source: reason.into(),
    })?;
    Ok(KeySource::discovery(url, Arc::new(fetcher)))
}

/// Loads an existing P-256 signing key (PKCS#8 PEM); never creates one.
pub fn load_existing_signing_key(path: &Path) -> Result<SigningKey, KeyServiceError> {
    let error = |source: BoxError| KeyServiceError::SigningKey {
        path: path.display().to_string(),
        source,
    };
    let pem = zeroize::Zeroizing::new(std::fs::read_to_string(path).map_err(|e| error(e.into()))?);
    SigningKey::from_pkcs8_pem(&pem).map_err(|e| error(e.into()))
}

/// Loads the service's P-256 signing key (PKCS#8 PEM), creating it (mode 0600) if missing.
pub fn load_or_create_signing_key(path: &Path) -> Result<SigningKey, KeyServiceError> {
    let error = |source: BoxError| KeyServiceError::SigningKey {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(pem) => {
            let pem = zeroize::Zeroizing::new(pem);
            SigningKey::from_pkcs8_pem(&pem).map_err(|e| error(e.into()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = confed_attestation::exchange::generate_signing_key();
            let pem = key
                .to_pkcs8_pem(LineEnding::LF)
                .map_err(|e| error(e.into()))?;
            crate::keys::files::write_new(path, pem.as_bytes(), true)?;
            tracing::info!(path = %path.display(), "created a new key-set signing key");
            Ok(key)
        }
        Err(e) => Err(error(e.into())),
    }
}
