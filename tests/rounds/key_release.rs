//! Key services and the enclave's key collection, in-process over real HTTP on loopback: the
//! ceremony's shares, dev attestation, threshold behaviour with down, refusing and lying key
//! services, every refusal of the release protocol, and the signed key set.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key services only; no task database or blob
//! store.

use confed::clock::Millis;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed::keys::ceremony::{CeremonyOptions, generate};
use confed::keyservice::{audit, routes};
use confed_attestation::exchange::{Challenge, KeySet, ReleaseRequest, encode_verifying_key};
use confed_attestation::release::key_binding;
use confed_attestation::{Attester, TokenRequest};
use confed_enclave::key_collection::{CollectError, KeyServiceEndpoint, ServiceFailure};
use confed_protocol::hpke;
use confed_protocol::policy::TaskPolicy;
use confed_protocol::trust::{TrustedKeyService, accept_public_key};
use serde_json::Value;
use tokio::sync::watch;

use crate::common;

use common::keyservices::*;

#[tokio::test]
async fn round_trip_five_shares_threshold_three_opens_a_ciphertext() {
    let world = World::new(3, 5);
    let endpoints = start(&world, &[Behaviour::Honest; 5]).await;
    let (enc, ct) =
        hpke::seal(&public_key(&world.key), b"info", b"aad", b"a device update").unwrap();
    let obtained = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap();
    assert_eq!(obtained.used.len(), 3);
    let plaintext = hpke::open(&obtained.private_key, &enc, b"info", b"aad", &ct).unwrap();
    assert_eq!(plaintext.as_slice(), b"a device update");
    // Every granted release is in the releasing service's audit log.
    for id in &obtained.used {
        let log = world.dir.path().join(format!("audit-{id}.jsonl"));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("\"decision\":\"granted\""), "{id}: {text}");
        assert_eq!(audit::verify_file(&log).unwrap().records, 1);
    }
}

#[tokio::test]
async fn down_refusing_and_lying_services_are_named_and_the_others_suffice() {
    // 7 of 13: a quorum (10) of honest, consistent key services survives one down, one refusing
    // and one lying key service.
    let world = World::new(7, 13);
    let mut endpoints = vec![KeyServiceEndpoint {
        id: "ks1".into(),
        url: down_url().await,
    }];
    endpoints.extend(start_from(&world, 2, Behaviour::Refusing, None).await);
    // The liar answers first; honest services start only after it has answered, so the collector
    // must meet the bad share and find it among the others.
    let (liar_done, gate) = watch::channel(false);
    endpoints.extend(start_from(&world, 3, Behaviour::Lying, Some(Gate::Opens(liar_done))).await);
    for index in 4..=13 {
        endpoints.extend(
            start_from(
                &world,
                index,
                Behaviour::Honest,
                Some(Gate::WaitsFor(gate.clone())),
            )
            .await,
        );
    }
    let obtained = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        obtained.private_key.public_key().unwrap(),
        public_key(&world.key)
    );
    assert_eq!(obtained.used.len(), 7);
    assert!(
        obtained
            .used
            .iter()
            .all(|id| !["ks1", "ks2", "ks3"].contains(&id.as_str()))
    );
    assert_eq!(obtained.receipts.len(), 10, "the liar's receipt is dropped");
    let failure = |id: &str| {
        obtained
            .failures
            .iter()
            .find(|(f, _)| f == id)
            .map(|(_, why)| why.clone())
    };
    assert!(
        matches!(failure("ks1"), Some(ServiceFailure::Unreachable(_))),
        "{:?}",
        failure("ks1")
    );
    assert!(
        matches!(
            failure("ks2"),
            Some(ServiceFailure::Refused { status: 403, .. })
        ),
        "{:?}",
        failure("ks2")
    );
    assert_eq!(failure("ks3"), Some(ServiceFailure::InconsistentShare));
}

/// The same faults against 3 of 6: the key reconstructs, but only 3 honest key services
/// recorded the commitment and a release needs 5 (any two such sets share 3 key services): the
/// enclave refuses to go on, and names why.
#[tokio::test]
async fn without_a_quorum_of_recorded_commitments_the_enclave_does_not_go_on() {
    let world = World::new(3, 6);
    let mut endpoints = vec![KeyServiceEndpoint {
        id: "ks1".into(),
        url: down_url().await,
    }];
    endpoints.extend(start_from(&world, 2, Behaviour::Refusing, None).await);
    endpoints.extend(start_from(&world, 3, Behaviour::Lying, None).await);
    for index in 4..=6 {
        endpoints.extend(start_from(&world, index, Behaviour::Honest, None).await);
    }
    let error = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap_err();
    let CollectError::NoQuorum {
        recorded,
        needed,
        failures,
        ..
    } = &error
    else {
        panic!("{error}");
    };
    assert_eq!((*recorded, *needed), (3, 5), "{error}");
    let named: Vec<&str> = failures.iter().map(|(id, _)| id.as_str()).collect();
    for id in ["ks1", "ks2", "ks3"] {
        assert!(named.contains(&id), "{error}");
    }
}

