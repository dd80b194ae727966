//! Partner task routes: happy paths and every error each route can answer.

use crate::common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use common::{TestApp, task_body};
use serde_json::json;

#[tokio::test]
async fn create_task_returns_201_with_defaults_and_progress_fields() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({}))),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let task = reply.json();
    assert_eq!(task["state"], "CREATED");
    assert_eq!(task["current_round"], 0);
    assert_eq!(task["model_version"], serde_json::Value::Null);
    assert_eq!(task["over_selection"], 0.3);
    assert_eq!(task["max_round_attempts"], 3);
    assert_eq!(task["plan"]["batch_size"], 32);
    assert_eq!(task["created_at"], "2027-01-15T08:00:00Z");
    assert_eq!(task["id"].as_str().unwrap().len(), 36);
}

/// The upload window goes into the task policy devices bind; one that ends past the assignment
/// timeout less 5 s, or starts after it ends, is refused naming its field (issue 45).
#[tokio::test]
async fn the_upload_window_is_in_the_policy_and_must_fit_the_assignment_timeout() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(
                json!({"upload_window": {"start_ms": 1500, "end_ms": 55000}}),
            )),
        )
        .await
        .json();
    assert_eq!(
        task["upload_window"],
        json!({"start_ms": 1500, "end_ms": 55000})
    );
    let policy = task["policy"].as_str().unwrap();
    assert!(policy.contains("\nupload_window=1500,55000\n"), "{policy}");
    let policy = confed_protocol::policy::TaskPolicy::parse(policy).unwrap();
    assert_eq!(policy.upload_window.end_ms, 55_000);
    for (window, field, why) in [
        (
            json!({"start_ms": 0, "end_ms": 55001}),
            "upload_window.end_ms",
            "between 0 and 55000",
        ),
        (
            json!({"start_ms": 900, "end_ms": 800}),
            "upload_window.start_ms",
            "end_ms 800",
        ),
    ] {
        let reply = app
            .call(
                Method::POST,
                "/v1/tasks",
                Some(&token),
                Some(task_body(json!({"upload_window": window}))),
            )
            .await;
        let problem = reply.problem(StatusCode::BAD_REQUEST);
        let params = problem["invalid_params"].as_array().unwrap();
        assert_eq!(params.len(), 1, "{problem}");
        assert_eq!(params[0]["name"], field);
        assert!(
            params[0]["reason"].as_str().unwrap().contains(why),
            "{problem}"
        );
    }
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({"upload_window": {"start_ms": 5}}))),
        )
        .await;
    reply.problem(StatusCode::BAD_REQUEST);
}

/// `privacy.health` goes into the policy's mechanism; `{}` takes the default noise (at most 5 %
/// of the budget, no finer than report_goal / 10); a stddev the sampler cannot draw, or one whose
/// counts would eat the budget, is refused naming what to change.
#[tokio::test]
async fn the_health_signal_is_in_the_policy_with_a_default_noise_and_is_refused_out_of_range() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let create = |privacy: serde_json::Value| {
        let app = &app;
        let token = &token;
        async move {
            app.call(
                Method::POST,
                "/v1/tasks",
                Some(token),
                Some(task_body(json!({"privacy": privacy}))),
            )
            .await
        }
    };
    let budget = json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0});
    let with = |health: serde_json::Value| {
        let mut privacy = budget.clone();
        privacy["health"] = health;
        privacy
    };
    let task = create(with(json!({}))).await.json();
    let stddev = task["privacy"]["health"]["stddev"].as_f64().unwrap();
    // epsilon 8 over 3 rounds: 5 % of the budget needs more than report_goal / 10 = 1.
    assert!(stddev > 1.0, "{task}");
    let policy =
        confed_protocol::policy::TaskPolicy::parse(task["policy"].as_str().unwrap()).unwrap();
    let health = policy.dp_mechanism().unwrap().health.unwrap();
    assert_eq!(health.stddev, stddev);
    let chosen = create(with(json!({"stddev": 2.5}))).await.json();
    assert!(
        chosen["policy"]
            .as_str()
            .unwrap()
            .contains(";health=2.5e0\n"),
        "{chosen}"
    );
    let without = create(budget.clone()).await.json();
    assert!(without["privacy"].get("health").is_none(), "{without}");
    assert!(!without["policy"].as_str().unwrap().contains("health"));
    for (health, field) in [
        (json!({"stddev": 0.5}), "privacy.health.stddev"),
        (json!({"stddev": 1.0}), "privacy"),
    ] {
        let reply = create(with(health.clone())).await;
        let problem = reply.problem(StatusCode::BAD_REQUEST);
        let params = problem["invalid_params"].as_array().unwrap();
        assert_eq!(params[0]["name"], field, "{health}: {problem}");
        if field == "privacy" {
            assert!(
                params[0]["reason"]
                    .as_str()
                    .unwrap()
                    .contains("health stddev"),
                "{problem}"
            );
        }
    }
    create(with(json!({"sigma": 3})))
        .await
        .problem(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn create_task_names_every_invalid_field() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let body = task_body(
        json!({"rounds": 0, "privacy": {"epsilon": -1.0, "delta": 1e-6, "clip_norm": 1.0}}),
    );
    let reply = app
        .call(Method::POST, "/v1/tasks", Some(&token), Some(body))
        .await;
    let problem = reply.problem(StatusCode::BAD_REQUEST);
    let names: Vec<_> = problem["invalid_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rounds", "privacy.epsilon"]);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("between 1 and 10000")
    );
}

