//! The key services' release ledger, as an operator attacking it would: one release per round,
//! only under the task's policy and within its rounds, across restarts, and with t-1 ledgers
//! wiped. Key services run in-process over real HTTP on loopback; the enclave side is the real
//! key collection.

mod common;

use common::keyservices::*;
use confed::keyservice::routes;
use confed_enclave::key_collection::{
    CollectError, KeyRequest, KeyServiceEndpoint, ServiceFailure,
};
use confed_enclave::policy::TaskPolicy;

/// Key services 1..=n of `world`, each holding its own share, on fresh ports.
async fn start_all(world: &World, n: usize) -> Vec<KeyServiceEndpoint> {
    let mut endpoints = Vec::new();
    for index in 1..=n {
        endpoints.push(start_one(world, index).await);
    }
    endpoints
}

/// (Re)starts key service `index` over its audit log in the world's directory.
async fn start_one(world: &World, index: usize) -> KeyServiceEndpoint {
    let service = world.service(
        index,
        Behaviour::Honest,
        &world.share_files[index - 1..index],
    );
    KeyServiceEndpoint {
        id: service.id.clone(),
        url: serve(routes::router(service)).await,
    }
}

fn request_for(world: &World, policy: &TaskPolicy, round: u64, inputs: &str) -> KeyRequest {
    KeyRequest {
        task_id: policy.task_id.clone(),
        round,
        commitment: commitment(&world.key.key_id, policy, round, inputs),
        policy: policy.encode(),
        ..world.request()
    }
}

async fn collect(
    endpoints: &[KeyServiceEndpoint],
    world: &World,
    request: &KeyRequest,
) -> Result<confed_enclave::key_collection::ObtainedKey, CollectError> {
    collect_with(endpoints, world, request, TIMEOUT).await
}

/// Every refusal names the release ledger (or the task policy) as the failed check.
fn refused_by(error: &CollectError, check: &str) -> usize {
    let failures = match error {
        CollectError::NotEnoughShares { failures, .. } => failures,
        CollectError::Inconsistent { failures, .. } => failures,
        CollectError::NoQuorum { failures, .. } => failures,
    };
    failures
        .iter()
        .filter(|(_, why)| {
            matches!(why, ServiceFailure::Refused { status: 403, detail } if detail.contains(check))
        })
        .count()
}

#[tokio::test]
async fn a_round_is_released_again_only_for_the_identical_commitment() {
    let world = World::new(2, 3);
    let endpoints = start_all(&world, 3).await;
    let policy = TaskPolicy::sample("task-1", 3);
    let first = collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    assert_eq!(first.receipts.len(), 3, "every key service recorded it");
    // A crashed job finishes in a new enclave (new keys), over the same inputs.
    let again = collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    assert_eq!(again.private_key.as_bytes(), first.private_key.as_bytes());
    // Other inputs for the same round (a swapped envelope, a subset): refused everywhere.
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
    // The next round is a new commitment.
    collect(&endpoints, &world, &request_for(&world, &policy, 2, "b"))
        .await
        .unwrap();
}

#[tokio::test]
async fn a_round_beyond_the_plan_and_another_policy_for_the_task_are_refused() {
    let world = World::new(2, 3);
    let endpoints = start_all(&world, 3).await;
    let policy = TaskPolicy::sample("task-1", 2);
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 3, "a"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    // The operator changes the task's epsilon (a new policy text) for round 2.
    let looser = TaskPolicy {
        epsilon: 50.0,
        ..policy.clone()
    };
    let error = collect(&endpoints, &world, &request_for(&world, &looser, 2, "a"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
}

#[tokio::test]
async fn a_policy_text_that_is_not_the_committed_one_is_refused() {
    let world = World::new(2, 3);
    let endpoints = start_all(&world, 3).await;
    let policy = TaskPolicy::sample("task-1", 3);
    let mut request = request_for(&world, &policy, 1, "a");
    request.policy = TaskPolicy::sample("task-1", 9).encode();
    let error = collect(&endpoints, &world, &request).await.unwrap_err();
    assert_eq!(refused_by(&error, "task_policy"), 3, "{error}");
    // A policy no enclave may release under is refused whatever its hash.
    let reckless = TaskPolicy {
        epsilon: 1000.0,
        ..policy
    };
    let error = collect(&endpoints, &world, &request_for(&world, &reckless, 1, "a"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "task_policy"), 3, "{error}");
}

#[tokio::test]
async fn the_ledger_survives_a_restart() {
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 3);
    {
        let endpoints = start_all(&world, 3).await;
        collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
            .await
            .unwrap();
    }
    // New processes over the same audit logs (as after kill -9: the record was fsync'd before
    // the answer left).
    let restarted = start_all(&world, 3).await;
    let error = collect(&restarted, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
    collect(&restarted, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
}

/// t = 2 of n = 3: wipe the ledger (audit log) of t - 1 = 1 key service; the other two still hold
/// the first commitment, so a second release of the round gets one share, never two.
#[tokio::test]
async fn with_the_ledgers_of_t_minus_1_key_services_wiped_no_second_release_is_possible() {
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 3);
    let endpoints = start_all(&world, 3).await;
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    // Its whole state: the log and the checkpoint that would otherwise refuse the start.
    std::fs::remove_file(world.dir.path().join("audit-ks1.jsonl")).unwrap();
    std::fs::remove_file(world.dir.path().join("audit-ks1.jsonl.checkpoint")).unwrap();
    let wiped = start_one(&world, 1).await;
    let endpoints = vec![wiped, endpoints[1].clone(), endpoints[2].clone()];
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, CollectError::NotEnoughShares { usable: 1, .. }),
        "{error}"
    );
    assert_eq!(refused_by(&error, "release_ledger"), 2, "{error}");
}

