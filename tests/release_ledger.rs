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