#[tokio::test]
async fn create_task_refuses_unknown_fields_and_bad_json() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({"surprise": 1}))),
        )
        .await;
    let problem = reply.problem(StatusCode::BAD_REQUEST);
    assert!(problem["detail"].as_str().unwrap().contains("surprise"));

    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(json!({"population": "p"})),
        )
        .await;
    assert!(
        reply.problem(StatusCode::BAD_REQUEST)["detail"]
            .as_str()
            .unwrap()
            .contains("missing field")
    );

    let request = Request::post("/v1/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{not json"))
        .unwrap();
    app.send(request).await.problem(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn create_task_without_json_content_type_is_415() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let request = Request::post("/v1/tasks")
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::from(
            serde_json::to_vec(&task_body(json!({}))).unwrap(),
        ))
        .unwrap();
    app.send(request)
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

#[tokio::test]
async fn oversized_json_body_is_413() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let huge = "x".repeat(300 * 1024);
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({"plan": {"x": huge}}))),
        )
        .await;
    reply.problem(StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn missing_or_wrong_token_is_401_with_challenge() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let body = Some(task_body(json!({})));
    for bad in [None, Some("nonsense"), Some(&token[..token.len() - 1])] {
        let reply = app.call(Method::POST, "/v1/tasks", bad, body.clone()).await;
        reply.problem(StatusCode::UNAUTHORIZED);
        assert_eq!(
            reply.headers.get(header::WWW_AUTHENTICATE).unwrap(),
            "Bearer"
        );
    }
    // A valid token id with another tenant's secret must fail too.
    let other = app.tenant("other").await;
    let (id_part, _) = token.rsplit_once('_').unwrap();
    let (_, secret) = other.rsplit_once('_').unwrap();
    let forged = format!("{id_part}_{secret}");
    app.call(Method::GET, "/v1/tasks", Some(&forged), None)
        .await
        .problem(StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn quota_on_report_goal_is_checked_before_creation() {
    let app = TestApp::new().await;
    let token = app.tenant_with("small", 5, 50).await;
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({"report_goal": 51}))),
        )
        .await;
    let detail = reply.problem(StatusCode::FORBIDDEN)["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        detail.contains("max_report_goal") && detail.contains("lower report_goal"),
        "{detail}"
    );
    let list = app
        .call(Method::GET, "/v1/tasks", Some(&token), None)
        .await
        .json();
    assert_eq!(list["tasks"].as_array().unwrap().len(), 0);
}

#[tokio::test]
async fn quota_on_active_tasks_counts_only_live_tasks() {
    let app = TestApp::new().await;
    let token = app.tenant_with("small", 2, 100).await;
    let first = app.create_task(&token, json!({})).await;
    app.create_task(&token, json!({})).await;
    let reply = app
        .call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(json!({}))),
        )
        .await;
    let detail = reply.problem(StatusCode::FORBIDDEN)["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        detail.contains("max_active_tasks") && detail.contains("cancel"),
        "{detail}"
    );
    // Cancelling one frees a slot.
    app.call(
        Method::POST,
        &format!("/v1/tasks/{first}/cancel"),
        Some(&token),
        None,
    )
    .await;
    app.create_task(&token, json!({})).await;
}

