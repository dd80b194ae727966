//! Aggregation jobs under faults: a transient failure (a full disk, a key service down) is
//! retried without limit and never fails the task, a crash takeover is not a failure, a restarted
//! worker, or one that lost track of its lease, takes its own job back at once (its old lease
//! fenced off), and the operator can resume a round that failed.

use crate::common;

use std::time::Duration;

use common::system::{collect, now_clock, open_task, rounds, start};
use confed::clock::Clock;
use confed::db::DbError;
use confed::db::jobs::{MAX_RETRY_BACKOFF_MS, retry_backoff_ms};

async fn task_state(system: &confed::embedded::EmbeddedSystem, token: &str, task: &str) -> String {
    common::system::get(system, token, &format!("/v1/tasks/{task}"))
        .await
        .json::<serde_json::Value>()
        .await
        .unwrap()["state"]
        .as_str()
        .unwrap()
        .to_string()
}

const LEASE_MS: i64 = 60_000;
const LEASE: Duration = Duration::from_millis(LEASE_MS as u64);

/// ENOSPC while writing a release once used up all 5 attempts in ~31 s and failed the task for
/// good. Transient failures are now retried with a backoff capped at 5 minutes, without limit.
#[tokio::test]
async fn a_transient_failure_like_a_full_disk_is_retried_and_never_fails_the_task() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (token, task) = open_task(&system, "disk", 8.0).await;
    collect(&system, "disk", 1, false).await;
    for failure in 1..=12 {
        let job = system
            .db
            .lease_job("w/1", LEASE)
            .await
            .unwrap()
            .expect("the job is ready again after its backoff");
        system
            .db
            .fail_job(
                &job.round_id,
                &job.holder,
                "No space left on device (os error 28)",
                false,
            )
            .await
            .unwrap();
        let wait = retry_backoff_ms(failure);
        assert!(wait <= MAX_RETRY_BACKOFF_MS);
        clock.advance(Duration::from_millis(wait as u64 - 1));
        let early = system.db.lease_job("w/1", LEASE).await;
        assert!(
            early.unwrap().is_none(),
            "failure {failure}: backoff respected"
        );
        clock.advance(Duration::from_millis(1));
    }
    assert_eq!(retry_backoff_ms(12), MAX_RETRY_BACKOFF_MS, "capped");
    assert_eq!(task_state(&system, &token, &task).await, "OPEN");
    assert_eq!(system.db.failing_jobs(5).await.unwrap(), 1, "alerting");
    // Space is back: the next attempt releases the round.
    let outcome = system
        .worker("after")
        .run_once()
        .await
        .unwrap()
        .expect("a job");
    assert_eq!(outcome.round, 1);
    assert_eq!(
        rounds(&system, &token, &task).await[0]["state"],
        "COMPLETED"
    );
    assert_eq!(system.db.failing_jobs(5).await.unwrap(), 0);
}

/// Lease takeovers after crashes were counted as attempts; six crashes then failed the task.
#[tokio::test]
async fn crash_takeovers_are_not_failures() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (token, task) = open_task(&system, "crashes", 8.0).await;
    collect(&system, "crashes", 1, false).await;
    for crash in 0..8 {
        let job = system
            .db
            .lease_job(&format!("crashed-{crash}/x"), LEASE)
            .await
            .unwrap();
        assert!(job.is_some(), "crash {crash}");
        clock.advance(Duration::from_millis(LEASE_MS as u64));
    }
    assert_eq!(task_state(&system, &token, &task).await, "OPEN");
    let job = system.db.lease_job("w/1", LEASE).await.unwrap().unwrap();
    system
        .db
        .fail_job(&job.round_id, &job.holder, "transient", false)
        .await
        .unwrap();
    clock.advance(Duration::from_millis(retry_backoff_ms(1) as u64));
    assert!(
        system.db.lease_job("w/1", LEASE).await.unwrap().is_some(),
        "the first real failure waits 2 s, as a first failure does"
    );
}