/// The network (or the operator's relay) rewrites each receipt's number of shares to the
/// threshold, hoping the enclave computes a smaller quorum. The receipt's t and n are bound into
/// the sealed share's HPKE info, so no rewritten share opens.
#[tokio::test]
async fn a_relay_that_rewrites_the_quorum_in_receipts_gets_no_share_opened() {
    let world = World::new(2, 3);
    let mut endpoints = Vec::new();
    for index in 1..=3 {
        let service = world.service(
            index,
            Behaviour::Honest,
            &world.share_files[index - 1..index],
        );
        let router = routes::router(service).layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| async move {
                let response = next.run(request).await;
                let (parts, body) = response.into_parts();
                let bytes = axum::body::to_bytes(body, 1 << 20).await.unwrap();
                let mut json: serde_json::Value =
                    serde_json::from_slice(&bytes).unwrap_or_default();
                if json.get("receipt").is_some() {
                    json["receipt"]["shares"] = serde_json::json!(2);
                }
                let body = serde_json::to_vec(&json).unwrap();
                let mut parts = parts;
                parts.headers.remove(axum::http::header::CONTENT_LENGTH);
                axum::response::Response::from_parts(parts, axum::body::Body::from(body))
            },
        ));
        endpoints.push(KeyServiceEndpoint {
            id: format!("ks{index}"),
            url: serve(router).await,
        });
    }
    let policy = TaskPolicy::sample("task-1", 3);
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap_err();
    let CollectError::NotEnoughShares {
        usable, failures, ..
    } = &error
    else {
        panic!("{error}");
    };
    assert_eq!(*usable, 0, "{error}");
    assert!(
        failures
            .iter()
            .all(|(_, why)| matches!(why, ServiceFailure::BadAnswer(_))),
        "{error}"
    );
}

/// When a task's every round is committed, its ledger entry stays open for identical repeats for
/// a while (a crashed final job), then closes: nothing more is released for the task, also after
/// a restart.
#[tokio::test]
async fn a_completed_task_is_closed_after_the_grace() {
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 1);
    let endpoints = start_all(&world, 3).await;
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    world.clock.advance(std::time::Duration::from_secs(3600));
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .expect("an identical repeat within the grace");
    world.clock.advance(std::time::Duration::from_secs(
        confed::keyservice::ledger::CLOSE_AFTER_SECONDS as u64,
    ));
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
    let restarted = start_all(&world, 3).await;
    let error = collect(&restarted, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap_err();
    assert_eq!(refused_by(&error, "release_ledger"), 3, "{error}");
}

// ---- Rollback across key services: peers witness each other's signed audit heads ----

use confed::keyservice::KeyService;
use confed::keyservice::audit::{LostHead, SignedHead};
use confed::keyservice::peers::{Peer, Peers};
use confed::keyservice::rollback::{GateState, ask_once};

/// A loopback port bound before its key service is built (its peers must know its URL).
async fn bind() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (listener, url)
}

fn peer(world: &World, index: usize, url: &str) -> Peer {
    Peer {
        id: format!("ks{index}"),
        url: url.to_string(),
        verifying_key: *world.signing_key(index).verifying_key(),
    }
}