#[tokio::test]
async fn fewer_than_threshold_honest_services_fail_clearly() {
    let world = World::new(3, 5);
    let mut endpoints = vec![KeyServiceEndpoint {
        id: "ks1".into(),
        url: down_url().await,
    }];
    endpoints.extend(start_from(&world, 2, Behaviour::Refusing, None).await);
    endpoints.extend(start_from(&world, 3, Behaviour::Lying, None).await);
    endpoints.extend(start_from(&world, 4, Behaviour::Honest, None).await);
    endpoints.extend(start_from(&world, 5, Behaviour::Honest, None).await);
    let error = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap_err();
    let CollectError::Inconsistent {
        suspects, failures, ..
    } = &error
    else {
        panic!("expected an inconsistency with exactly T shares, got {error}");
    };
    assert_eq!(suspects.len(), 3);
    let text = error.to_string();
    for needle in [
        "ks1: unreachable",
        "ks2: refused (403)",
        "ks3",
        "ks4",
        "ks5",
    ] {
        assert!(text.contains(needle), "{needle} missing from: {text}");
    }
    assert_eq!(failures.len(), 2);

    // With only two answering at all, it is plainly not enough.
    let endpoints: Vec<_> = endpoints.into_iter().filter(|e| e.id != "ks3").collect();
    let error = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            CollectError::NotEnoughShares {
                usable: 2,
                threshold: 3,
                ..
            }
        ),
        "{error}"
    );
}

enum Gate {
    Opens(watch::Sender<bool>),
    WaitsFor(watch::Receiver<bool>),
}

async fn start_from(
    world: &World,
    index: usize,
    behaviour: Behaviour,
    gate: Option<Gate>,
) -> Vec<KeyServiceEndpoint> {
    let service = world.service(index, behaviour, &world.share_files[index - 1..index]);
    let id = service.id.clone();
    let mut router = routes::router(service);
    match gate {
        None => {}
        Some(Gate::Opens(done)) => {
            let done = Arc::new(done);
            router = router.layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let done = done.clone();
                    async move {
                        let is_release = request.uri().path().ends_with("/release");
                        let response = next.run(request).await;
                        if is_release {
                            let _ = done.send(true);
                        }
                        response
                    }
                },
            ));
        }
        Some(Gate::WaitsFor(gate)) => {
            router = router.layer(axum::middleware::from_fn(
                move |request: axum::extract::Request, next: axum::middleware::Next| {
                    let mut gate = gate.clone();
                    async move {
                        let _ = gate.wait_for(|open| *open).await;
                        next.run(request).await
                    }
                },
            ));
        }
    }
    vec![KeyServiceEndpoint {
        id,
        url: serve(router).await,
    }]
}

/// Drives the release protocol by hand against one key service.
struct Session {
    url: String,
    key_id: String,
    client: reqwest::Client,
    ephemeral: hpke::PublicKey,
    signing: p256::ecdsa::SigningKey,
}

impl Session {
    async fn challenge(&self, key_id: &str) -> Challenge {
        let response = self
            .client
            .post(format!("{}/v1/keys/{key_id}/challenge", self.url))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201);
        response.json().await.unwrap()
    }

    /// The `eat_nonce` binding of this session's keys and of the commitment `request` sends.
    fn binding(&self) -> String {
        key_binding(
            &self.ephemeral.0,
            self.signing.verifying_key().to_sec1_point(false).as_bytes(),
            &self.commitment().digest(),
        )
    }

    fn commitment(&self) -> confed_attestation::release::ReleaseCommitment {
        commitment(&self.key_id, &TaskPolicy::sample("task-1", 3), 2, "1")
    }

    async fn release(&self, key_id: &str, request: &ReleaseRequest) -> (u16, Value) {
        let response = self
            .client
            .post(format!("{}/v1/keys/{key_id}/release", self.url))
            .json(request)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    fn request(&self, token: String, nonce: &str) -> ReleaseRequest {
        let policy = TaskPolicy::sample("task-1", 3);
        ReleaseRequest {
            token,
            ephemeral_public_key: URL_SAFE_NO_PAD.encode(self.ephemeral.0),
            enclave_signing_key: encode_verifying_key(self.signing.verifying_key()),
            nonce: nonce.to_string(),
            task_id: "task-1".into(),
            round: 2,
            commitment: self.commitment(),
            policy: policy.encode(),
        }
    }
}