/// A restarted worker (fixed name) could not reclaim its own lease and stalled ~60 s. A new
/// incarnation of the same name takes the job at once; another worker still cannot.
#[tokio::test]
async fn a_restarted_worker_takes_its_own_job_back_at_once() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    open_task(&system, "restart", 8.0).await;
    collect(&system, "restart", 1, false).await;
    let now = clock.now_millis().0;
    let before = system
        .db
        .lease_job("enclave-a/1111", LEASE)
        .await
        .unwrap()
        .unwrap();
    assert!(
        system
            .db
            .lease_job("enclave-b/2222", LEASE)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        system
            .db
            .lease_job("enclave-a", LEASE)
            .await
            .unwrap()
            .is_none()
    );
    let after = system
        .db
        .lease_job("enclave-a/3333", LEASE)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(before.round_id, after.round_id);
    assert!(matches!(
        system
            .db
            .renew_job(&before.round_id, &before.holder, LEASE)
            .await,
        Err(DbError::LeaseLost(_))
    ));
    // A job that keeps killing its worker: after a few immediate takeovers it waits for its
    // lease like any other, so it cannot hold every later round behind it.
    for incarnation in ["4444", "5555"] {
        let again = system
            .db
            .lease_job(&format!("enclave-a/{incarnation}"), LEASE)
            .await;
        assert!(again.unwrap().is_some(), "{incarnation}");
    }
    let stuck = system.db.lease_job("enclave-a/6666", LEASE).await;
    assert!(stuck.unwrap().is_none());
    clock.set(confed::clock::Millis(now + LEASE_MS));
    let later = system.db.lease_job("enclave-a/6666", LEASE).await;
    assert!(later.unwrap().is_some());
}

/// A round whose aggregation failed for good can be resumed by the operator: the job runs
/// again, the task reopens and the round completes.
#[tokio::test]
async fn the_operator_resumes_a_failed_round() {
    let clock = now_clock();
    let (system, _dir) = start(clock.clone()).await;
    let (token, task) = open_task(&system, "resume", 8.0).await;
    collect(&system, "resume", 1, false).await;
    assert!(
        matches!(
            system.db.resume_failed_round(&task, 1).await,
            Err(DbError::StateConflict { .. })
        ),
        "nothing failed yet"
    );
    let job = system.db.lease_job("w/1", LEASE).await.unwrap().unwrap();
    system
        .db
        .fail_job(&job.round_id, &job.holder, "given up", true)
        .await
        .unwrap();
    assert_eq!(task_state(&system, &token, &task).await, "FAILED");
    let failed = &rounds(&system, &token, &task).await[0];
    assert_eq!(failed["state"], "FAILED");
    assert_eq!(
        failed["failure_reason"], "aggregation failed: given up",
        "the partner reads why the round failed"
    );
    let task_body: serde_json::Value =
        common::system::get(&system, &token, &format!("/v1/tasks/{task}"))
            .await
            .json()
            .await
            .unwrap();
    assert_eq!(
        task_body["failure_reason"],
        "round 1 aggregation failed: given up"
    );
    let unverified = confed::verify::verify_release(&system.url, &token, &task, 1, &system.trust)
        .await
        .unwrap_err();
    assert_eq!(
        unverified.to_string(),
        format!(
            "round 1 of task {task} has no release on this server: its attempt 1 is FAILED: aggregation failed: given up"
        )
    );

    let resumed = system.db.resume_failed_round(&task, 1).await.unwrap();
    assert_eq!(resumed.round_state, confed::states::RoundState::Aggregating);
    assert_eq!(task_state(&system, &token, &task).await, "OPEN");
    assert!(
        rounds(&system, &token, &task).await[0]["failure_reason"].is_null(),
        "a resumed round is not failed"
    );
    let outcome = system
        .worker("w2")
        .run_once()
        .await
        .unwrap()
        .expect("the job runs again");
    assert_eq!(outcome.round, 1);
    assert_eq!(
        rounds(&system, &token, &task).await[0]["state"],
        "COMPLETED"
    );
    assert!(
        system.db.resume_failed_round(&task, 1).await.is_err(),
        "once"
    );
    // Every state change of the job is in the state history, under the round's id.
    let job_history: Vec<(Option<String>, String, String)> = system
        .db
        .history(&job.round_id)
        .await
        .unwrap()
        .into_iter()
        .filter(|h| h.entity == "aggregation job")
        .map(|h| (h.from_state, h.to_state, h.reason))
        .collect();
    assert_eq!(
        job_history,
        [
            (Some("PENDING".into()), "FAILED".into(), "given up".into()),
            (
                Some("FAILED".into()),
                "PENDING".into(),
                "resumed by the operator".into()
            ),
            (
                Some("PENDING".into()),
                "DONE".into(),
                "model version 1 stored".into()
            ),
        ]
    );
}
