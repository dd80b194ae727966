//! Operator routes (admin API), health, metrics, OpenAPI and the unknown-route fallback.

use crate::common;

use axum::http::{Method, StatusCode, header};
use common::{ADMIN_TOKEN, TestApp};
use confed::app::Limits;
use serde_json::json;

#[tokio::test]
async fn admin_creates_a_tenant_whose_token_works_once_shown() {
    let app = TestApp::new().await;
    let reply = app
        .call(
            Method::POST,
            "/v1/admin/tenants",
            Some(ADMIN_TOKEN),
            Some(json!({"name": "acme", "max_active_tasks": 3})),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let created = reply.json();
    assert_eq!(created["name"], "acme");
    assert_eq!(created["max_active_tasks"], 3);
    assert_eq!(created["max_report_goal"], 10_000);
    let token = created["token"].as_str().unwrap();
    let tasks = app.call(Method::GET, "/v1/tasks", Some(token), None).await;
    assert_eq!(tasks.status, StatusCode::OK);

    let list = app
        .call(Method::GET, "/v1/admin/tenants", Some(ADMIN_TOKEN), None)
        .await;
    assert_eq!(list.status, StatusCode::OK);
    let text = String::from_utf8(list.body.clone()).unwrap();
    assert!(
        !text.contains(token),
        "tenant list must never include tokens"
    );
    assert_eq!(list.json()["tenants"][0]["name"], "acme");
}

#[tokio::test]
async fn admin_refuses_duplicates_bad_names_and_wrong_tokens() {
    let app = TestApp::new().await;
    app.tenant("acme").await;
    app.call(
        Method::POST,
        "/v1/admin/tenants",
        Some(ADMIN_TOKEN),
        Some(json!({"name": "acme"})),
    )
    .await
    .problem(StatusCode::CONFLICT);
    let problem = app
        .call(
            Method::POST,
            "/v1/admin/tenants",
            Some(ADMIN_TOKEN),
            Some(json!({"name": "Not Valid", "max_report_goal": 0})),
        )
        .await
        .problem(StatusCode::BAD_REQUEST);
    assert_eq!(problem["invalid_params"].as_array().unwrap().len(), 2);
    let tenant_token = app.tenant("other").await;
    for token in [None, Some("wrong"), Some(tenant_token.as_str())] {
        app.call(Method::GET, "/v1/admin/tenants", token, None)
            .await
            .problem(StatusCode::UNAUTHORIZED);
        app.call(
            Method::POST,
            "/v1/admin/tenants",
            token,
            Some(json!({"name": "x"})),
        )
        .await
        .problem(StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test]
async fn admin_api_is_off_without_an_admin_token() {
    let app = TestApp::with(None, Limits::default()).await;
    let problem = app
        .call(Method::GET, "/v1/admin/tenants", Some(ADMIN_TOKEN), None)
        .await
        .problem(StatusCode::NOT_FOUND);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("CONFED_ADMIN_TOKEN")
    );
    app.call(
        Method::POST,
        "/v1/admin/tenants",
        Some(ADMIN_TOKEN),
        Some(json!({"name": "x"})),
    )
    .await
    .problem(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn healthz_answers_ok() {
    let app = TestApp::new().await;
    let reply = app.call(Method::GET, "/healthz", None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, b"ok");
    let reply = app.call(Method::GET, "/readyz", None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, b"ready");
}

#[tokio::test]
async fn openapi_documents_every_route() {
    let app = TestApp::new().await;
    let doc = app
        .call(Method::GET, "/v1/openapi.json", None, None)
        .await
        .json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let expected = [
        ("/v1/tasks", "post"),
        ("/v1/tasks", "get"),
        ("/v1/tasks/{id}", "get"),
        ("/v1/tasks/{id}/cancel", "post"),
        ("/v1/tasks/{id}/rounds", "get"),
        ("/v1/tasks/{id}/model", "put"),
        ("/v1/tasks/{id}/models/{version}", "get"),
        ("/v1/admin/tenants", "post"),
        ("/v1/admin/tenants", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    ];
    for (path, method) in expected {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} missing from OpenAPI"
        );
    }
    assert!(doc["components"]["schemas"]["CreateTaskRequest"].is_object());
    assert!(doc["components"]["securitySchemes"]["tenant_token"].is_object());
}

/// Every `$ref` in a document names something the document has.
fn refs(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, inner) in map {
                match (key.as_str(), inner.as_str()) {
                    ("$ref", Some(target)) => out.push(target.to_string()),
                    _ => refs(inner, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| refs(v, out)),
        _ => {}
    }
}

/// The ranges and patterns the server enforces were only in the docs, so schema-valid requests
/// were refused; `limit`/`page_token` were declared in the path; 400/408/415/500 were missing.
#[tokio::test]
async fn openapi_declares_the_enforced_ranges_query_parameters_and_common_errors() {
    let app = TestApp::new().await;
    let doc = app
        .call(Method::GET, "/v1/openapi.json", None, None)
        .await
        .json();
    let mut targets = Vec::new();
    refs(&doc, &mut targets);
    for target in targets {
        let pointer = target.trim_start_matches('#');
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {target}");
    }

    let list = &doc["paths"]["/v1/tasks"]["get"];
    let params = list["parameters"].as_array().unwrap();
    for name in ["limit", "page_token"] {
        let param = params.iter().find(|p| p["name"] == name).unwrap();
        assert_eq!(param["in"], "query", "{name}");
    }
    let limit = params.iter().find(|p| p["name"] == "limit").unwrap();
    assert_eq!(
        (
            limit["schema"]["minimum"].as_f64(),
            limit["schema"]["maximum"].as_f64()
        ),
        (Some(1.0), Some(100.0))
    );

    let create = &doc["paths"]["/v1/tasks"]["post"]["responses"];
    for status in ["400", "408", "413", "415", "500", "503", "507"] {
        assert!(create[status].is_object(), "POST /v1/tasks lacks {status}");
    }
    let upload = &doc["paths"]["/v1/assignments/{assignment_id}/contribution"]["put"]["responses"];
    for status in ["404", "408", "413", "415", "500", "507"] {
        assert!(upload[status].is_object(), "upload lacks {status}");
    }

    let schemas = &doc["components"]["schemas"];
    let task = &schemas["CreateTaskRequest"]["properties"];
    assert_eq!(task["rounds"]["maximum"].as_f64(), Some(10000.0));
    assert_eq!(task["population"]["pattern"], "^[A-Za-z0-9._-]{1,128}$");
    assert_eq!(task["constraints"]["maxProperties"], 32);
    let privacy = &schemas["PrivacyBudget"]["properties"];
    assert_eq!(privacy["clip_norm"]["minimum"].as_f64(), Some(1e-6));
    assert_eq!(privacy["epsilon"]["exclusiveMinimum"].as_f64(), Some(0.0));
    let checkin = &schemas["CheckinRequest"]["properties"];
    assert_eq!(checkin["attributes"]["maxProperties"], 32);
    assert!(checkin["client_version"]["pattern"].is_string());
}

#[tokio::test]
async fn metrics_count_requests_per_route_and_tasks_by_state() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    app.create_task(&token, json!({})).await;
    app.call(Method::GET, "/v1/tasks/missing", Some(&token), None)
        .await;
    let reply = app.call(Method::GET, "/metrics", None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        reply.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = String::from_utf8(reply.body).unwrap();
    assert!(
        text.contains("http_requests_total{route=\"/v1/tasks\",method=\"POST\",status=\"201\"}"),
        "{text}"
    );
    assert!(
        text.contains(
            "http_requests_total{route=\"/v1/tasks/{id}\",method=\"GET\",status=\"404\"}"
        ),
        "{text}"
    );
    assert!(
        text.contains("http_request_duration_seconds_bucket{route=\"/v1/tasks\""),
        "{text}"
    );
    assert!(text.contains("confed_tasks{state=\"CREATED\"}"), "{text}");
    assert!(
        text.contains("confed_rounds{state=\"COLLECTING\"}"),
        "{text}"
    );
}

#[tokio::test]
async fn unknown_route_is_a_problem_404() {
    let app = TestApp::new().await;
    let problem = app
        .call(Method::GET, "/v2/nothing", None, None)
        .await
        .problem(StatusCode::NOT_FOUND);
    assert!(problem["detail"].as_str().unwrap().contains("/v2/nothing"));
}

/// A client that never finishes its body gets 408 once the request timeout passes. Time is paused
/// after setup and tokio advances it by itself while every task waits, so this takes no real time.
/// The admin route is used because it reads the body without touching the database first.
#[tokio::test]
async fn request_that_outlives_the_timeout_is_408() {
    use axum::body::Body;
    use axum::http::Request;
    let limits = Limits {
        request_timeout: std::time::Duration::from_secs(5),
        ..Limits::default()
    };
    let app = TestApp::with(Some(ADMIN_TOKEN), limits).await;
    tokio::time::pause();
    let never_ending = futures_util::stream::pending::<Result<axum::body::Bytes, std::io::Error>>();
    let request = Request::post("/v1/admin/tenants")
        .header(header::AUTHORIZATION, format!("Bearer {ADMIN_TOKEN}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(never_ending))
        .unwrap();
    let started = tokio::time::Instant::now();
    let reply = app.send(request).await;
    assert_eq!(reply.status, StatusCode::REQUEST_TIMEOUT);
    // Tokio timers have millisecond granularity.
    let elapsed = started.elapsed();
    assert!(elapsed >= std::time::Duration::from_secs(5), "{elapsed:?}");
    assert!(elapsed < std::time::Duration::from_secs(6), "{elapsed:?}");
}
