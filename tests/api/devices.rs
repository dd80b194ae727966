//! Task assignment for devices: check-in and its retry reasons, capacity under concurrency,
//! fairness, uploads (every answer), reports, expiry, model download, and the binding of a
//! contribution to its task, round and assignment.

use crate::common;

use std::time::Duration;

use axum::http::{Method, StatusCode, header};
use common::{TestApp, model_bytes};
use confed::keys::directory::DeviceKey;
use confed::scheduler::Scheduler;
use confed_enclave::envelope::{self, Envelope};
use confed_protocol::trust::accept_device_key;
use serde_json::{Value, json};

const POP: &str = "phones.en";
const NOW_S: i64 = common::START_MILLIS / 1000;

async fn checkin(app: &TestApp, body: Value) -> common::Reply {
    app.call(
        Method::POST,
        &format!("/v1/populations/{POP}/checkin"),
        None,
        Some(body),
    )
    .await
}

fn device() -> Value {
    json!({"client_version": "1.4.0", "attributes": {"os": "android", "ram_gb": 8, "charging": true}})
}

/// Checks in and expects an assignment.
async fn assigned(app: &TestApp) -> Value {
    let reply = checkin(app, device()).await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply.json()
}

/// What a device binds its contribution to: the assignment's task, round and policy, and the
/// model it trained from (these tests seal without downloading it: a fixed stand-in hash).
fn context(assignment: &Value, round: u64) -> envelope::RoundContext {
    envelope::RoundContext {
        task_id: assignment["task_id"].as_str().unwrap().to_string(),
        round,
        policy_sha256: confed_protocol::policy::sha256_hex(
            assignment["policy"].as_str().unwrap().as_bytes(),
        ),
        model_sha256: "0".repeat(64),
    }
}

/// The device side: verify the key (2 trusted signatures) and seal an update for the assignment.
fn sealed(app: &TestApp, assignment: &Value, update: &[u8]) -> Vec<u8> {
    let key: DeviceKey = serde_json::from_value(assignment["encryption"].clone()).unwrap();
    let public = accept_device_key(&key, &app.key.trusted, 2, NOW_S).unwrap();
    envelope::seal(
        &public,
        &key.key_id,
        &context(assignment, assignment["round"].as_u64().unwrap()),
        &assignment["assignment_id"].as_str().unwrap().into(),
        update,
    )
    .unwrap()
    .to_cbor()
}

async fn upload(app: &TestApp, assignment: &Value, bytes: Vec<u8>) -> common::Reply {
    app.put_raw(
        assignment["upload_url"].as_str().unwrap(),
        "application/cbor",
        bytes,
    )
    .await
}

async fn report(app: &TestApp, assignment: &Value, body: Value) -> common::Reply {
    app.call(
        Method::POST,
        assignment["report_url"].as_str().unwrap(),
        None,
        Some(body),
    )
    .await
}

async fn open_task(app: &TestApp, token: &str, overrides: Value) -> String {
    app.open_task(token, overrides).await
}

async fn round_states(app: &TestApp, token: &str, task: &str) -> Vec<String> {
    let rounds = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}/rounds"),
            Some(token),
            None,
        )
        .await
        .json();
    rounds["rounds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["state"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn no_task_means_retry_later() {
    let app = TestApp::new().await;
    let reply = checkin(&app, device()).await;
    assert_eq!(reply.status, StatusCode::OK);
    let body = reply.json();
    assert_eq!(body["reason"], "no_task");
    assert!(
        body["retry_window"]["min_seconds"].as_u64().unwrap()
            < body["retry_window"]["max_seconds"].as_u64().unwrap()
    );
}

