//! Round deadlines, driven by the scheduler with an injected clock (no sleeping).

use crate::common;

use std::time::Duration;

use axum::http::Method;
use common::TestApp;
use confed::scheduler::{Scheduler, TickSummary};
use confed::states::AssignmentState;
use serde_json::{Value, json};

async fn rounds(app: &TestApp, token: &str, task: &str) -> Vec<Value> {
    let reply = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}/rounds"),
            Some(token),
            None,
        )
        .await;
    reply.json()["rounds"].as_array().unwrap().clone()
}

async fn task_state(app: &TestApp, token: &str, task: &str) -> String {
    let reply = app
        .call(Method::GET, &format!("/v1/tasks/{task}"), Some(token), None)
        .await;
    reply.json()["state"].as_str().unwrap().to_string()
}

async fn round_id(app: &TestApp, task: &str) -> String {
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let rounds = app.db.rounds(&tenant.id, task).await.unwrap();
    rounds.last().unwrap().id.clone()
}

/// Gives the current round `n` completed reports.
async fn complete_reports(app: &TestApp, task: &str, n: usize) {
    let round = round_id(app, task).await;
    let now = common::START_MILLIS;
    for _ in 0..n {
        let id = app
            .db
            .insert_assignment(&round, now + 60_000)
            .await
            .unwrap();
        app.db
            .transition_assignment(
                &id,
                AssignmentState::Assigned,
                AssignmentState::Uploaded,
                "uploaded",
            )
            .await
            .unwrap();
        app.db
            .transition_assignment(
                &id,
                AssignmentState::Uploaded,
                AssignmentState::Completed,
                "reported",
            )
            .await
            .unwrap();
    }
}

fn scheduler(app: &TestApp) -> Scheduler {
    Scheduler::new(app.db.clone())
}

#[tokio::test]
async fn nothing_happens_before_the_deadline() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app
        .open_task(&token, json!({"round_deadline_seconds": 600}))
        .await;
    app.clock.advance(Duration::from_secs(599));
    assert_eq!(
        scheduler(&app).tick().await.unwrap(),
        TickSummary::default()
    );
    assert_eq!(rounds(&app, &token, &task).await[0]["state"], "COLLECTING");
}

#[tokio::test]
async fn round_with_too_few_reports_fails_at_deadline_and_a_new_attempt_opens() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app.open_task(&token, json!({"min_reports": 5})).await;
    complete_reports(&app, &task, 4).await;
    app.clock.advance(Duration::from_secs(600));
    let summary = scheduler(&app).tick().await.unwrap();
    assert_eq!(
        summary,
        TickSummary {
            retried: 1,
            ..Default::default()
        }
    );
    let rounds = rounds(&app, &token, &task).await;
    assert_eq!(rounds.len(), 2);
    assert_eq!(rounds[0]["state"], "FAILED");
    assert_eq!(rounds[0]["reports_received"], 4);
    assert_eq!(rounds[0]["closed_at"], "2027-01-15T08:10:00Z");
    assert_eq!(
        (rounds[1]["round"].as_i64(), rounds[1]["attempt"].as_i64()),
        (Some(1), Some(2))
    );
    assert_eq!(rounds[1]["state"], "COLLECTING");
    assert_eq!(rounds[1]["deadline"], "2027-01-15T08:20:00Z");
    assert_eq!(task_state(&app, &token, &task).await, "OPEN");
    // A second tick at the same time finds nothing more to do.
    assert_eq!(
        scheduler(&app).tick().await.unwrap(),
        TickSummary::default()
    );
}

#[tokio::test]
async fn task_fails_after_its_last_attempt() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app
        .open_task(&token, json!({"max_round_attempts": 2}))
        .await;
    let s = scheduler(&app);
    app.clock.advance(Duration::from_secs(600));
    assert_eq!(s.tick().await.unwrap().retried, 1);
    app.clock.advance(Duration::from_secs(600));
    assert_eq!(s.tick().await.unwrap().tasks_failed, 1);
    assert_eq!(task_state(&app, &token, &task).await, "FAILED");
    let rounds = rounds(&app, &token, &task).await;
    assert!(rounds.iter().all(|r| r["state"] == "FAILED"));
    assert_eq!(rounds.len(), 2);
    let why = rounds[1]["failure_reason"].as_str().unwrap();
    assert!(
        why.starts_with("deadline reached with 0 reports, fewer than the minimum")
            && why.contains("round_deadline_seconds"),
        "{why}"
    );
    let body = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}"),
            Some(&token),
            None,
        )
        .await
        .json();
    let task_why = body["failure_reason"].as_str().unwrap();
    assert!(
        task_why.starts_with("round 1 failed 2 times, the task's max_round_attempts; the last attempt: deadline reached"),
        "{task_why}"
    );
    let history = app.db.history(&task).await.unwrap();
    let last = history.last().unwrap();
    assert_eq!(last.to_state, "FAILED");
    assert!(
        last.reason.contains("max_round_attempts"),
        "{}",
        last.reason
    );
}

#[tokio::test]
async fn round_with_enough_reports_moves_to_aggregating_at_deadline() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app
        .open_task(&token, json!({"min_reports": 3, "report_goal": 10}))
        .await;
    complete_reports(&app, &task, 3).await;
    app.clock.advance(Duration::from_secs(601));
    assert_eq!(scheduler(&app).tick().await.unwrap().aggregating, 1);
    let rounds = rounds(&app, &token, &task).await;
    assert_eq!(rounds.len(), 1);
    assert_eq!(rounds[0]["state"], "AGGREGATING");
    assert_eq!(rounds[0]["reports_received"], 3);
    assert_eq!(rounds[0]["closed_at"], Value::Null);
}

#[tokio::test]
async fn cancelled_task_rounds_are_not_touched_by_the_scheduler() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app.open_task(&token, json!({})).await;
    app.call(
        Method::POST,
        &format!("/v1/tasks/{task}/cancel"),
        Some(&token),
        None,
    )
    .await;
    app.clock.advance(Duration::from_secs(3600));
    assert_eq!(
        scheduler(&app).tick().await.unwrap(),
        TickSummary::default()
    );
    assert_eq!(rounds(&app, &token, &task).await.len(), 1);
}
