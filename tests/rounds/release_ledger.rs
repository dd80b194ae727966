//! The key services' release ledger, as an operator attacking it would: one release per round,
//! only under the task's policy and within its rounds, across restarts, and with t-1 ledgers
//! wiped. Key services run in-process over real HTTP on loopback; the enclave side is the real
//! key collection.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key services only; no task database or blob
//! store.

use crate::common;

use common::keyservices::*;
use confed::keyservice::routes;
use confed_enclave::key_collection::{
    CollectError, KeyRequest, KeyServiceEndpoint, ServiceFailure,
};
use confed_protocol::policy::TaskPolicy;

/// Key services 1..=n of `world`, each holding its own share, on fresh ports.
async fn start_all(world: &World, n: usize) -> Vec<KeyServiceEndpoint> {
    let mut endpoints = Vec::new();
    for index in 1..=n {
        endpoints.push(start_one(world, index).await);
    }
    endpoints
}

/// (Re)starts key service `index` over its audit log in the world's directory.
pub(crate) async fn start_one(world: &World, index: usize) -> KeyServiceEndpoint {
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

pub(crate) fn request_for(
    world: &World,
    policy: &TaskPolicy,
    round: u64,
    inputs: &str,
) -> KeyRequest {
    KeyRequest {
        task_id: policy.task_id.clone(),
        round,
        commitment: commitment(&world.key.key_id, policy, round, inputs),
        policy: policy.encode(),
        ..world.request()
    }
}

pub(crate) async fn collect(
    endpoints: &[KeyServiceEndpoint],
    world: &World,
    request: &KeyRequest,
) -> Result<confed_enclave::key_collection::ObtainedKey, CollectError> {
    collect_with(endpoints, world, request, TIMEOUT).await
}

/// Every refusal names the release ledger (or the task policy) as the failed check.
pub(crate) fn refused_by(error: &CollectError, check: &str) -> usize {
    let failures = match error {
        CollectError::NotEnoughShares { failures, .. } => failures,
        CollectError::Inconsistent { failures, .. } => failures,
        CollectError::NoQuorum { failures, .. } => failures,
    };
    failures
        .iter()
        .filter(|(_, why)| {
            matches!(why, ServiceFailure::Refused { status: 403, detail, .. } if detail.contains(check))
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
use confed::keyservice::witness::push_once;

/// A loopback port bound before its key service is built (its peers must know its URL).
pub(crate) async fn bind() -> (tokio::net::TcpListener, String) {
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

/// Peers `urls` (1-based by position) other than `index`.
fn peers_of(world: &World, index: usize, urls: &[String], quorum: Option<usize>) -> Peers {
    let list = (1..=urls.len())
        .filter(|&i| i != index)
        .map(|i| peer(world, i, &urls[i - 1]))
        .collect();
    Peers::new(list, quorum)
}

/// A key service with peers, served until stopped (gracefully: its connections close, so a
/// restart on the same address is the one answering).
pub(crate) struct Witnessing {
    pub(crate) service: KeyService,
    url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Witnessing {
    pub(crate) async fn start(
        world: &World,
        index: usize,
        urls: &[String],
        quorum: Option<usize>,
        listener: tokio::net::TcpListener,
    ) -> Self {
        let url = format!("http://{}", listener.local_addr().unwrap());
        let service = world
            .service(
                index,
                Behaviour::Honest,
                &world.share_files[index - 1..index],
            )
            .with_peers(peers_of(world, index, urls, quorum));
        let router = routes::router(service.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap()
        });
        Self {
            service,
            url,
            stop,
            task,
        }
    }

    /// Stops this process and starts key service `index` again over its files, same address.
    pub(crate) async fn restart(self, world: &World, index: usize, urls: &[String]) -> Self {
        let _ = self.stop.send(());
        self.task.await.unwrap();
        let address = self.url.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind(address).await.unwrap();
        Self::start(world, index, urls, None, listener).await
    }

    /// Asks each peer once what it witnessed of this service.
    pub(crate) async fn ask_peers(&self) -> GateState {
        let peers = self.service.peers.clone().unwrap();
        ask_once(&self.service, &peers, peers.list.iter().collect()).await;
        self.service.gate.state()
    }

    async fn push(&self) {
        let peers = self.service.peers.clone().unwrap();
        push_once(&self.service, &peers).await;
    }

    pub(crate) fn witnessed(&self, of: &str) -> Option<SignedHead> {
        self.service.witnesses.lock().unwrap().latest(of).cloned()
    }

    fn endpoint(&self) -> KeyServiceEndpoint {
        KeyServiceEndpoint {
            id: self.service.id.clone(),
            url: self.url.clone(),
        }
    }
}

/// Three key services, each the others' peer, all of them asked once (a fresh deployment).
pub(crate) async fn witnessing_deployment(world: &World) -> (Vec<Witnessing>, Vec<String>) {
    let mut listeners = Vec::new();
    let mut urls = Vec::new();
    for _ in 0..3 {
        let (listener, url) = bind().await;
        listeners.push(listener);
        urls.push(url);
    }
    let mut services = Vec::new();
    for (i, listener) in listeners.into_iter().enumerate() {
        services.push(Witnessing::start(world, i + 1, &urls, None, listener).await);
    }
    for service in &services {
        assert!(matches!(
            service.service.gate.state(),
            GateState::Waiting { needed: 1, .. }
        ));
        assert_eq!(
            service.ask_peers().await,
            GateState::Open,
            "a fresh deployment"
        );
    }
    (services, urls)
}

fn audit_file(world: &World, index: usize, suffix: &str) -> std::path::PathBuf {
    world
        .dir
        .path()
        .join(format!("audit-ks{index}.jsonl{suffix}"))
}

/// Copies key service `index`'s whole state (log and checkpoint) to `name`, or back from it.
pub(crate) fn copy_state(world: &World, index: usize, name: &str, restore: bool) {
    let copy = world.dir.path().join(name);
    std::fs::create_dir_all(&copy).unwrap();
    for suffix in ["", ".checkpoint"] {
        let (from, to) = (
            audit_file(world, index, suffix),
            copy.join(format!("f{suffix}")),
        );
        let (from, to) = if restore { (to, from) } else { (from, to) };
        let _ = std::fs::remove_file(&to);
        std::fs::copy(from, to).unwrap();
    }
}

/// The operator of key service 1 restores its whole state (log, checkpoint) from a copy taken
/// before round 1 was committed, then asks for a second, different release of round 1. The
/// copy is self-consistent, so ks1's own checks pass; its peers witnessed the newer head, so it
/// grants nothing until its operator acknowledges the loss (a signed audit record). Even then
/// the other key services' ledgers hold round 1: no second release. The peers then follow ks1's
/// new history from its acknowledgement on.
#[tokio::test]
async fn a_key_service_restored_from_an_older_copy_grants_nothing_once_a_peer_shows_its_newer_head()
{
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 3);
    let (mut services, urls) = witnessing_deployment(&world).await;
    copy_state(&world, 1, "backup", false);
    let endpoints: Vec<_> = services.iter().map(Witnessing::endpoint).collect();
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    // ks1 pushes its new head (the witness task does this after every record).
    services[0].push().await;
    let witnessed = services[1]
        .witnessed("ks1")
        .expect("ks2 witnessed ks1's head after the grant");
    assert!(witnessed.records >= 1);

    copy_state(&world, 1, "backup", true);
    let ks1 = services.remove(0).restart(&world, 1, &urls).await;
    let alone = [ks1.endpoint()];
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
    let GateState::RolledBack { detail } = ks1.ask_peers().await else {
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
    let lost = LostHead {
        records: witnessed.records,
        hash: witnessed.hash.clone(),
    };
    let record = confed::keyservice::acknowledge::acknowledge_loss(
        &audit_file(&world, 1, ""),
        "ks1",
        std::sync::Arc::new(world.signing_key(1)),
        lost,
        witnessed.signature.as_deref().unwrap(),
        "disk lost; restored from the nightly copy",
        START,
    )
    .unwrap();
    assert_eq!(record.decision.decision, "loss_acknowledged");
    let ks1 = ks1.restart(&world, 1, &urls).await;
    assert_eq!(ks1.ask_peers().await, GateState::Open);
    // Its ledger forgot round 1, the others' did not: one share for "b", never two.
    let endpoints = vec![ks1.endpoint(), endpoints[1].clone(), endpoints[2].clone()];
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert!(
        matches!(error, CollectError::NotEnoughShares { usable: 1, .. }),
        "{error}"
    );
    // The peers follow ks1's new history from its acknowledgement on (it extends the signed
    // record naming the head they kept), so they witness its later heads again.
    ks1.push().await;
    let now = ks1.service.audit.lock().unwrap().0.signed_head("ks1");
    assert_eq!(services[0].witnessed("ks1"), Some(now));
}

/// The restored ks1 starts while the one peer that witnessed its newer head is unreachable
/// (another peer answers with an older head, so the start quorum is met), grants until its log
/// is longer than that head, then pushes to that peer. A longer head on another history does
/// not replace the witnessed one: the peer keeps it, answers with it, and ks1 closes.
#[tokio::test]
async fn a_restored_key_service_that_grows_past_the_witnessed_head_is_still_caught() {
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 9);
    let (services, urls) = witnessing_deployment(&world).await;
    copy_state(&world, 1, "backup", false);
    let alone = |w: &Witnessing| [w.endpoint()];
    // Round 1 at ks1 alone (its share is granted and recorded; one share opens nothing).
    let _ = collect_with(
        &alone(&services[0]),
        &world,
        &request_for(&world, &policy, 1, "a"),
        TIMEOUT,
    )
    .await;
    // Only ks2 witnesses the new head (ks3 was down then).
    let ks1_peers = services[0].service.peers.clone().unwrap();
    let ks2_only = Peers::new(vec![ks1_peers.list[0].clone()], None);
    push_once(&services[0].service, &ks2_only).await;
    let witnessed = services[1].witnessed("ks1").unwrap();

    // Restored; ks2 unreachable at start, ks3 (nothing witnessed) answers: the gate opens.
    copy_state(&world, 1, "backup", true);
    let mut services = services;
    let ks1 = services.remove(0); // ks2 and ks3 keep serving (dropping them would stop them)
    let ks2_down = [urls[0].clone(), down_url().await, urls[2].clone()];
    let _ = ks1.stop.send(());
    ks1.task.await.unwrap();
    let (listener, _) = bind().await;
    let restored = Witnessing::start(&world, 1, &ks2_down, None, listener).await;
    assert_eq!(restored.ask_peers().await, GateState::Open);
    for round in 2..=(witnessed.records + 2) {
        let _ = collect_with(
            &alone(&restored),
            &world,
            &request_for(&world, &policy, round, "b"),
            TIMEOUT,
        )
        .await;
    }
    let grown = restored.service.audit.lock().unwrap().0.signed_head("ks1");
    assert!(grown.records > witnessed.records, "{grown:?}");

    // ks2 is reachable again: the push.
    let ks2 = Peers::new(vec![peer(&world, 2, &urls[1])], None);
    push_once(&restored.service, &ks2).await;
    assert!(
        matches!(restored.service.gate.state(), GateState::RolledBack { .. }),
        "{:?}",
        restored.service.gate.state()
    );
}

/// A peer that is down, answers 404 (an older version, a wrong path), or answers a head not
/// signed by the service's own key (a compromised peer inventing a loss) neither opens the gate
/// nor rolls the service back: none of these is an answer, and the quorum is met by the peers
/// that do answer.
#[tokio::test]
async fn a_down_lying_or_unversioned_peer_neither_opens_the_gate_nor_rolls_it_back() {
    let world = World::new(2, 3);
    let (listener, ks2_url) = bind().await;
    let _ks2 = Witnessing::start(
        &world,
        2,
        &[down_url().await, ks2_url.clone()],
        None,
        listener,
    )
    .await;
    // ks3 is compromised: it claims to have witnessed ks1 far ahead, signed with its own key.
    let forger = world.signing_key(3);
    let forged = {
        let hash = "f".repeat(64);
        let text = confed::keyservice::audit::head_text("ks1", 99, &hash);
        serde_json::json!({"keyservice_id": "ks1", "witnessed": SignedHead {
            keyservice_id: "ks1".into(),
            records: 100,
            hash,
            signature: Some(confed_attestation::release::sign_text(&forger, &text)),
        }})
    };
    let lying = axum::Router::new().route(
        "/v1/audit/witnessed/{id}",
        axum::routing::get(move || {
            let forged = forged.clone();
            async move { axum::Json(forged) }
        }),
    );
    let ks3_url = serve(lying).await;
    let unversioned = serve(axum::Router::new()).await;
    let urls = [String::new(), ks2_url.clone(), ks3_url.clone()];
    let (listener, _) = bind().await;
    let both = Witnessing::start(&world, 1, &urls, Some(2), listener).await;
    assert!(
        matches!(both.ask_peers().await, GateState::Waiting { ref answered, needed: 2 } if answered.len() == 1),
        "the forged answer is no answer, and no rollback"
    );
    let (listener, _) = bind().await;
    let quorum = Witnessing::start(&world, 1, &urls, None, listener).await;
    assert_eq!(quorum.ask_peers().await, GateState::Open);

    // With ks2 down and ks3 answering 404, ks1 waits (and says so) rather than granting on no
    // evidence.
    let urls = [String::new(), down_url().await, unversioned];
    let (listener, _) = bind().await;
    let alone = Witnessing::start(&world, 1, &urls, None, listener).await;
    assert!(matches!(alone.ask_peers().await, GateState::Waiting { .. }));
}

/// Anyone can push a head; only a configured peer's, signed with its key, is kept.
#[tokio::test]
async fn a_pushed_head_not_signed_by_the_peer_it_names_is_refused_and_not_kept() {
    let world = World::new(2, 3);
    let (listener, ks2_url) = bind().await;
    let urls = [down_url().await, ks2_url.clone()];
    let ks2 = Witnessing::start(&world, 2, &urls, None, listener).await;
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
    assert!(ks2.witnessed("ks1").is_none());
    let answer: serde_json::Value = client
        .get(format!("{ks2_url}/v1/audit/witnessed/ks1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        answer,
        serde_json::json!({"keyservice_id": "ks1", "witnessed": null})
    );
}
