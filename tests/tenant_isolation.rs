//! Tenant isolation: every tenant route of tenant A, called with tenant B's token, answers exactly
//! what a missing task answers (404), and never any of A's data.

mod common;

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
            Some(task_body(json!({}))),
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