async fn session(world: &World, share_files: &[PathBuf]) -> Session {
    let service = world.service(1, Behaviour::Honest, share_files);
    let key_id = world.key.key_id.clone();
    Session {
        url: serve(routes::router(service)).await,
        key_id,
        client: confed_protocol::http::client(TIMEOUT),
        ephemeral: hpke::generate_keypair().1,
        signing: confed_attestation::exchange::generate_signing_key(),
    }
}

async fn mint(world: &World, audience: &str, nonces: Vec<String>) -> String {
    world
        .attester
        .token(&TokenRequest {
            audience: audience.into(),
            nonces,
        })
        .await
        .unwrap()
}

fn failed_checks(problem: &Value) -> Vec<String> {
    problem["failed_checks"]
        .as_array()
        .map(|checks| {
            checks
                .iter()
                .map(|c| c["check"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

const AUDIENCE: &str = "confed-keyservice/ks1";

#[tokio::test]
async fn a_nonce_works_once() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let request = s.request(token, &challenge.nonce);
    let (status, _) = s.release(&s.key_id, &request).await;
    assert_eq!(status, 200);
    let (status, problem) = s.release(&s.key_id, &request).await;
    assert_eq!(status, 403);
    assert_eq!(problem["type"], "urn:confed:problem:attestation-refused");
    assert_eq!(
        failed_checks(&problem),
        ["challenge_nonce"],
        "replayed nonce"
    );
}

#[tokio::test]
async fn an_expired_nonce_is_refused() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let challenge = s.challenge(&s.key_id).await;
    world.clock.advance(Duration::from_secs(61));
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (status, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 403);
    assert_eq!(failed_checks(&problem), ["challenge_nonce"]);
    assert!(
        problem["failed_checks"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("expired")
    );
}

#[tokio::test]
async fn a_nonce_for_another_key_is_refused() {
    let world = World::new(2, 2);
    let second = generate(&CeremonyOptions {
        shares: 2,
        threshold: 2,
        out_dir: world.dir.path().join("second"),
        not_before: START - 10,
        not_after: START + 86_400,
    })
    .unwrap();
    let files = vec![world.share_files[0].clone(), second.share_files[0].clone()];
    let s = session(&world, &files).await;
    let challenge = s.challenge(&second.key.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (status, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 403);
    assert_eq!(failed_checks(&problem), ["challenge_nonce"]);
    assert!(
        problem["failed_checks"][0]["reason"]
            .as_str()
            .unwrap()
            .contains("for this key")
    );
}

/// A token whose signature no longer verifies.
fn flip_last_char(token: &str) -> String {
    let mut text = token.to_string();
    let last = text.pop().unwrap();
    text.push(if last == 'A' { 'B' } else { 'A' });
    text
}

fn audit_records(world: &World) -> u64 {
    audit::verify_file(&world.dir.path().join("audit-ks1.jsonl"))
        .unwrap()
        .records
}

/// The challenge flood: 10,001 outstanding challenges once locked every enclave out for up to a
/// minute. Nonces now cost the service no state, so an enclave's challenge still works.
#[tokio::test]
async fn a_challenge_flood_does_not_lock_out_an_enclave() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    for _ in 0..10_001 {
        s.challenge(&s.key_id).await;
    }
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (status, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 200, "{problem}");
}

/// The audit flood: release requests with never-issued nonces were appraised and fsync'd to the
/// audit log. They are refused before appraisal, counted, and leave the log alone.
#[tokio::test]
async fn junk_release_requests_are_refused_before_appraisal_and_leave_the_audit_log_alone() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let made_up = URL_SAFE_NO_PAD.encode([7u8; 40]);
    let token = mint(&world, AUDIENCE, vec![made_up.clone(), s.binding()]).await;
    for _ in 0..50 {
        let (status, problem) = s
            .release(&s.key_id, &s.request(token.clone(), &made_up))
            .await;
        assert_eq!(status, 403);
        assert_eq!(failed_checks(&problem), ["challenge_nonce"]);
    }
    assert_eq!(audit_records(&world), 0, "no junk in the audit log");
    // A nonce anyone can fetch, with junk evidence: refused, still not written down.
    for token in [
        "not-a-jwt".to_string(),
        flip_last_char(&mint(&world, AUDIENCE, vec![s.binding()]).await),
    ] {
        let challenge = s.challenge(&s.key_id).await;
        let (status, _) = s
            .release(&s.key_id, &s.request(token, &challenge.nonce))
            .await;
        assert_eq!(status, 403);
    }
    assert_eq!(
        audit_records(&world),
        0,
        "evidence the issuer did not sign is not audited"
    );
    // A replayed (used) nonce is refused the same way; its first use was recorded.
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let request = s.request(token, &challenge.nonce);
    assert_eq!(s.release(&s.key_id, &request).await.0, 200);
    let (status, problem) = s.release(&s.key_id, &request).await;
    assert_eq!(status, 403);
    assert!(
        problem["detail"].as_str().unwrap().contains("already used"),
        "{problem}"
    );
    assert_eq!(audit_records(&world), 1);
}

/// An all-zero (low-order) X25519 ephemeral key got a 500 after the audit log had recorded
/// "granted". It is now a 400 before appraisal, and nothing is recorded as granted.
#[tokio::test]
async fn a_low_order_ephemeral_key_is_refused_before_appraisal() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let mut request = s.request(token, &challenge.nonce);
    request.ephemeral_public_key = URL_SAFE_NO_PAD.encode([0u8; 32]);
    let (status, problem) = s.release(&s.key_id, &request).await;
    assert_eq!(status, 400, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("ephemeral_public_key"),
        "{problem}"
    );
    assert_eq!(audit_records(&world), 0);
}

#[tokio::test]
async fn a_token_not_bound_to_the_ephemeral_key_is_refused() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let challenge = s.challenge(&s.key_id).await;
    let someone_elses_key = confed_attestation::sha256_hex(&hpke::generate_keypair().1.0);
    let token = mint(
        &world,
        AUDIENCE,
        vec![challenge.nonce.clone(), someone_elses_key],
    )
    .await;
    let (status, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 403);
    assert_eq!(failed_checks(&problem), ["key_binding"]);
}

#[tokio::test]
async fn a_token_for_another_key_service_is_refused() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(
        &world,
        "confed-keyservice/ks2",
        vec![challenge.nonce.clone(), s.binding()],
    )
    .await;
    let (status, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 403);
    assert_eq!(failed_checks(&problem), ["aud"]);
    let log = world.dir.path().join("audit-ks1.jsonl");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("\"decision\":\"refused\"") && text.contains("\"failed_checks\":[\"aud\"]"),
        "{text}"
    );
    assert!(
        text.contains(&challenge.nonce),
        "the audit record names the nonce"
    );
}

