//! Tenant isolation: every tenant route of tenant A, called with tenant B's token, answers exactly
//! what a missing task answers (404), and never any of A's data.

use crate::common;

use axum::http::{Method, StatusCode};
use common::{TestApp, model_bytes, task_body};
use serde_json::json;

#[tokio::test]
async fn tenant_b_cannot_see_or_touch_tenant_a_tasks() {
    let app = TestApp::new().await;
    let alice = app.tenant("alice").await;
    let bob = app.tenant("bob").await;
    let task = app
        .open_task(&alice, json!({"population": "alice-secret-population"}))
        .await;
    let pending = app.create_task(&alice, json!({})).await;

    let attempts = [
        (Method::GET, format!("/v1/tasks/{task}")),
        (Method::POST, format!("/v1/tasks/{task}/cancel")),
        (Method::GET, format!("/v1/tasks/{task}/rounds")),
        (Method::GET, format!("/v1/tasks/{task}/models/0")),
    ];
    for (method, path) in attempts {
        let as_bob = app.call(method.clone(), &path, Some(&bob), None).await;
        let problem = as_bob.problem(StatusCode::NOT_FOUND);
        let missing = app
            .call(
                method.clone(),
                &path.replace(&task, "00000000-0000-4000-8000-000000000000"),
                Some(&bob),
                None,
            )
            .await;
        assert_eq!(missing.status, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(problem["title"], missing.json()["title"]);
        assert!(
            !String::from_utf8_lossy(&as_bob.body).contains("alice-secret"),
            "{method} {path}"
        );
        let unauthenticated = app.call(method.clone(), &path, None, None).await;
        unauthenticated.problem(StatusCode::UNAUTHORIZED);
    }
    app.put_bytes(&format!("/v1/tasks/{pending}/model"), &bob, model_bytes())
        .await
        .problem(StatusCode::NOT_FOUND);

    let bobs_list = app
        .call(Method::GET, "/v1/tasks", Some(&bob), None)
        .await
        .json();
    assert_eq!(bobs_list["tasks"].as_array().unwrap().len(), 0);
    let bobs_task = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&bob),
            Some(task_body(json!({"population": "bob.phones"}))),
        )
        .await;
    assert_eq!(bobs_task.status, StatusCode::CREATED);

    // Alice's task is untouched by Bob's attempts.
    let alice_view = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}"),
            Some(&alice),
            None,
        )
        .await
        .json();
    assert_eq!(alice_view["state"], "OPEN");
    let alice_pending = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{pending}"),
            Some(&alice),
            None,
        )
        .await
        .json();
    assert_eq!(alice_pending["state"], "CREATED");
    let alice_list = app
        .call(Method::GET, "/v1/tasks", Some(&alice), None)
        .await
        .json();
    assert_eq!(alice_list["tasks"].as_array().unwrap().len(), 2);
}

/// Populations were a global namespace: a second tenant created a task on a partner's population
/// (epsilon 100, report goal 1, its own model and plan) and received its devices.
#[tokio::test]
async fn a_second_tenant_cannot_take_another_tenants_population() {
    let app = TestApp::new().await;
    let alice = app.tenant("alice").await;
    let mallory = app.tenant("mallory").await;
    let task = app
        .open_task(&alice, json!({"population": "alice.phones"}))
        .await;
    let greedy = task_body(
        json!({"population": "alice.phones", "report_goal": 1, "min_reports": 1,
        "privacy": {"epsilon": 100.0, "delta": 1e-6, "clip_norm": 1.0}}),
    );
    let problem = app
        .call(Method::POST, "/v1/tasks", Some(&mallory), Some(greedy))
        .await
        .problem(StatusCode::CONFLICT);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("another tenant"),
        "{problem}"
    );
    app.call(
        Method::PUT,
        "/v1/populations/alice.phones",
        Some(&mallory),
        None,
    )
    .await
    .problem(StatusCode::CONFLICT);

    // Alice owns it (her first task claimed it); registering again is a 200.
    let listed = app
        .call(Method::GET, "/v1/populations", Some(&alice), None)
        .await
        .json();
    assert_eq!(listed["populations"][0]["name"], "alice.phones");
    let again = app
        .call(
            Method::PUT,
            "/v1/populations/alice.phones",
            Some(&alice),
            None,
        )
        .await;
    assert_eq!(again.status, StatusCode::OK);
    let fresh = app
        .call(
            Method::PUT,
            "/v1/populations/mallory.phones",
            Some(&mallory),
            None,
        )
        .await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    let theirs = app
        .call(Method::GET, "/v1/populations", Some(&mallory), None)
        .await
        .json();
    assert_eq!(
        theirs["populations"].as_array().unwrap().len(),
        1,
        "{theirs}"
    );

    // Every device of the population goes to alice's task.
    let device = json!({"client_version": "1.4.0"});
    let reply = app
        .call(
            Method::POST,
            "/v1/populations/alice.phones/checkin",
            None,
            Some(device),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.json()["task_id"], task.as_str());
}