#[tokio::test]
async fn a_full_cycle_stores_the_contribution_and_reaching_the_goal_closes_the_round() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = open_task(
        &app,
        &token,
        json!({"report_goal": 2, "min_reports": 1, "over_selection": 0.5}),
    )
    .await;
    let first = assigned(&app).await;
    assert_eq!(first["task_id"], task.as_str());
    assert_eq!(first["round"], 1);
    assert_eq!(first["plan"]["batch_size"], 32);
    assert_eq!(
        first["model_url"],
        format!(
            "/v1/assignments/{}/model",
            first["assignment_id"].as_str().unwrap()
        )
    );
    assert_eq!(first["encryption"]["key_id"], "ktest");
    assert_eq!(
        first["encryption"]["signatures"].as_array().unwrap().len(),
        2
    );
    assert_eq!(first["expires_at"], NOW_S + 60);
    assert_eq!(
        first["assignment_id"].as_str().unwrap().len(),
        43,
        "256-bit capability"
    );

    let bytes = sealed(&app, &first, b"update one");
    assert_eq!(
        upload(&app, &first, bytes.clone()).await.status,
        StatusCode::CREATED
    );
    assert_eq!(
        upload(&app, &first, bytes).await.status,
        StatusCode::OK,
        "same bytes again: idempotent"
    );
    upload(&app, &first, sealed(&app, &first, b"something else"))
        .await
        .problem(StatusCode::CONFLICT);
    let done = report(&app, &first, json!({"outcome": "completed"})).await;
    assert_eq!(done.json()["state"], "COMPLETED");
    let reference = envelope::assignment_ref(first["assignment_id"].as_str().unwrap());
    let history = app.db.history(&reference).await.unwrap();
    let states: Vec<_> = history
        .iter()
        .map(|h| (h.from_state.as_deref(), h.to_state.as_str()))
        .collect();
    assert_eq!(
        states,
        [
            (None, "ASSIGNED"),
            (Some("ASSIGNED"), "UPLOADED"),
            (Some("UPLOADED"), "COMPLETED")
        ],
        "every transition of the one-statement paths is in the history"
    );
    assert_eq!(
        report(&app, &first, json!({"outcome": "completed"}))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(round_states(&app, &token, &task).await, ["COLLECTING"]);

    let second = assigned(&app).await;
    upload(&app, &second, sealed(&app, &second, b"update two")).await;
    report(&app, &second, json!({"outcome": "completed"})).await;
    assert_eq!(
        round_states(&app, &token, &task).await,
        ["AGGREGATING"],
        "goal of 2 reached"
    );
    let late = checkin(&app, device()).await;
    assert_eq!(late.json()["reason"], "no_task");
}

#[tokio::test]
async fn version_and_constraint_mismatches_are_explained() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({"client_version": {"min": "2.0"}})).await;
    assert_eq!(
        checkin(&app, device()).await.json()["reason"],
        "version_mismatch"
    );
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({"constraints": {"os": "ios"}})).await;
    assert_eq!(
        checkin(&app, device()).await.json()["reason"],
        "constraints_not_met"
    );
    let task = app
        .call(Method::GET, "/v1/tasks", Some(&token), None)
        .await
        .json()["tasks"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let view = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{task}"),
            Some(&token),
            None,
        )
        .await
        .json();
    assert_eq!(
        view["recent_eligible_checkins"], 0,
        "the partner sees that no recent check-in fits"
    );
    assert_eq!(view["recent_eligible_devices"], 0, "the deprecated name");
}

