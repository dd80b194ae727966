//! Witnessing that keeps up (issue 47): a peer far ahead of what a witness kept is followed over
//! several pulls, one page of its records in memory at a time, and its later rollback is caught;
//! a flood of far-ahead pushes runs one verification per peer at a time; a slow peer delays no
//! other peer's pushes; a legitimately acknowledged loss stops the alarms.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key services only; no task database or blob
//! store.

use crate::common;

use common::keyservices::*;
use confed::keyservice::KeyService;
use confed::keyservice::audit::Decision;
use confed::keyservice::peers::MAX_RECORDS_PER_ADVANCE;
use confed::keyservice::rollback::GateState;
use confed::keyservice::witness::{Observation, Via, observe, pull_peer};

use super::release_ledger::{Witnessing, bind, copy_state, witnessing_deployment};

/// Appends `count` refusal records to `service`'s log (what a flood of cheap refusals writes).
fn append_records(service: &KeyService, count: usize) {
    let mut guard = service.audit.lock().unwrap();
    for i in 0..count {
        guard
            .0
            .append(Decision {
                failed_checks: vec!["token".into()],
                nonce: format!("n{i}"),
                ..Decision::note(START, &service.id, "refused", "witness-follow test".into())
            })
            .unwrap();
    }
}

fn head_of(service: &KeyService) -> confed::keyservice::audit::SignedHead {
    service.audit.lock().unwrap().0.signed_head(&service.id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_4100_records_ahead_is_followed_and_its_later_rollback_caught() {
    let world = World::new(2, 3);
    let (mut services, urls) = witnessing_deployment(&world).await;
    let ks1 = services[0].service.clone();
    let peers = ks1.peers.clone().unwrap();
    let ks2_peer = peers.list.iter().find(|p| p.id == "ks2").unwrap().clone();
    // ks1 keeps ks2's head once; then ks2 grows by 4,100 records (a copy taken at 2,000).
    assert!(pull_peer(&ks1, &peers, &ks2_peer).await);
    let start = services[0].witnessed("ks2").unwrap().records;
    append_records(&services[1].service, 2_000);
    copy_state(&world, 2, "at-2000", false);
    append_records(&services[1].service, 2_100);
    let far = head_of(&services[1].service);
    assert_eq!(far.records, start + 4_100);

    // The first pull verifies as far as one call goes and keeps that signed point; the next
    // one reaches the head. No alarm on the way.
    let first = observe(&ks1, far.clone(), Via::Pull).await.unwrap();
    let Observation::Following { kept } = first else {
        panic!("a far head is followed part of the way: {first:?}")
    };
    assert_eq!(kept.records, start + MAX_RECORDS_PER_ADVANCE as u64);
    assert_eq!(services[0].witnessed("ks2"), Some(kept));
    assert_eq!(
        observe(&ks1, far.clone(), Via::Pull).await.unwrap(),
        Observation::Advanced
    );
    assert_eq!(services[0].witnessed("ks2"), Some(far.clone()));

    // ks2's log is cut back by 2,100 records (its copy restored): ks1 sees the rewind, and ks2,
    // asking its peers after the restart, closes.
    copy_state(&world, 2, "at-2000", true);
    let restored = services.remove(1).restart(&world, 2, &urls).await;
    let behind = head_of(&restored.service);
    assert_eq!(behind.records, start + 2_000);
    assert!(matches!(
        observe(&ks1, behind, Via::Pull).await.unwrap(),
        Observation::Rewound { witnessed } if witnessed == far
    ));
    let GateState::RolledBack { detail } = restored.ask_peers().await else {
        panic!("the rollback was not caught");
    };
    assert!(detail.contains(&far.hash), "{detail}");
}

/// A flood of far-ahead pushes used to make every push fetch and hold its own pages of records
/// (16 concurrent pushes: 16 to 313 MB). Now one verification of a peer runs at a time: a push
/// that arrives meanwhile is answered at once, fetches nothing and keeps nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_while_a_peer_is_being_verified_is_turned_away_without_fetching() {
    let world = World::new(2, 3);
    let (services, _urls) = witnessing_deployment(&world).await;
    let ks1 = services[0].service.clone();
    let peers = ks1.peers.clone().unwrap();
    let ks2_peer = peers.list.iter().find(|p| p.id == "ks2").unwrap().clone();
    assert!(pull_peer(&ks1, &peers, &ks2_peer).await);
    let before = services[0].witnessed("ks2");
    append_records(
        &services[1].service,
        3 * confed::keyservice::peers::MAX_RECORDS_PER_ANSWER,
    );
    let far = head_of(&services[1].service);
    // A verification of ks2 is under way (held here as the verifying push would hold it).
    assert!(ks1.witnesses.lock().unwrap().start_following("ks2"));
    for _ in 0..16 {
        assert_eq!(
            observe(&ks1, far.clone(), Via::Push).await.unwrap(),
            Observation::Busy
        );
    }
    assert_eq!(
        services[0].witnessed("ks2"),
        before,
        "nothing kept meanwhile"
    );
    ks1.witnesses.lock().unwrap().finish_following("ks2");
    // Once it ends, the next head is verified and kept.
    assert_eq!(
        observe(&ks1, far.clone(), Via::Push).await.unwrap(),
        Observation::Advanced
    );
    assert_eq!(services[0].witnessed("ks2"), Some(far));
}

/// Once a loss is acknowledged, peers ask for the acknowledgement at every pull: the record is
/// read from the log once and answered from the index afterwards (before, every request scanned
/// the whole log: 16 clients on a 200,000-record log starved honest exchanges).
#[tokio::test]
async fn the_acknowledgement_route_answers_from_an_index_not_a_scan() {
    confed_protocol::http::install_crypto_provider(); // for the plain reqwest client below
    let world = World::new(2, 3);
    let log = world.dir.path().join("audit-ks1.jsonl");
    // ks1 writes 5 records; its log is then cut back to 3 and the loss acknowledged.
    let lost = {
        let service = world.service(1, Behaviour::Honest, &world.share_files[0..1]);
        append_records(&service, 5);
        head_of(&service)
    };
    let text = std::fs::read_to_string(&log).unwrap();
    let kept: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
    std::fs::write(&log, kept).unwrap();
    let _ = std::fs::remove_file(confed::keyservice::checkpoint::path_for(&log));
    confed::keyservice::acknowledge::acknowledge_loss(
        &log,
        "ks1",
        std::sync::Arc::new(world.signing_key(1)),
        confed::keyservice::audit::LostHead {
            records: lost.records,
            hash: lost.hash.clone(),
        },
        lost.signature.as_deref().unwrap(),
        "test: the last two records were lost",
        START,
    )
    .unwrap();
    let service = world.service(1, Behaviour::Honest, &world.share_files[0..1]);
    let url = serve(confed::keyservice::routes::router(service)).await;
    let ask = || async {
        let answer: serde_json::Value = reqwest::get(format!(
            "{url}/v1/audit/acknowledgement?records={}&hash={}",
            lost.records, lost.hash
        ))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
        answer["record"]["acknowledged_loss"]["records"].as_u64()
    };
    assert_eq!(ask().await, Some(lost.records));
    // With the log out of reach, a scan would fail: the answer comes from the index.
    let aside = log.with_extension("aside");
    std::fs::rename(&log, &aside).unwrap();
    for _ in 0..3 {
        assert_eq!(ask().await, Some(lost.records));
    }
    std::fs::rename(&aside, &log).unwrap();
}

/// A peer that lost more records than it has written since, and acknowledged the loss: its new
/// head is behind the one kept of it. Peers used to alarm at every pull for good; now they
/// follow its history from its signed acknowledgement, and its start is not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_legitimate_acknowledgement_peers_follow_a_shorter_history_without_alarm() {
    let world = World::new(2, 3);
    let (mut services, urls) = witnessing_deployment(&world).await;
    let ks1 = services[0].service.clone();
    let peers = ks1.peers.clone().unwrap();
    let ks2_peer = peers.list.iter().find(|p| p.id == "ks2").unwrap().clone();
    copy_state(&world, 2, "early", false);
    append_records(&services[1].service, 10);
    assert!(pull_peer(&ks1, &peers, &ks2_peer).await);
    let lost = services[0].witnessed("ks2").unwrap();
    assert!(lost.records >= 10);

    // ks2's disk is lost; it comes back from the early copy (10 records short), its operator
    // acknowledges the loss of the head ks1 witnessed, and ks2 starts again.
    copy_state(&world, 2, "early", true);
    confed::keyservice::acknowledge::acknowledge_loss(
        &world.dir.path().join("audit-ks2.jsonl"),
        "ks2",
        std::sync::Arc::new(world.signing_key(2)),
        confed::keyservice::audit::LostHead {
            records: lost.records,
            hash: lost.hash.clone(),
        },
        lost.signature.as_deref().unwrap(),
        "test: disk lost, restored from the early copy",
        START,
    )
    .unwrap();
    let ks2 = services.remove(1).restart(&world, 2, &urls).await;
    let now = head_of(&ks2.service);
    assert!(now.records < lost.records, "the new history is shorter");
    assert_eq!(
        observe(&ks1, now.clone(), Via::Pull).await.unwrap(),
        Observation::Advanced,
        "followed from the acknowledgement, no alarm"
    );
    assert_eq!(services[0].witnessed("ks2"), Some(now.clone()));
    assert_eq!(
        observe(&ks1, now, Via::Pull).await.unwrap(),
        Observation::Same
    );
    assert_eq!(ks2.ask_peers().await, GateState::Open);
    // A later record of ks2 extends it as usual.
    append_records(&ks2.service, 1);
    assert_eq!(
        observe(&ks1, head_of(&ks2.service), Via::Pull)
            .await
            .unwrap(),
        Observation::Advanced
    );
}