/// One issuer-signed token (the attacker's own VM: another audience), replayed with fresh
/// nonces, wrote a signed, fsync'd refusal every time: 40 GB a day from one client. The token is
/// recorded once; the replays are answered the same and only counted; distinct refused tokens
/// are written at most `refusals::PER_MINUTE` a minute.
#[tokio::test]
async fn one_issuer_signed_token_replayed_with_fresh_nonces_is_recorded_once() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let token = mint(&world, "confed-keyservice/ks2", vec![s.binding()]).await;
    for _ in 0..30 {
        let challenge = s.challenge(&s.key_id).await;
        let (status, problem) = s
            .release(&s.key_id, &s.request(token.clone(), &challenge.nonce))
            .await;
        assert_eq!(status, 403);
        assert!(
            failed_checks(&problem).contains(&"aud".to_string()),
            "{problem}"
        );
    }
    assert_eq!(audit_records(&world), 1, "the same token is written once");
    // Distinct refused tokens: at most the minute's budget is written (the test's clock does
    // not move).
    for _ in 0..(confed::keyservice::refusals::PER_MINUTE + 10) {
        let challenge = s.challenge(&s.key_id).await;
        let fresh = mint(
            &world,
            "confed-keyservice/ks2",
            vec![challenge.nonce.clone(), s.binding()],
        )
        .await;
        let (status, _) = s
            .release(&s.key_id, &s.request(fresh, &challenge.nonce))
            .await;
        assert_eq!(status, 403);
    }
    assert_eq!(
        audit_records(&world),
        u64::from(confed::keyservice::refusals::PER_MINUTE),
        "one minute's budget of refusal records"
    );
    // An honest exchange still goes through, and is recorded.
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (status, _) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        audit_records(&world),
        u64::from(confed::keyservice::refusals::PER_MINUTE) + 1
    );
}