/// Key service `index` over its audit log, with every other entry of `urls` as a peer, served on
/// `listener`.
fn start_witnessing(
    world: &World,
    index: usize,
    urls: &[String],
    quorum: Option<usize>,
    listener: tokio::net::TcpListener,
) -> KeyService {
    let peers = (1..=urls.len())
        .filter(|&i| i != index)
        .map(|i| peer(world, i, &urls[i - 1]))
        .collect();
    let service = world
        .service(
            index,
            Behaviour::Honest,
            &world.share_files[index - 1..index],
        )
        .with_peers(Peers::new(peers, quorum));
    let router = routes::router(service.clone());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    service
}

/// Asks each of `service`'s peers once what it witnessed of it.
async fn ask_peers(service: &KeyService) -> GateState {
    let peers = service.peers.clone().unwrap();
    ask_once(service, &peers, peers.list.iter().collect()).await;
    service.gate.state()
}

fn audit_file(world: &World, index: usize, suffix: &str) -> std::path::PathBuf {
    world
        .dir
        .path()
        .join(format!("audit-ks{index}.jsonl{suffix}"))
}

/// The operator of key service 1 restores its whole state (log, checkpoint, witness file) from a
/// copy taken before round 1 was committed, then asks for a second, different release of round
/// 1. The copy is self-consistent, so ks1's own checks pass; its peers witnessed the newer head,
/// so it grants nothing until its operator acknowledges the loss (a signed audit record). Even
/// then the other key services' ledgers hold round 1: no second release.
#[tokio::test]
async fn a_key_service_restored_from_an_older_copy_grants_nothing_once_a_peer_shows_its_newer_head()
{
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 3);
    let mut listeners = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..3 {
        let (listener, url) = bind().await;
        listeners.push(listener);
        urls.push(url);
    }
    let mut services = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        services.push(start_witnessing(&world, i + 1, &urls, None, listener));
    }
    for service in &services {
        assert!(matches!(
            service.gate.state(),
            GateState::Waiting { needed: 1, .. }
        ));
        assert_eq!(
            ask_peers(service).await,
            GateState::Open,
            "a fresh deployment"
        );
    }
    // The copy: ks1's whole state before round 1.
    let backup = world.dir.path().join("backup");
    std::fs::create_dir(&backup).unwrap();
    for suffix in ["", ".checkpoint"] {
        std::fs::copy(
            audit_file(&world, 1, suffix),
            backup.join(format!("f{suffix}")),
        )
        .unwrap();
    }
    let endpoints: Vec<_> = (0..3)
        .map(|i| KeyServiceEndpoint {
            id: format!("ks{}", i + 1),
            url: urls[i].clone(),
        })
        .collect();
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    // ks1 pushes its new head (the witness task does this after every record).
    let ks1_peers = services[0].peers.clone().unwrap();
    confed::keyservice::witness::push_once(&services[0], &ks1_peers).await;
    let witnessed: SignedHead = services[1]
        .witnesses
        .lock()
        .unwrap()
        .latest("ks1")
        .cloned()
        .expect("ks2 witnessed ks1's head after the grant");
    assert!(witnessed.records >= 1);

    // Restore and restart ks1 on a new port.
    for suffix in ["", ".checkpoint"] {
        std::fs::remove_file(audit_file(&world, 1, suffix)).unwrap();
        std::fs::copy(
            backup.join(format!("f{suffix}")),
            audit_file(&world, 1, suffix),
        )
        .unwrap();
    }
    let (listener, url) = bind().await;
    let restored = start_witnessing(&world, 1, &urls, None, listener);
    let alone = [KeyServiceEndpoint {
        id: "ks1".into(),
        url,
    }];
    let error = collect_with(
        &alone,
        &world,
        &request_for(&world, &policy, 1, "b"),
        TIMEOUT,
    )
    .await
    .unwrap_err();
    assert!(
        error.to_string().contains("(503)") && error.to_string().contains("just started"),
        "nothing is granted before the peers answered: {error}"
    );
    let GateState::RolledBack { detail } = ask_peers(&restored).await else {
        panic!("the restored log was not detected");
    };
    assert!(
        detail.contains(&witnessed.hash) && detail.contains("acknowledge-loss"),
        "{detail}"
    );
    let error = collect_with(
        &alone,
        &world,
        &request_for(&world, &policy, 1, "b"),
        TIMEOUT,
    )
    .await
    .unwrap_err();
    assert!(
        error.to_string().contains("(503)") && error.to_string().contains("acknowledge-loss"),
        "the attack's second commitment is not granted: {error}"
    );

    // The operator accepts the loss: a signed record; ks1 grants again after its next start.
    let record = confed::keyservice::acknowledge::acknowledge_loss(
        &audit_file(&world, 1, ""),
        "ks1",
        std::sync::Arc::new(world.signing_key(1)),
        LostHead {
            records: witnessed.records,
            hash: witnessed.hash.clone(),
        },
        "disk lost; restored from the nightly copy",
        START,
    )
    .unwrap();
    assert_eq!(record.decision.decision, "loss_acknowledged");
    let (listener, url) = bind().await;
    let acknowledged = start_witnessing(&world, 1, &urls, None, listener);
    assert_eq!(ask_peers(&acknowledged).await, GateState::Open);
    // Its ledger forgot round 1, the others' did not: one share for "b", never two.
    let endpoints = vec![
        KeyServiceEndpoint {
            id: "ks1".into(),
            url,
        },
        endpoints[1].clone(),
        endpoints[2].clone(),
    ];
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, CollectError::NotEnoughShares { usable: 1, .. }),
        "{error}"
    );
}

