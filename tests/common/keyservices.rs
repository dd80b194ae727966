//! Key services for tests: a ceremony's shares, dev attestation, key services that are honest,
//! refusing or lying, served over real HTTP on loopback.

use confed::clock::Millis;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed::clock::{Clock, ManualClock};
use confed::keys::ceremony::{CeremonyOptions, generate};
use confed::keys::{PublicKeyRecord, ShareFile};
use confed::keyservice::{KeyService, KeyServiceParts, routes};
use confed_attestation::dev::DevAttester;
use confed_attestation::release::ReleaseCommitment;
use confed_attestation::{AppraisalPolicy, KeySource};
use confed_enclave::key_collection::{
    CollectError, KeyRequest, KeyServiceEndpoint, ObtainedKey, obtain_private_key,
};
use confed_protocol::hpke;
use confed_protocol::policy::TaskPolicy;

pub(crate) const START: i64 = 1_800_000_000;
/// How long a collection may take: 13 key services take about 7 s in a debug build alone, and
/// the rounds binary runs its tests side by side on 2 cores; no test service hangs, so a larger
/// bound only ever waits when something is wrong.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) struct World {
    pub dir: tempfile::TempDir,
    pub clock: Arc<ManualClock>,
    pub attester: Arc<DevAttester>,
    pub key: PublicKeyRecord,
    pub share_files: Vec<PathBuf>,
    /// Each key service's signing key, by index: a restarted service keeps its key (it checks
    /// its audit log's signatures against it at start).
    signing_keys: std::sync::Mutex<std::collections::HashMap<usize, p256::ecdsa::SigningKey>>,
}

/// How a test key service misbehaves.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Behaviour {
    Honest,
    /// Its policy allows another image, so it refuses every dev token.
    Refusing,
    /// Returns a corrupted share.
    Lying,
}

impl World {
    pub(crate) fn new(threshold: u16, shares: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let outcome = generate(&CeremonyOptions {
            shares,
            threshold,
            out_dir: dir.path().join("ceremony"),
            not_before: START - 10,
            not_after: START + 86_400,
        })
        .unwrap();
        let clock = Arc::new(ManualClock::starting_at(Millis(START * 1000)));
        let token_clock = clock.clone();
        let attester = Arc::new(DevAttester::new(
            confed_attestation::exchange::generate_signing_key(),
            Arc::new(move || token_clock.now_millis().0 / 1000),
        ));
        Self {
            dir,
            clock,
            attester,
            key: outcome.key,
            share_files: outcome.share_files,
            signing_keys: Default::default(),
        }
    }

    /// Key service `index`'s signing key (made on first use, the same for every restart).
    pub(crate) fn signing_key(&self, index: usize) -> p256::ecdsa::SigningKey {
        self.signing_keys
            .lock()
            .unwrap()
            .entry(index)
            .or_insert_with(confed_attestation::exchange::generate_signing_key)
            .clone()
    }

    pub(crate) fn policy(&self, behaviour: Behaviour) -> AppraisalPolicy {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/dev.toml");
        let mut policy = AppraisalPolicy::load(&path).unwrap();
        if behaviour == Behaviour::Refusing {
            policy.workload.image_digests = vec![format!("sha256:{}", "e".repeat(64))];
        }
        policy
    }

    pub(crate) fn service(
        &self,
        index: usize,
        behaviour: Behaviour,
        share_files: &[PathBuf],
    ) -> KeyService {
        let mut held: Vec<_> = share_files
            .iter()
            .map(|p| ShareFile::load(p).unwrap())
            .collect();
        if behaviour == Behaviour::Lying {
            held[0].share[5] ^= 0x5a;
        }
        KeyService::new(KeyServiceParts {
            id: format!("ks{index}"),
            audience: format!("confed-keyservice/ks{index}"),
            signing_key: self.signing_key(index),
            shares: held,
            policy: self.policy(behaviour),
            key_source: KeySource::fixed(self.attester.jwks()),
            audit_log: self.dir.path().join(format!("audit-ks{index}.jsonl")),
            clock: self.clock.clone(),
        })
        .unwrap()
    }

    pub(crate) fn request(&self) -> KeyRequest {
        let policy = TaskPolicy::sample("task-1", 3);
        KeyRequest {
            key_id: self.key.key_id.clone(),
            public_key: public_key(&self.key),
            threshold: self.key.threshold,
            task_id: "task-1".into(),
            round: 1,
            commitment: commitment(&self.key.key_id, &policy, 1, "1"),
            policy: policy.encode(),
        }
    }
}

/// A release commitment for round `round` of `policy`'s task under key `key_id`, over inputs
/// named by `inputs`.
pub(crate) fn commitment(
    key_id: &str,
    policy: &TaskPolicy,
    round: u64,
    inputs: &str,
) -> ReleaseCommitment {
    ReleaseCommitment {
        task_id: policy.task_id.clone(),
        round,
        key_id: key_id.to_string(),
        policy_sha256: policy.sha256_hex(),
        model_sha256: "0".repeat(64),
        inputs_digest: inputs.repeat(64),
    }
}

pub(crate) fn public_key(key: &PublicKeyRecord) -> hpke::PublicKey {
    hpke::PublicKey::from_bytes(&URL_SAFE_NO_PAD.decode(&key.public_key).unwrap()).unwrap()
}

/// Serves a router on a loopback port; returns its base URL.
pub(crate) async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    url
}

/// A URL where nothing listens.
pub(crate) async fn down_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    url
}

pub(crate) async fn start(world: &World, behaviours: &[Behaviour]) -> Vec<KeyServiceEndpoint> {
    let mut endpoints = Vec::new();
    for (i, &behaviour) in behaviours.iter().enumerate() {
        let service = world.service(i + 1, behaviour, &world.share_files[i..=i]);
        endpoints.push(KeyServiceEndpoint {
            id: service.id.clone(),
            url: serve(routes::router(service)).await,
        });
    }
    endpoints
}

/// The enclave's key collection from `endpoints` for `request`, attested by the world's dev
/// attester, with a fresh per-job signing key, `timeout` per key service.
pub(crate) async fn collect_with(
    endpoints: &[KeyServiceEndpoint],
    world: &World,
    request: &KeyRequest,
    timeout: Duration,
) -> Result<ObtainedKey, CollectError> {
    obtain_private_key(
        &confed_protocol::http::client(TIMEOUT),
        endpoints,
        request,
        world.attester.as_ref(),
        &confed_attestation::exchange::generate_signing_key(),
        timeout,
    )
    .await
}
