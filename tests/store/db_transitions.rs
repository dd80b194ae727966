//! Persisted state transitions: compare-and-set on the old state, refusal of transitions the state
//! machine does not allow, and one history row per transition.

use crate::common;

use common::{START_MILLIS, TestApp};
use confed::db::DbError;
use confed::states::AssignmentState::{self, *};
use serde_json::json;

async fn assignment(app: &TestApp) -> String {
    let token = app.tenant("acme").await;
    let task = app.open_task(&token, json!({})).await;
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let round = app.db.rounds(&tenant.id, &task).await.unwrap().remove(0);
    app.db
        .insert_assignment(&round.id, START_MILLIS + 1000)
        .await
        .unwrap()
}

#[tokio::test]
async fn allowed_transition_applies_and_appends_history() {
    let app = TestApp::new().await;
    let id = assignment(&app).await;
    app.clock.advance(std::time::Duration::from_millis(5));
    app.db
        .transition_assignment(&id, Assigned, Uploaded, "bytes stored")
        .await
        .unwrap();
    assert_eq!(app.db.assignment_state(&id).await.unwrap(), Uploaded);
    let history = app.db.history(&id).await.unwrap();
    assert_eq!(history.len(), 2);
    assert_eq!(history[1].from_state.as_deref(), Some("ASSIGNED"));
    assert_eq!(history[1].to_state, "UPLOADED");
    assert_eq!(history[1].reason, "bytes stored");
    assert_eq!(history[1].at, START_MILLIS + 5);
}

#[tokio::test]
async fn stale_old_state_is_a_conflict_and_changes_nothing() {
    let app = TestApp::new().await;
    let id = assignment(&app).await;
    app.db
        .transition_assignment(&id, Assigned, TimedOut, "expired")
        .await
        .unwrap();
    let err = app
        .db
        .transition_assignment(&id, Assigned, Uploaded, "late")
        .await
        .unwrap_err();
    assert!(
        matches!(err, DbError::StateConflict { ref found, .. } if found == "TIMED_OUT"),
        "{err}"
    );
    assert_eq!(app.db.assignment_state(&id).await.unwrap(), TimedOut);
    assert_eq!(app.db.history(&id).await.unwrap().len(), 2);
}

#[tokio::test]
async fn every_disallowed_transition_is_refused_before_touching_the_row() {
    let app = TestApp::new().await;
    let id = assignment(&app).await;
    for &to in <AssignmentState as confed::states::StateMachine>::ALL {
        if matches!(to, Uploaded | Failed | TimedOut | Rejected) {
            continue;
        }
        let err = app
            .db
            .transition_assignment(&id, Assigned, to, "x")
            .await
            .unwrap_err();
        assert!(
            matches!(err, DbError::IllegalTransition { .. }),
            "ASSIGNED -> {to:?}: {err}"
        );
    }
    let err = app
        .db
        .transition_assignment(&id, Completed, Failed, "x")
        .await
        .unwrap_err();
    assert!(matches!(err, DbError::IllegalTransition { .. }));
    assert_eq!(app.db.assignment_state(&id).await.unwrap(), Assigned);
    assert_eq!(app.db.history(&id).await.unwrap().len(), 1);
}

#[tokio::test]
async fn transition_of_unknown_entity_is_not_found() {
    let app = TestApp::new().await;
    let err = app
        .db
        .transition_assignment("nope", Assigned, Uploaded, "x")
        .await
        .unwrap_err();
    assert!(matches!(err, DbError::NotFound { .. }));
}

#[tokio::test]
async fn concurrent_cancels_apply_exactly_once() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app.open_task(&token, json!({})).await;
    let tenant = app.db.list_tenants().await.unwrap().remove(0);
    let attempts = (0..8).map(|_| {
        let db = app.db.clone();
        let (tenant, task) = (tenant.id.clone(), task.clone());
        tokio::spawn(async move { db.cancel_task(&tenant, &task).await })
    });
    let mut ok = 0;
    for attempt in attempts {
        match attempt.await.unwrap() {
            Ok(_) => ok += 1,
            Err(DbError::StateConflict { .. }) => {}
            Err(other) => panic!("unexpected error {other}"),
        }
    }
    assert_eq!(ok, 1);
    let cancels = app
        .db
        .history(&task)
        .await
        .unwrap()
        .into_iter()
        .filter(|h| h.to_state == "CANCELLED")
        .count();
    assert_eq!(cancels, 1);
}