#[tokio::test]
async fn bad_check_ins_are_400() {
    let app = TestApp::new().await;
    for body in [
        json!({"client_version": "one"}),
        json!({"client_version": "1", "extra": 1}),
        json!({}),
    ] {
        checkin(&app, body).await.problem(StatusCode::BAD_REQUEST);
    }
    app.call(
        Method::POST,
        "/v1/populations/bad%20pop/checkin",
        None,
        Some(device()),
    )
    .await
    .problem(StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_full_round_tells_devices_to_retry_and_a_timed_out_slot_is_freed() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(
        &app,
        &token,
        json!({"report_goal": 1, "min_reports": 1, "over_selection": 0.0,
            // One device per round needs a generous budget to be usable (see dp::plan).
            "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}}),
    )
    .await;
    let only = assigned(&app).await;
    assert_eq!(checkin(&app, device()).await.json()["reason"], "round_full");
    app.clock.advance(Duration::from_secs(61));
    let summary = Scheduler::new(app.db.clone()).tick().await.unwrap();
    assert_eq!(summary.assignments_timed_out, 1);
    upload(&app, &only, sealed(&app, &only, b"late"))
        .await
        .problem(StatusCode::GONE);
    // Timed out is expired on every route: 410, as for the upload.
    report(&app, &only, json!({"outcome": "failed"}))
        .await
        .problem(StatusCode::GONE);
    assigned(&app).await;
}

#[tokio::test]
async fn concurrent_check_ins_never_exceed_any_rounds_capacity() {
    let app = TestApp::new().await;
    let mut tasks = Vec::new();
    // A population is one tenant's: its three tasks compete for the devices.
    let token = app.tenant("a").await;
    for _ in 0..3 {
        tasks.push(
            open_task(
                &app,
                &token,
                json!({"report_goal": 4, "min_reports": 1, "over_selection": 0.25}),
            )
            .await,
        );
    }
    let router = app.router.clone();
    let mut handles = Vec::new();
    for _ in 0..60 {
        let router = router.clone();
        handles.push(tokio::spawn(async move {
            use tower::ServiceExt;
            let request = axum::http::Request::post(format!("/v1/populations/{POP}/checkin"))
                .header(header::CONTENT_TYPE, "application/json")
                .body(axum::body::Body::from(device().to_string()))
                .unwrap();
            let response = router.oneshot(request).await.unwrap();
            let status = response.status();
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            (status, serde_json::from_slice::<Value>(&body).unwrap())
        }));
    }
    let mut per_task = std::collections::HashMap::<String, usize>::new();
    for handle in handles {
        let (status, body) = handle.await.unwrap();
        if status == StatusCode::CREATED {
            *per_task
                .entry(body["task_id"].as_str().unwrap().to_string())
                .or_default() += 1;
        } else {
            assert_eq!(body["reason"], "round_full");
        }
    }
    for task in &tasks {
        assert_eq!(
            per_task.get(task),
            Some(&5),
            "capacity ceil(4 * 1.25) = 5 for {task}: {per_task:?}"
        );
    }
}

#[tokio::test]
async fn devices_are_spread_fairly_over_a_populations_tasks() {
    let app = TestApp::new().await;
    let tenant = app.tenant("acme").await;
    let big_task = open_task(&app, &tenant, json!({"report_goal": 100})).await;
    let small_task = open_task(&app, &tenant, json!({"report_goal": 10})).await;
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for _ in 0..22 {
        *counts
            .entry(
                assigned(&app).await["task_id"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
            .or_default() += 1;
    }
    // Least-filled first: both rounds fill at the same pace relative to their capacity.
    assert_eq!(counts[&small_task], 2);
    assert_eq!(counts[&big_task], 20);
}

#[tokio::test]
async fn upload_answers_every_error_clearly() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let good = sealed(&app, &a, b"update");

    app.put_raw(
        "/v1/assignments/unknown/contribution",
        "application/cbor",
        good.clone(),
    )
    .await
    .problem(StatusCode::NOT_FOUND);
    for wrong in [
        "application/json",
        "application/cbor-seq",
        "application/cborx",
    ] {
        app.put_raw(a["upload_url"].as_str().unwrap(), wrong, good.clone())
            .await
            .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
    let detail = upload(&app, &a, b"\xa1\x61x\x01".to_vec())
        .await
        .problem(StatusCode::BAD_REQUEST)["detail"]
        .clone();
    assert!(
        detail.as_str().unwrap().contains("unknown key `x`"),
        "{detail}"
    );
    let mut wrong_key = Envelope::from_cbor(&good).unwrap();
    wrong_key.key_id = "kother".into();
    upload(&app, &a, wrong_key.to_cbor())
        .await
        .problem(StatusCode::UNPROCESSABLE_ENTITY);
    let max = a["max_contribution_bytes"].as_u64().unwrap() as usize;
    let huge = Envelope {
        ciphertext: vec![0; max],
        ..Envelope::from_cbor(&good).unwrap()
    };
    upload(&app, &a, huge.to_cbor())
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE);
    report(&app, &a, json!({"outcome": "completed"}))
        .await
        .problem(StatusCode::CONFLICT);

    // The round closes (task cancelled): uploads and reports are gone.
    app.call(
        Method::POST,
        &format!("/v1/tasks/{task}/cancel"),
        Some(&token),
        None,
    )
    .await;
    let gone = upload(&app, &a, good).await;
    // Refused before its body was read: the server closes the connection and says so, so a
    // client does not reuse it for its next check-in.
    assert_eq!(gone.headers[header::CONNECTION], "close");
    gone.problem(StatusCode::GONE);
    report(&app, &a, json!({"outcome": "failed"}))
        .await
        .problem(StatusCode::GONE);
    app.call(
        Method::POST,
        "/v1/assignments/unknown/report",
        None,
        Some(json!({"outcome": "failed"})),
    )
    .await
    .problem(StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn failure_and_not_eligible_reports_free_the_slot() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(
        &app,
        &token,
        json!({"report_goal": 1, "min_reports": 1, "over_selection": 0.0,
            // One device per round needs a generous budget to be usable (see dp::plan).
            "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0}}),
    )
    .await;
    let a = assigned(&app).await;
    let failed = report(
        &app,
        &a,
        json!({"outcome": "failed", "error": "out of memory"}),
    )
    .await;
    assert_eq!(failed.json()["state"], "FAILED");
    assert!(
        failed.json().get("retry_window").is_none(),
        "only a decline says how long to wait"
    );
    let b = assigned(&app).await;
    // Devices are anonymous: a device that declines (it served this round already) is told to
    // wait before it checks in again, or it would be offered the same round at once; the same
    // report again answers the same.
    for _ in 0..2 {
        let declined = report(&app, &b, json!({"outcome": "not_eligible"}))
            .await
            .json();
        assert_eq!(declined["state"], "REJECTED");
        assert_eq!(
            declined["retry_window"],
            json!({"min_seconds": 60, "max_seconds": 120})
        );
    }
    report(&app, &b, json!({"outcome": "completed"}))
        .await
        .problem(StatusCode::CONFLICT);
    report(&app, &b, json!({"outcome": "maybe"}))
        .await
        .problem(StatusCode::BAD_REQUEST);
    assigned(&app).await;
}

#[tokio::test]
async fn a_contribution_moved_to_another_assignment_or_round_does_not_open() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let b = assigned(&app).await;
    let stored = Envelope::from_cbor(&sealed(&app, &a, b"a's update")).unwrap();
    let id = |x: &Value| envelope::assignment_ref(x["assignment_id"].as_str().unwrap());
    let key = &app.key.private_key;
    assert_eq!(
        envelope::open(key, &stored, &context(&a, 1), &id(&a))
            .unwrap()
            .as_slice(),
        b"a's update"
    );
    assert!(
        envelope::open(key, &stored, &context(&a, 1), &id(&b)).is_err(),
        "replayed into another assignment"
    );
    assert!(
        envelope::open(key, &stored, &context(&a, 2), &id(&a)).is_err(),
        "replayed into another round"
    );
    // The server stores it for b (it never decrypts), but the enclave will not open it there.
    assert_eq!(
        upload(&app, &b, stored.to_cbor()).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_device_refuses_a_key_without_enough_trusted_signatures() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let mut key: DeviceKey = serde_json::from_value(a["encryption"].clone()).unwrap();
    assert!(accept_device_key(&key, &app.key.trusted, 2, NOW_S).is_ok());
    let forged = confed_protocol::hpke::generate_keypair().1;
    key.public_key =
        base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, forged.0);
    assert!(
        accept_device_key(&key, &app.key.trusted, 2, NOW_S).is_err(),
        "swapped key"
    );
    let mut one: DeviceKey = serde_json::from_value(a["encryption"].clone()).unwrap();
    one.signatures.truncate(1);
    assert!(
        accept_device_key(&one, &app.key.trusted, 2, NOW_S).is_err(),
        "one signature of two"
    );
}

#[tokio::test]
async fn devices_download_models_with_caching() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let url = a["model_url"].as_str().unwrap();
    let reply = app.call(Method::GET, url, None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, model_bytes());
    assert!(
        reply.headers[header::CACHE_CONTROL]
            .to_str()
            .unwrap()
            .starts_with("private"),
        "no shared cache may keep a model for unauthenticated readers"
    );
    let etag = reply.headers[header::ETAG].to_str().unwrap().to_string();
    // A second assignment of the same model revalidates with the ETag it cached.
    let b = assigned(&app).await;
    // Weak comparison (RFC 9110 13.1.2): a `W/` tag, or one in a list, matches too.
    for if_none_match in [
        etag.clone(),
        format!("W/{etag}"),
        format!("\"other\", W/{etag}"),
    ] {
        let request = axum::http::Request::get(b["model_url"].as_str().unwrap())
            .header(header::IF_NONE_MATCH, &if_none_match)
            .body(axum::body::Body::empty())
            .unwrap();
        assert_eq!(
            app.send(request).await.status,
            StatusCode::NOT_MODIFIED,
            "{if_none_match}"
        );
    }
    let request = axum::http::Request::get(b["model_url"].as_str().unwrap())
        .header(header::IF_NONE_MATCH, "W/\"another-version\"")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(app.send(request).await.status, StatusCode::OK);
}

/// Consecutive model versions reveal every release, so a model is served only to a device
/// holding a live assignment of its task: not by task id, not to a made-up or expired capability.
#[tokio::test]
async fn models_are_served_only_to_a_live_assignment() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    app.call(Method::GET, &format!("/v1/models/{task}/0"), None, None)
        .await
        .problem(StatusCode::NOT_FOUND);
    app.call(Method::GET, "/v1/assignments/made-up/model", None, None)
        .await
        .problem(StatusCode::NOT_FOUND);
    app.clock.advance(Duration::from_secs(61));
    app.call(Method::GET, a["model_url"].as_str().unwrap(), None, None)
        .await
        .problem(StatusCode::GONE);
}

#[tokio::test]
async fn without_a_signed_key_devices_are_told_to_retry() {
    let keyless = TestApp::with_keys(confed::keys::directory::KeyDirectory::default()).await;
    let token = keyless.tenant("acme").await;
    open_task(&keyless, &token, json!({})).await;
    assert_eq!(
        checkin(&keyless, device()).await.json()["reason"],
        "no_encryption_key"
    );
}

#[tokio::test]
async fn check_ins_show_in_metrics() {
    let app = TestApp::new().await;
    checkin(&app, device()).await;
    let text = String::from_utf8(app.call(Method::GET, "/metrics", None, None).await.body).unwrap();
    assert!(
        text.contains("confed_recent_checkins{population=\"phones.en\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("confed_checkins_total{outcome=\"no_task\"}"),
        "{text}"
    );
}

/// On PostgreSQL a check-in's read joins a grouped statement, which records how many keys it
/// answered: what the grouping saves is visible to the operator (operations.md). (The recorder
/// is the process's: under `cargo test` other cases record into it too, so nothing is said of
/// SQLite, which reads each key alone.)
#[tokio::test]
async fn grouped_device_reads_show_their_keys_per_statement_in_metrics() {
    for (engine, app) in TestApp::on_each_engine().await {
        if engine != "postgres" {
            continue;
        }
        checkin(&app, device()).await;
        let text =
            String::from_utf8(app.call(Method::GET, "/metrics", None, None).await.body).unwrap();
        assert!(
            text.contains("confed_db_grouped_read_keys_count{kind=\"candidates\"} "),
            "{text}"
        );
    }
}

/// Media types compare case-insensitively and ignore parameters (RFC 9110).
#[tokio::test]
async fn the_upload_media_type_is_matched_exactly_but_case_insensitively() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let reply = app
        .put_raw(
            a["upload_url"].as_str().unwrap(),
            "Application/CBOR; foo=bar",
            sealed(&app, &a, b"update"),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
}

/// The attributes a check-in may carry are bounded (count, name, text size): the registry of
/// recent devices keeps them, and a flood of 256 KiB maps once took the server to 2.2 GB.
#[tokio::test]
async fn check_in_attributes_beyond_the_bounds_are_400() {
    let app = TestApp::new().await;
    let too_many: serde_json::Map<String, Value> =
        (0..33).map(|i| (format!("a{i}"), json!(true))).collect();
    for attributes in [
        Value::Object(too_many),
        json!({"os": "x".repeat(257)}),
        json!({"n".repeat(65): 1}),
        json!({"has space": 1}),
    ] {
        let problem = checkin(
            &app,
            json!({"client_version": "1", "attributes": attributes}),
        )
        .await
        .problem(StatusCode::BAD_REQUEST);
        assert!(
            problem["detail"].as_str().unwrap().contains("attribute"),
            "{problem}"
        );
    }
    let reply = checkin(
        &app,
        json!({"client_version": "1", "attributes": {"os": "x".repeat(256)}}),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "at the bound is fine");
}

/// A body that records whether anyone read it, and fails if so.
fn unread_body(read: std::sync::Arc<std::sync::atomic::AtomicBool>) -> axum::body::Body {
    axum::body::Body::from_stream(futures_util::stream::poll_fn(move |_| {
        read.store(true, std::sync::atomic::Ordering::SeqCst);
        std::task::Poll::Ready(Some(Err::<axum::body::Bytes, _>(std::io::Error::other(
            "the server read the body",
        ))))
    }))
}

fn upload_request(
    path: &str,
    declared: u64,
    body: axum::body::Body,
) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::put(path)
        .header(header::CONTENT_TYPE, "application/cbor")
        .header(header::CONTENT_LENGTH, declared.to_string())
        .body(body)
        .unwrap()
}

/// Three 500 MiB uploads to a made-up id once took 1.6 GB: the capability is looked up first.
#[tokio::test]
async fn an_upload_to_a_made_up_assignment_is_refused_before_its_body_is_read() {
    let app = TestApp::new().await;
    let read = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reply = app
        .send(upload_request(
            "/v1/assignments/made-up/contribution",
            500 << 20,
            unread_body(read.clone()),
        ))
        .await;
    reply.problem(StatusCode::NOT_FOUND);
    assert!(
        !read.load(std::sync::atomic::Ordering::SeqCst),
        "the body was read"
    );
}

/// A declared length over the task's limit is refused before the body is read, and a chunked
/// body is read only up to the limit.
#[tokio::test]
async fn an_upload_over_the_tasks_limit_is_refused_early() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let path = a["upload_url"].as_str().unwrap();
    let limit = a["max_contribution_bytes"].as_u64().unwrap();
    let read = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reply = app
        .send(upload_request(path, limit + 1, unread_body(read.clone())))
        .await;
    reply.problem(StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        !read.load(std::sync::atomic::Ordering::SeqCst),
        "the body was read"
    );

    let chunks = futures_util::stream::iter(
        (0..=limit / 65_536 + 1)
            .map(|_| Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![0u8; 65_536]))),
    );
    let chunked = axum::http::Request::put(path)
        .header(header::CONTENT_TYPE, "application/cbor")
        .body(axum::body::Body::from_stream(chunks))
        .unwrap();
    app.send(chunked)
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE);
    // The capability is still good for a proper upload.
    let reply = upload(&app, &a, sealed(&app, &a, b"update")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
}

fn contribution_log_bytes(app: &TestApp) -> u64 {
    std::fs::read_dir(app._dir.path().join("contributions"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// One capability could write the task's limit to disk again and again (each repeat appended,
/// then answered 200 or 409), even after its round closed. A repeat now stores nothing.
#[tokio::test]
async fn repeated_uploads_to_a_used_assignment_store_nothing_more() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let bytes = sealed(&app, &a, b"update");
    assert_eq!(
        upload(&app, &a, bytes.clone()).await.status,
        StatusCode::CREATED
    );
    let stored = contribution_log_bytes(&app);
    for _ in 0..5 {
        assert_eq!(upload(&app, &a, bytes.clone()).await.status, StatusCode::OK);
        upload(&app, &a, sealed(&app, &a, b"another"))
            .await
            .problem(StatusCode::CONFLICT);
    }
    assert_eq!(contribution_log_bytes(&app), stored, "no byte more on disk");
}

/// When several rows of the upload table apply, the documented order decides (protocol.md,
/// "Upload"): 415 over 413, 400 over 422 and 409, and a held contribution is answered by its
/// bytes alone, even after the assignment expired (200 for the same bytes, not 410).
#[tokio::test]
async fn upload_answers_follow_the_documented_precedence() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(&app, &token, json!({})).await;
    let a = assigned(&app).await;
    let url = a["upload_url"].as_str().unwrap();
    let limit = a["max_contribution_bytes"].as_u64().unwrap() as usize;
    app.put_raw(url, "text/plain", vec![0; limit + 1])
        .await
        .problem(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    app.put_raw(url, "application/cbor", b"not an envelope".to_vec())
        .await
        .problem(StatusCode::BAD_REQUEST);
    let bytes = sealed(&app, &a, b"update");
    let first = app.put_raw(url, "application/cbor", bytes.clone()).await;
    assert_eq!(first.status, StatusCode::CREATED);
    app.clock.advance(Duration::from_secs(61));
    let again = app.put_raw(url, "application/cbor", bytes).await;
    assert_eq!(again.status, StatusCode::OK, "the same bytes, after expiry");
    app.put_raw(url, "application/cbor", b"not an envelope".to_vec())
        .await
        .problem(StatusCode::BAD_REQUEST);
    app.put_raw(url, "application/cbor", sealed(&app, &a, b"other"))
        .await
        .problem(StatusCode::CONFLICT);
}

/// Stragglers: a device that uploads, or reports completed, after its round closed is told 410
/// and counted as late in the round's funnel, once however often it tries.
#[tokio::test]
async fn a_contribution_after_the_round_closed_is_counted_late_once() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = open_task(
        &app,
        &token,
        json!({"report_goal": 1, "min_reports": 1, "over_selection": 2.0, "rounds": 1}),
    )
    .await;
    let (punctual, slow, unreported) = (
        assigned(&app).await,
        assigned(&app).await,
        assigned(&app).await,
    );
    // Uploaded in time, reported too late.
    upload(&app, &unreported, sealed(&app, &unreported, b"in time")).await;
    upload(&app, &punctual, sealed(&app, &punctual, b"on time")).await;
    report(&app, &punctual, json!({"outcome": "completed"})).await;
    assert_eq!(round_states(&app, &token, &task).await, ["AGGREGATING"]);
    for _ in 0..2 {
        upload(&app, &slow, sealed(&app, &slow, b"too late"))
            .await
            .problem(StatusCode::GONE);
    }
    // Nothing uploaded: 409 comes first (protocol.md's precedence), and it is late already.
    report(&app, &slow, json!({"outcome": "completed"}))
        .await
        .problem(StatusCode::CONFLICT);
    report(&app, &unreported, json!({"outcome": "completed"}))
        .await
        .problem(StatusCode::GONE);
    let tenant = app.db.tenant_for_token(&token).await.unwrap().unwrap();
    let funnel = app.db.round_funnel(&tenant.id, &task, 1).await.unwrap();
    let late: i64 = funnel.iter().map(|row| row.late).sum();
    assert_eq!(late, 2, "{funnel:?}");
}

/// Adaptive over-selection: when most of a round's devices drop out, the next attempt takes more
/// devices at once (enough to replace the share that dropped), up to the cap of doubling.
#[tokio::test]
async fn a_round_after_many_drop_outs_takes_more_devices() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    open_task(
        &app,
        &token,
        json!({"report_goal": 10, "min_reports": 10, "over_selection": 0.3,
               "round_deadline_seconds": 600, "rounds": 1}),
    )
    .await;
    // Attempt 1 takes 13 devices at once; 8 of them fail (freeing their slots), 8 more come.
    let mut first = Vec::new();
    while let Some(assignment) = try_assigned(&app).await {
        first.push(assignment);
    }
    assert_eq!(first.len(), 13, "ceil(10 x 1.3)");
    for assignment in &first[..8] {
        report(&app, assignment, json!({"outcome": "failed"})).await;
    }
    let mut replacements = 0;
    while try_assigned(&app).await.is_some() {
        replacements += 1;
    }
    assert_eq!(replacements, 8);
    // The deadline passes with no report: attempt 2 opens, sized for that drop-out rate.
    app.clock.advance(Duration::from_secs(600));
    Scheduler::new(app.db.clone()).tick().await.unwrap();
    let mut second = 0;
    while try_assigned(&app).await.is_some() {
        second += 1;
    }
    assert!(
        second > 13 && second <= 20,
        "attempt 2 takes {second} devices"
    );
}

/// Checks in; the assignment, or `None` when told to retry.
async fn try_assigned(app: &TestApp) -> Option<Value> {
    let reply = checkin(app, device()).await;
    (reply.status == StatusCode::CREATED).then(|| reply.json())
}

/// A device that says which rounds it served is not assigned one it would decline: the same
/// round (any mechanism), or one closer than a tree task's minimum separation; it is told to
/// come back later (`min_separation`), and another task's rounds are unaffected. Too long a
/// list is a 400.
#[tokio::test]
async fn a_device_that_says_it_served_a_round_is_not_assigned_it_again() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = open_task(
        &app,
        &token,
        json!({"rounds": 4, "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0,
               "mechanism": "tree_aggregation", "min_separation": 3}}),
    )
    .await;
    let with_served = |served: Value| {
        let mut body = device();
        body["served"] = served;
        body
    };
    // Round 1 is open: the same round, or round 3 (2 < 3 apart), would be declined.
    for round in [json!(1), json!(3), json!(3.0)] {
        let reply = checkin(
            &app,
            with_served(json!([{"task_id": task, "round": round}])),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.json()["reason"], "min_separation");
        assert_eq!(reply.json()["retry_window"]["min_seconds"], 600);
    }
    // Round 4 (3 apart) and another task's round 1: assigned.
    for served in [
        json!([{"task_id": task, "round": 4}]),
        json!([{"task_id": "other", "round": 1}]),
    ] {
        assert_eq!(
            checkin(&app, with_served(served)).await.status,
            StatusCode::CREATED
        );
    }
    for bad in [
        json!([{"task_id": task, "round": 0}]),
        json!([{"task_id": "", "round": 1}]),
        json!([{"task_id": task, "round": 1.5}]),
    ] {
        checkin(&app, with_served(bad))
            .await
            .problem(StatusCode::BAD_REQUEST);
    }
    let too_many: Vec<Value> = (0..257)
        .map(|i| json!({"task_id": format!("t{i}"), "round": 1}))
        .collect();
    checkin(&app, with_served(json!(too_many)))
        .await
        .problem(StatusCode::BAD_REQUEST);
    // Task ids are counted in characters, as the schema's maxLength is (found by schemathesis:
    // 100 characters of 2-3 bytes each were refused): 128 pass, 129 do not.
    let wide = |n: usize| json!([{"task_id": "\u{2248}".repeat(n), "round": 1}]);
    assert_ne!(
        checkin(&app, with_served(wide(128))).await.status,
        StatusCode::BAD_REQUEST
    );
    checkin(&app, with_served(wide(129)))
        .await
        .problem(StatusCode::BAD_REQUEST);
}

/// `tenant_id` is counted in characters, as the schema's maxLength is (the bug fixed for task
/// ids, found again by review): 128 characters of 3 bytes each pass, 129 do not, and an empty
/// one is refused.
#[tokio::test]
async fn a_tenant_id_is_counted_in_characters_not_bytes() {
    let app = TestApp::new().await;
    let with_tenant = |tenant: String| {
        let mut body = device();
        body["tenant_id"] = json!(tenant);
        body
    };
    assert_ne!(
        checkin(&app, with_tenant("\u{2248}".repeat(128)))
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    checkin(&app, with_tenant("\u{2248}".repeat(129)))
        .await
        .problem(StatusCode::BAD_REQUEST);
    checkin(&app, with_tenant(String::new()))
        .await
        .problem(StatusCode::BAD_REQUEST);
}