#[tokio::test]
async fn list_tasks_is_newest_first_and_paginates() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        ids.push(app.create_task(&token, json!({})).await);
        app.clock.advance(std::time::Duration::from_millis(1));
    }
    ids.reverse();
    let page1 = app
        .call(Method::GET, "/v1/tasks?limit=2", Some(&token), None)
        .await
        .json();
    let page_ids = |page: &serde_json::Value| -> Vec<String> {
        page["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(page_ids(&page1), ids[0..2]);
    let next = page1["next_page_token"].as_str().unwrap();
    let page2 = app
        .call(
            Method::GET,
            &format!("/v1/tasks?limit=2&page_token={next}"),
            Some(&token),
            None,
        )
        .await
        .json();
    assert_eq!(page_ids(&page2), ids[2..4]);
    let next = page2["next_page_token"].as_str().unwrap();
    let page3 = app
        .call(
            Method::GET,
            &format!("/v1/tasks?limit=2&page_token={next}"),
            Some(&token),
            None,
        )
        .await
        .json();
    assert_eq!(page_ids(&page3), ids[4..5]);
    assert!(page3.get("next_page_token").is_none());
}

#[tokio::test]
async fn list_tasks_refuses_bad_paging_parameters() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    for query in [
        "limit=0",
        "limit=101",
        "limit=abc",
        "page_token=!!!",
        "page_token=Zm9v",
        "color=red",
    ] {
        let reply = app
            .call(
                Method::GET,
                &format!("/v1/tasks?{query}"),
                Some(&token),
                None,
            )
            .await;
        reply.problem(StatusCode::BAD_REQUEST);
    }
}

#[tokio::test]
async fn get_task_returns_it_and_404_for_unknown() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let task = app
        .call(Method::GET, &format!("/v1/tasks/{id}"), Some(&token), None)
        .await
        .json();
    assert_eq!(task["id"], id.as_str());
    assert_eq!(task["population"], "phones.en");
    app.call(Method::GET, "/v1/tasks/does-not-exist", Some(&token), None)
        .await
        .problem(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cancel_fails_the_live_round_and_refuses_a_second_cancel() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.open_task(&token, json!({})).await;
    let reply = app
        .call(
            Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.json()["state"], "CANCELLED");
    let rounds = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{id}/rounds"),
            Some(&token),
            None,
        )
        .await
        .json();
    assert_eq!(rounds["rounds"][0]["state"], "FAILED");
    assert!(rounds["rounds"][0]["closed_at"].is_string());
    let again = app
        .call(
            Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            Some(&token),
            None,
        )
        .await;
    assert!(
        again.problem(StatusCode::CONFLICT)["detail"]
            .as_str()
            .unwrap()
            .contains("CANCELLED")
    );
    app.call(Method::POST, "/v1/tasks/nope/cancel", Some(&token), None)
        .await
        .problem(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn cancel_of_a_created_task_works() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let reply = app
        .call(
            Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(reply.json()["state"], "CANCELLED");
    let history = app.db.history(&id).await.unwrap();
    let states: Vec<_> = history.iter().map(|h| h.to_state.as_str()).collect();
    assert_eq!(states, ["CREATED", "CANCELLED"]);
}

#[tokio::test]
async fn rounds_lists_state_reports_goal_and_deadline() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let empty = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{id}/rounds"),
            Some(&token),
            None,
        )
        .await
        .json();
    assert_eq!(empty["rounds"].as_array().unwrap().len(), 0);
    app.put_bytes(
        &format!("/v1/tasks/{id}/model"),
        &token,
        common::model_bytes(),
    )
    .await;
    let rounds = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{id}/rounds"),
            Some(&token),
            None,
        )
        .await
        .json();
    let round = &rounds["rounds"][0];
    assert_eq!(round["round"], 1);
    assert_eq!(round["attempt"], 1);
    assert_eq!(round["state"], "COLLECTING");
    assert_eq!(round["reports_received"], 0);
    assert_eq!(round["report_goal"], 10);
    assert_eq!(round["min_reports"], 5);
    assert_eq!(round["opened_at"], "2027-01-15T08:00:00Z");
    assert_eq!(round["deadline"], "2027-01-15T08:10:00Z");
    assert_eq!(round["closed_at"], serde_json::Value::Null);
    app.call(Method::GET, "/v1/tasks/nope/rounds", Some(&token), None)
        .await
        .problem(StatusCode::NOT_FOUND);
}