/// A peer that is down, or that answers a head not signed by the service's own key (a
/// compromised peer inventing a loss), neither stops nor rolls back an honest service: a forged
/// answer counts as no answer, and the quorum is met by the peers that answer.
#[tokio::test]
async fn a_down_or_lying_peer_neither_stops_nor_rolls_back_an_honest_service() {
    let world = World::new(2, 3);
    let (listener, ks2_url) = bind().await;
    let ks2 = start_witnessing(
        &world,
        2,
        &[down_url().await, ks2_url.clone()],
        None,
        listener,
    );
    drop(ks2);
    // ks3 is compromised: it claims to have witnessed ks1 far ahead, signed with its own key.
    let forger = world.signing_key(3);
    let forged = {
        let hash = "f".repeat(64);
        let text = confed::keyservice::audit::head_text("ks1", 99, &hash);
        SignedHead {
            keyservice_id: "ks1".into(),
            records: 100,
            hash,
            signature: Some(confed_attestation::release::sign_text(&forger, &text)),
        }
    };
    let lying = axum::Router::new().route(
        "/v1/audit/witnessed/{id}",
        axum::routing::get(move || {
            let forged = forged.clone();
            async move { axum::Json(forged) }
        }),
    );
    let ks3_url = serve(lying).await;
    let urls = [String::new(), ks2_url, ks3_url];
    let (listener, _) = bind().await;
    let both = start_witnessing(&world, 1, &urls, Some(2), listener);
    assert!(
        matches!(ask_peers(&both).await, GateState::Waiting { ref answered, needed: 2 } if answered.len() == 1),
        "the forged answer is no answer, and no rollback"
    );
    let (listener, _) = bind().await;
    let quorum = start_witnessing(&world, 1, &urls, None, listener);
    assert_eq!(ask_peers(&quorum).await, GateState::Open);

    // With ks2 down as well, ks1 waits (and says so) rather than granting on no evidence.
    let urls = [String::new(), down_url().await, urls[2].clone()];
    let (listener, _) = bind().await;
    let alone = start_witnessing(&world, 1, &urls, None, listener);
    assert!(matches!(ask_peers(&alone).await, GateState::Waiting { .. }));
}

/// Anyone can push a head; only a configured peer's, signed with its key, is kept.
#[tokio::test]
async fn a_pushed_head_not_signed_by_the_peer_it_names_is_refused_and_not_kept() {
    let world = World::new(2, 3);
    let (listener, ks2_url) = bind().await;
    let urls = [down_url().await, ks2_url.clone()];
    let ks2 = start_witnessing(&world, 2, &urls, None, listener);
    let client = reqwest::Client::new();
    let attacker = confed_attestation::exchange::generate_signing_key();
    for (id, key) in [("ks1", &attacker), ("ks9", &world.signing_key(1))] {
        let hash = "a".repeat(64);
        let text = confed::keyservice::audit::head_text(id, 4, &hash);
        let head = SignedHead {
            keyservice_id: id.into(),
            records: 5,
            hash,
            signature: Some(confed_attestation::release::sign_text(key, &text)),
        };
        let response = client
            .post(format!("{ks2_url}/v1/audit/witness"))
            .json(&head)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 403, "{id}");
    }
    assert!(ks2.witnesses.lock().unwrap().latest("ks1").is_none());
    let response = client
        .get(format!("{ks2_url}/v1/audit/witnessed/ks1"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
}
