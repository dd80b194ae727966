//! The deployment's scheduling policy decides which fitting task a checking-in device serves
//! (src/scheduling.rs), on each database engine: fair share (the least-filled round first, the
//! default), first come first served (the oldest task), shortest remaining demand.

use crate::common;

use std::time::Duration;

use axum::http::StatusCode;
use common::TestApp;
use confed::scheduling::SchedulingPolicy;
use serde_json::json;

/// Two open tasks on one population: an older one needing 5 rounds of 10 reports, then a newer
/// one needing 1 round of 2.
async fn two_tasks(app: &TestApp) -> (String, String) {
    let token = app.tenant("acme").await;
    let old = app
        .open_task(
            &token,
            json!({"rounds": 5, "report_goal": 10, "min_reports": 10}),
        )
        .await;
    app.clock.advance(Duration::from_secs(1));
    let new = app
        .open_task(
            &token,
            json!({"rounds": 1, "report_goal": 2, "min_reports": 2}),
        )
        .await;
    (old, new)
}

/// The task each of `n` check-ins is assigned to.
async fn assigned_tasks(app: &TestApp, n: usize) -> Vec<String> {
    let mut tasks = Vec::new();
    for _ in 0..n {
        let reply = app.check_in().await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        tasks.push(reply.json()["task_id"].as_str().unwrap().to_string());
    }
    tasks
}

#[tokio::test]
async fn fair_share_alternates_between_tasks_as_their_rounds_fill() {
    for (engine, app) in TestApp::on_each_engine().await {
        let (old, new) = two_tasks(&app).await;
        // Both empty: the earlier deadline (the older task's) first; then the emptier round.
        assert_eq!(
            assigned_tasks(&app, 3).await,
            [old.clone(), new, old],
            "{engine}"
        );
    }
}

#[tokio::test]
async fn first_come_first_served_gives_the_oldest_task_every_device_it_can_take() {
    for (engine, app) in TestApp::on_each_engine().await {
        let app = app.with_scheduling(SchedulingPolicy::FirstComeFirstServed);
        let (old, _) = two_tasks(&app).await;
        assert_eq!(
            assigned_tasks(&app, 3).await,
            [old.clone(), old.clone(), old],
            "{engine}"
        );
    }
}

#[tokio::test]
async fn shortest_remaining_demand_serves_the_task_closest_to_done() {
    for (engine, app) in TestApp::on_each_engine().await {
        let app = app.with_scheduling(SchedulingPolicy::ShortestRemainingDemand);
        let (old, new) = two_tasks(&app).await;
        // The newer task needs 2 contributions; once both are out (its round holds 3 with
        // over-selection), its demand is 0 and it keeps the lead until its round is full.
        let tasks = assigned_tasks(&app, 4).await;
        assert_eq!(tasks[..3], [new.clone(), new.clone(), new], "{engine}");
        assert_eq!(tasks[3], old, "{engine}: the newer task's round is full");
    }
}