/// A tenant's compute budget: a task whose device-hours (rounds x the most devices a round may
/// take x device_seconds_per_round), with what its active tasks still plan, exceed the budget is
/// refused with 400, saying by how much and how many rounds would fit; cancelling frees it.
#[tokio::test]
async fn a_task_over_the_tenants_compute_budget_is_refused_saying_what_fits() {
    let app = TestApp::new().await;
    let token = app.tenant_with_hours("acme", 10, 10_000, 10).await;
    // 100 reports: at most 200 devices a round (adaptive over-selection's cap), 60 s each:
    // 3.33 h a round.
    let body = |rounds: i64| json!({"rounds": rounds, "report_goal": 100, "min_reports": 100});
    let create = |body: serde_json::Value| {
        let (app, token) = (&app, &token);
        async move {
            app.call(
                Method::POST,
                "/v1/tasks",
                Some(token),
                Some(common::task_body(body)),
            )
            .await
        }
    };
    let problem = create(body(10)).await.problem(StatusCode::BAD_REQUEST);
    let reason = problem["invalid_params"][0]["reason"].as_str().unwrap();
    assert_eq!(
        problem["invalid_params"][0]["name"],
        "device_seconds_per_round"
    );
    assert!(reason.contains("plans up to 33.3 device-hours"), "{reason}");
    assert!(
        reason.contains("23.3 over") && reason.contains("at most 3 rounds"),
        "{reason}"
    );
    let first = app.create_task(&token, body(3)).await;
    // 10 h held: not one more round fits, until the first task is cancelled.
    let problem = create(body(1)).await.problem(StatusCode::BAD_REQUEST);
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("already plan 10.0 of its 10"), "{detail}");
    assert!(detail.contains("Not one round fits"), "{detail}");
    let cancelled = app
        .call(
            Method::POST,
            &format!("/v1/tasks/{first}/cancel"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(cancelled.status, StatusCode::OK);
    app.create_task(&token, body(1)).await;
    // A declared device time counts as declared: 10 rounds of 200 devices x 10 s = 5.6 h.
    let mut short = body(10);
    short["device_seconds_per_round"] = json!(10);
    app.create_task(&token, short).await;
    create(body(1)).await.problem(StatusCode::BAD_REQUEST);
}

/// A BLT task shows its resolved matrix and lattice, and refuses a model version 0 with more
/// values than its `max_values` (what its rounding is charged for) when it is uploaded, not at
/// round 1; a model that fits opens it.
#[tokio::test]
async fn a_blt_task_shows_its_matrix_and_refuses_a_model_above_its_max_values() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let privacy = |max_values: u64| {
        json!({"privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
               "mechanism": "blt", "min_separation": 1, "blt": {"max_values": max_values}}})
    };
    let small = app.create_task(&token, privacy(7)).await;
    let task = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{small}"),
            Some(&token),
            None,
        )
        .await
        .json();
    let blt = &task["privacy"]["blt"];
    assert_eq!(blt["max_values"], 7, "{task}");
    // Resolved (at 3 rounds, every round a device's, the optimum keeps no buffer).
    assert!(blt["buffers"].is_array(), "{blt}");
    assert!(blt["lattice_bits"].is_u64(), "{blt}");
    // The test model has 8 values.
    let refused = app
        .put_bytes(
            &format!("/v1/tasks/{small}/model"),
            &token,
            common::model_bytes(),
        )
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    let problem = refused.json();
    assert!(
        problem["detail"].as_str().unwrap().contains("max_values 7"),
        "{problem}"
    );
    app.open_task(&token, privacy(8)).await;
}

/// `distributed_noise`: the masking line names the per-group variance the budget calibrates (at
/// least the enclave's); without `secure_aggregation`, or with DP-FTRL's correlated noise, it is
/// a 400 on the field saying why.
#[tokio::test]
async fn distributed_noise_names_its_variance_in_the_masking_line_or_is_refused_with_the_reason() {
    use base64::Engine as _;
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let spki =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(common::issuer::signer().spki());
    let auth = json!({"issuer": common::issuer::ISSUER, "token_keys": [spki]});
    let create = |overrides: serde_json::Value| {
        app.call(
            Method::POST,
            "/v1/tasks",
            Some(&token),
            Some(task_body(overrides)),
        )
    };
    let created = create(json!({
        "secure_aggregation": true, "distributed_noise": true, "device_auth": auth
    }))
    .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let line = created.json()["masking"].as_str().unwrap().to_string();
    let variance: u64 = line
        .split(";noise=")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no noise in {line}"));
    // The enclave's own calibration of the same budget (epsilon 8 over 3 rounds) needs no more.
    let z = confed_dp::calibrate_task(
        &confed_enclave::dp::OpenDp,
        confed_protocol::mechanism::DpMechanism::plain(
            confed_protocol::mechanism::Mechanism::Gaussian,
        ),
        8.0,
        1e-6,
        3,
    )
    .unwrap()
    .noise_multiplier;
    let needed = confed_enclave::dp::DiscreteGaussian::at_least(z * 65536.0)
        .unwrap()
        .variance();
    assert!(
        variance >= needed && variance <= needed + needed / 5_000,
        "{variance} {needed}"
    );

    for (overrides, why) in [
        (
            json!({"distributed_noise": true, "device_auth": auth}),
            "secure_aggregation",
        ),
        (
            json!({"secure_aggregation": true, "distributed_noise": true, "device_auth": auth,
                   "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
                               "mechanism": "tree_aggregation", "min_separation": 1}}),
            "per-round Gaussian",
        ),
    ] {
        let refused = create(overrides).await;
        let params = refused.problem(StatusCode::BAD_REQUEST)["invalid_params"].to_string();
        assert!(
            params.contains("distributed_noise") && params.contains(why),
            "{params}"
        );
    }
}
