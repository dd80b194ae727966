//! The refusal flood (issue 28): a client holding tokens its own Confidential Space VM could
//! get (signed by the trusted issuer, but for another audience) asks one key service for its
//! share as fast as 8 connections allow, with a fresh nonce each time: once replaying one
//! token, once minting a new token per request. Before, every refusal after the signature
//! check was written and fsync'd: 6,267 records (7.0 MB) in 15 s from one client. Prints the
//! requests answered, the audit records and bytes written, and bytes a day at that rate.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed::keys::ShareFile;
use confed::keys::ceremony::{CeremonyOptions, generate};
use confed::keyservice::{KeyService, KeyServiceParts, routes};
use confed_attestation::dev::DevAttester;
use confed_attestation::exchange::{Challenge, ReleaseRequest, encode_verifying_key};
use confed_attestation::release::{ReleaseCommitment, key_binding};
use confed_attestation::{AppraisalPolicy, Attester, KeySource, TokenRequest};
use confed_protocol::hpke;
use confed_protocol::policy::TaskPolicy;

const CLIENTS: usize = 8;

struct Flood {
    url: String,
    key_id: String,
    attester: DevAttester,
    ephemeral: hpke::PublicKey,
    signing: p256::ecdsa::SigningKey,
    commitment: ReleaseCommitment,
    policy: String,
}

impl Flood {
    fn binding(&self) -> String {
        key_binding(
            &self.ephemeral.0,
            self.signing.verifying_key().to_sec1_point(false).as_bytes(),
            &self.commitment.digest(),
        )
    }

    async fn token(&self, nonces: Vec<String>) -> String {
        // The attacker's own VM: a genuine token of the trusted issuer, for another audience.
        self.attester
            .token(&TokenRequest {
                audience: "confed-keyservice/someone-else".into(),
                nonces,
            })
            .await
            .unwrap()
    }

    /// One challenge and one release; the release's status.
    async fn once(&self, client: &reqwest::Client, replayed: Option<&str>) -> u16 {
        let challenge: Challenge = client
            .post(format!("{}/v1/keys/{}/challenge", self.url, self.key_id))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let token = match replayed {
            Some(token) => token.to_string(),
            None => {
                self.token(vec![challenge.nonce.clone(), self.binding()])
                    .await
            }
        };
        let request = ReleaseRequest {
            token,
            ephemeral_public_key: URL_SAFE_NO_PAD.encode(self.ephemeral.0),
            enclave_signing_key: encode_verifying_key(self.signing.verifying_key()),
            nonce: challenge.nonce,
            task_id: self.commitment.task_id.clone(),
            round: self.commitment.round,
            commitment: self.commitment.clone(),
            policy: self.policy.clone(),
        };
        client
            .post(format!("{}/v1/keys/{}/release", self.url, self.key_id))
            .json(&request)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }
}

pub(crate) async fn refusal_flood(seconds: u64) {
    let dir = tempfile::tempdir().unwrap();
    let outcome = generate(&CeremonyOptions {
        shares: 2,
        threshold: 2,
        out_dir: dir.path().join("c"),
        not_before: 0,
        not_after: i64::from(u32::MAX),
    })
    .unwrap();
    let attester = DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64
        }),
    );
    let log = dir.path().join("audit.jsonl");
    let service = KeyService::new(KeyServiceParts {
        id: "ks1".into(),
        audience: "confed-keyservice/ks1".into(),
        signing_key: confed_attestation::exchange::generate_signing_key(),
        shares: vec![ShareFile::load(&outcome.share_files[0]).unwrap()],
        policy: AppraisalPolicy::load(Path::new("policies/dev.toml")).unwrap(),
        key_source: KeySource::fixed(attester.jwks()),
        audit_log: log.clone(),
        clock: Arc::new(confed::clock::SystemClock),
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(listener, routes::router(service))
            .await
            .unwrap()
    });
    let policy = TaskPolicy::sample("t", 3);
    let flood = Arc::new(Flood {
        url,
        key_id: outcome.key.key_id.clone(),
        attester,
        ephemeral: hpke::generate_keypair().1,
        signing: confed_attestation::exchange::generate_signing_key(),
        commitment: ReleaseCommitment {
            task_id: "t".into(),
            round: 1,
            key_id: outcome.key.key_id.clone(),
            policy_sha256: policy.sha256_hex(),
            model_sha256: "0".repeat(64),
            inputs_digest: "1".repeat(64),
        },
        policy: policy.encode(),
    });
    let replayed = flood.token(vec![flood.binding()]).await;
    for (name, replay) in [("one token replayed", true), ("a fresh token each", false)] {
        let before = std::fs::metadata(&log).map_or(0, |m| m.len());
        let records_before = std::fs::read_to_string(&log).map_or(0, |t| t.lines().count());
        let answered = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let end = Instant::now() + Duration::from_secs(seconds);
        let started = Instant::now();
        let workers: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (flood, answered, refused) = (flood.clone(), answered.clone(), refused.clone());
                let replayed = replay.then(|| replayed.clone());
                tokio::spawn(async move {
                    let client = confed_protocol::http::client(Duration::from_secs(10));
                    while Instant::now() < end {
                        let status = flood.once(&client, replayed.as_deref()).await;
                        answered.fetch_add(1, Ordering::Relaxed);
                        if status == 403 {
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.await.unwrap();
        }
        let elapsed = started.elapsed().as_secs_f64();
        let bytes = std::fs::metadata(&log).map_or(0, |m| m.len()) - before;
        let records =
            std::fs::read_to_string(&log).map_or(0, |t| t.lines().count()) - records_before;
        let answered = answered.load(Ordering::Relaxed);
        // The bound: the refusal budget's records a minute, every minute of a day, at the size
        // the records of this run had.
        let per_record = bytes as f64 / records.max(1) as f64;
        let budget = f64::from(confed::keyservice::refusals::PER_MINUTE);
        println!(
            "refusal flood, {name}, {CLIENTS} connections, {elapsed:.0} s: {answered} releases answered ({:.0}/s, {} refused 403), {records} audit records written ({bytes} bytes; the budget bounds a day at {budget:.0} x 1,440 x {per_record:.0} B = {:.1} MB)",
            answered as f64 / elapsed,
            refused.load(Ordering::Relaxed),
            budget * 1440.0 * per_record / 1e6
        );
    }
}