/// A peer that never answers (each call held until `PEER_TIMEOUT`): pulls and pushes used to
/// share one task, so a fake peer answering slowly held back the push of a new grant to every
/// other peer. Each peer now has a task of its own: ks1's new head reaches ks3 while ks2 still
/// holds ks1's calls, before the two `PEER_TIMEOUT`s that shared task would have waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_peer_does_not_delay_pushes_to_the_others() {
    use confed::keyservice::peers::PEER_TIMEOUT;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let world = World::new(2, 3);
    let held = std::sync::Arc::new(AtomicUsize::new(0));
    let holding = held.clone();
    // ks2 takes every call and never answers.
    let slow = axum::Router::new().fallback(move || {
        let holding = holding.clone();
        async move {
            holding.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await
        }
    });
    let slow_url = serve(slow).await;
    let ((l1, url1), (l3, url3)) = (bind().await, bind().await);
    let urls = [url1, slow_url, url3];
    let ks1 = Witnessing::start(&world, 1, &urls, None, l1).await;
    let ks3 = Witnessing::start(&world, 3, &urls, None, l3).await;
    let peers = ks1.service.peers.clone().unwrap();
    assert_eq!(peers.list[0].id, "ks2", "the slow peer comes first");
    let witnessing = tokio::spawn(confed::keyservice::witness::run(
        ks1.service.clone(),
        peers,
        std::time::Duration::from_secs(3600),
    ));
    // The first pulls are under way (ks2's held); then ks1 writes a record (as a grant does).
    let waited = tokio::time::timeout(PEER_TIMEOUT, async {
        while held.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "ks1 called ks2");
    append_records(&ks1.service, 1);
    ks1.service.head_changed.notify_one();
    let new_head = head_of(&ks1.service);
    // Sharing one task, the push would wait for ks2's pull and then for the push to ks2 first:
    // two `PEER_TIMEOUT`s. Alone it takes milliseconds.
    let bound = 2 * PEER_TIMEOUT - std::time::Duration::from_secs(1);
    let reached = tokio::time::timeout(bound, async {
        loop {
            if ks3.witnessed("ks1").as_ref() == Some(&new_head) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        reached.is_ok(),
        "ks3 did not witness ks1's new head while ks2 held ks1's calls"
    );
    assert!(held.load(Ordering::SeqCst) >= 1);
    witnessing.abort();
}