/// A device may pin the tenant it works for; a population of another tenant then assigns nothing.
#[tokio::test]
async fn a_device_pinned_to_a_tenant_gets_no_other_tenants_task() {
    let app = TestApp::new().await;
    let alice = app.tenant("alice").await;
    app.open_task(&alice, json!({"population": "shared.name"}))
        .await;
    let alice_id = app.db.list_tenants().await.unwrap()[0].id.clone();
    let pinned = |tenant: &str| json!({"client_version": "1.4.0", "tenant_id": tenant});
    let reply = app
        .call(
            Method::POST,
            "/v1/populations/shared.name/checkin",
            None,
            Some(pinned("someone-else")),
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["reason"], "tenant_mismatch");
    let reply = app
        .call(
            Method::POST,
            "/v1/populations/shared.name/checkin",
            None,
            Some(pinned(&alice_id)),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
}

/// The operator may hand a population to another tenant, but not from under an active task.
#[tokio::test]
async fn the_operator_assigns_populations_but_not_from_under_an_active_task() {
    let app = TestApp::new().await;
    let alice = app.tenant("alice").await;
    app.tenant("bob").await;
    let task = app.open_task(&alice, json!({"population": "p1"})).await;
    let tenants = app.db.list_tenants().await.unwrap();
    let bob_id = tenants.iter().find(|t| t.name == "bob").unwrap().id.clone();
    let assign = |tenant: &str| json!({"tenant_id": tenant});
    app.call(
        Method::PUT,
        "/v1/admin/populations/p1",
        Some(common::ADMIN_TOKEN),
        Some(assign(&bob_id)),
    )
    .await
    .problem(StatusCode::CONFLICT);
    app.call(
        Method::POST,
        &format!("/v1/tasks/{task}/cancel"),
        Some(&alice),
        None,
    )
    .await;
    let moved = app
        .call(
            Method::PUT,
            "/v1/admin/populations/p1",
            Some(common::ADMIN_TOKEN),
            Some(assign(&bob_id)),
        )
        .await;
    assert_eq!(
        moved.status,
        StatusCode::OK,
        "{:?}",
        String::from_utf8_lossy(&moved.body)
    );
    assert_eq!(moved.json()["tenant_id"], bob_id.as_str());
    app.call(
        Method::PUT,
        "/v1/admin/populations/p2",
        Some(common::ADMIN_TOKEN),
        Some(assign("nobody")),
    )
    .await
    .problem(StatusCode::NOT_FOUND);
}

/// An operator that takes a population with `cancel_active_tasks` cancels the tasks on it, and
/// their partner reads that the operator did it, not that they did.
#[tokio::test]
async fn tasks_the_operator_cancels_to_move_a_population_say_so() {
    let app = TestApp::new().await;
    let alice = app.tenant("alice").await;
    app.tenant("bob").await;
    let task = app.open_task(&alice, json!({"population": "p1"})).await;
    let tenants = app.db.list_tenants().await.unwrap();
    let bob_id = tenants.iter().find(|t| t.name == "bob").unwrap().id.clone();
    let moved = app
        .call(
            Method::PUT,
            "/v1/admin/populations/p1",
            Some(common::ADMIN_TOKEN),
            Some(json!({"tenant_id": bob_id, "cancel_active_tasks": true})),
        )
        .await;
    assert_eq!(moved.status, StatusCode::OK);
    let cancelled = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}"),
            Some(&alice),
            None,
        )
        .await
        .json();
    assert_eq!(cancelled["state"], "CANCELLED");
    assert_eq!(
        cancelled["failure_reason"],
        "cancelled by the operator: its population was given to another tenant"
    );
}