#[tokio::test]
async fn pending_and_long_expired_keys_are_not_released() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    world.clock.set(Millis((START - 3600) * 1000));
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (_, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(failed_checks(&problem), ["key_state"]);
    world
        .clock
        .set(Millis((START + 86_400 + 9 * 86_400) * 1000));
    let challenge = s.challenge(&s.key_id).await;
    let token = mint(&world, AUDIENCE, vec![challenge.nonce.clone(), s.binding()]).await;
    let (_, problem) = s
        .release(&s.key_id, &s.request(token, &challenge.nonce))
        .await;
    assert_eq!(failed_checks(&problem), ["key_state"]);
}

#[tokio::test]
async fn malformed_requests_and_unknown_keys_get_clear_errors() {
    let world = World::new(2, 2);
    let s = session(&world, &world.share_files[..1]).await;
    let response = s
        .client
        .post(format!("{}/v1/keys/nope/challenge", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let challenge = s.challenge(&s.key_id).await;
    let mut request = s.request("x".into(), &challenge.nonce);
    request.ephemeral_public_key = "short".into();
    let (status, problem) = s.release(&s.key_id, &request).await;
    assert_eq!(status, 400);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("ephemeral_public_key")
    );
    let response = s
        .client
        .post(format!("{}/v1/keys/{}/release", s.url, s.key_id))
        .json(&serde_json::json!({"token": "x", "surprise": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let (status, problem) = s
        .release(&s.key_id, &s.request("not-a-jwt".into(), &challenge.nonce))
        .await;
    assert_eq!(status, 403);
    assert!(failed_checks(&problem).contains(&"token_format".to_string()));
}

#[tokio::test]
async fn devices_accept_a_key_only_with_threshold_signatures_from_trusted_services() {
    let world = World::new(2, 3);
    let mut sets = Vec::new();
    let mut trusted = Vec::new();
    for i in 0..3 {
        let service = world.service(i + 1, Behaviour::Honest, &world.share_files[i..=i]);
        let url = serve(routes::router(service)).await;
        let set: KeySet = confed_protocol::http::client(TIMEOUT)
            .get(format!("{url}/v1/keys"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(set.keys[0].state, "active");
        trusted.push(TrustedKeyService::new(&set.keyservice_id, &set.verifying_key).unwrap());
        sets.push(set);
    }
    let accepted = accept_public_key(&sets, &trusted, 2, START).unwrap();
    assert_eq!(accepted.public_key, world.key.public_key);
    // One trusted signer is not enough for T = 2.
    assert!(accept_public_key(&sets[..1], &trusted, 2, START).is_err());
    // A key set whose public key was swapped in transit carries no valid signature.
    let mut forged = sets.clone();
    for set in &mut forged[1..] {
        set.keys[0].public_key = URL_SAFE_NO_PAD.encode(hpke::generate_keypair().1.0);
    }
    assert!(accept_public_key(&forged, &trusted, 2, START).is_err());
    // Signatures from services the device does not trust do not count.
    assert!(accept_public_key(&sets, &trusted[..1], 2, START).is_err());
    // Outside its validity window the key is not accepted.
    assert!(accept_public_key(&sets, &trusted, 2, START + 86_400).is_err());
}

#[tokio::test]
async fn a_slow_key_service_is_waited_for_only_briefly_and_times_out_when_needed() {
    let world = World::new(3, 5);
    // ks1 never answers: its gate never opens.
    let (_never, closed) = watch::channel(false);
    let mut endpoints =
        start_from(&world, 1, Behaviour::Honest, Some(Gate::WaitsFor(closed))).await;
    for index in 2..=5 {
        endpoints.extend(start_from(&world, index, Behaviour::Honest, None).await);
    }
    // Four fast services are a quorum for 3 of 5: the collection gives the slow one the short
    // ledger grace, not the whole per-service timeout, and names it.
    let started = std::time::Instant::now();
    let obtained = collect_with(&endpoints, &world, &world.request(), TIMEOUT)
        .await
        .unwrap();
    assert_eq!(obtained.used.len(), 3);
    assert!(!obtained.used.contains(&"ks1".to_string()));
    assert_eq!(obtained.receipts.len(), 4);
    assert!(started.elapsed() < TIMEOUT, "waited only the grace");
    assert_eq!(
        obtained.failures,
        [(
            "ks1".to_string(),
            ServiceFailure::Timeout(confed_enclave::key_collection::LEDGER_GRACE)
        )]
    );
    // Needing the slow one, the collection gives up after the per-service timeout and says so.
    let short = Duration::from_millis(300);
    let error = collect_with(&endpoints[..3], &world, &world.request(), short)
        .await
        .unwrap_err();
    let CollectError::NotEnoughShares { failures, .. } = &error else {
        panic!("{error}");
    };
    assert_eq!(
        failures,
        &[("ks1".to_string(), ServiceFailure::Timeout(short))]
    );
}
