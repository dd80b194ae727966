//! Evaluation rounds end to end (one process; SQLite, or PostgreSQL with
//! `CONFED_TEST_DATABASE_URL`): simulated devices add their metrics for the model they train
//! from, the enclave releases them noised, partners read them per model version, the
//! early-stopping rule completes the task, and partners ask for evaluations on demand.

use crate::common;

use common::system::{collect, get, now_clock, open_task, open_task_with, start};
use serde_json::{Value, json};

async fn evaluations(
    system: &confed::embedded::EmbeddedSystem,
    token: &str,
    task: &str,
) -> (u16, Value) {
    let reply = get(system, token, &format!("/v1/tasks/{task}/evaluations")).await;
    (reply.status().as_u16(), reply.json().await.unwrap())
}

/// A console session for `token`: the client (no redirects followed) and the cookie to send.
async fn console_session(
    system: &confed::embedded::EmbeddedSystem,
    token: &str,
) -> (reqwest::Client, String) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let form = format!(
        "token={}",
        token
            .replace('+', "%2B")
            .replace('/', "%2F")
            .replace('=', "%3D")
    );
    let signed_in = http
        .post(format!("{}/console/sign-in", system.url))
        .header("origin", &system.url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form)
        .send()
        .await
        .unwrap();
    assert_eq!(signed_in.status(), 303);
    let cookie = signed_in.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_string();
    (http, cookie)
}

/// The console page at `path`, signed in with `token`.
async fn console_page(
    system: &confed::embedded::EmbeddedSystem,
    token: &str,
    path: &str,
) -> String {
    let (http, cookie) = console_session(system, token).await;
    http.get(format!("{}{path}", system.url))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Every round evaluates (20 devices x 20 held-out examples); the rule wants an accuracy gain of
/// more than 1 (impossible) within one evaluation, so the second evaluation stops the task:
/// round 2 completes, model version 2 is its last, and round 3 never opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluations_are_listed_per_model_version_and_early_stopping_completes_the_task() {
    let (system, _dir) = start(now_clock()).await;
    let (token, task) = open_task_with(
        &system,
        "evaluated",
        50.0,
        json!({"evaluation": {"every": 1, "max_examples": 20, "stddev": 20.0,
            "early_stopping": {"metric": "accuracy", "patience": 1, "min_delta": 1.0}}}),
    )
    .await;
    let worker = system.worker("w1");
    for round in 1..=2u64 {
        collect(&system, "evaluated", round, true).await;
        let outcome = worker.run_once().await.unwrap().expect("a job was ready");
        assert_eq!(outcome.round, round);
    }
    let (status, body) = evaluations(&system, &token, &task).await;
    assert_eq!(status, 200, "{body}");
    let points = body["evaluations"].as_array().unwrap();
    let versions: Vec<u64> = points
        .iter()
        .map(|p| p["model_version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, [0, 1]);
    for point in points {
        let stddev = point["stddev"].as_f64().unwrap();
        assert!((20.0..20.01).contains(&stddev), "{point}");
        let examples = point["examples"].as_f64().unwrap();
        assert!((examples - 400.0).abs() < 5.0 * stddev, "{point}");
        assert!(point["accuracy"].as_f64().is_some(), "{point}");
    }
    assert_eq!(body["evaluation"]["every"], 1);
    let reason = body["stopped_early"].as_str().expect("stopped early");
    assert!(reason.contains("early stopping"), "{reason}");

    let task_now: Value = get(&system, &token, &format!("/v1/tasks/{task}"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(task_now["state"], "COMPLETED", "{task_now}");
    assert_eq!(task_now["model_version"], 2);
    assert!(worker.run_once().await.unwrap().is_none(), "no third round");
    let history = system.db.history(&task).await.unwrap();
    assert!(
        history
            .iter()
            .any(|h| h.to_state == "COMPLETED" && h.reason.contains("early stopping")),
        "{history:?}"
    );

    // The metrics come from the signed manifest of the evaluation round's release.
    let manifest: Value = get(
        &system,
        &token,
        &format!("/v1/tasks/{task}/releases/1/manifest"),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(manifest["evaluation"]["model_version"], 0);
    assert_eq!(manifest["evaluation"]["examples"], points[0]["examples"]);
    // ...which a partner checks offline: the release verifies and names the evaluation.
    let verified = confed::verify::verify_release(&system.url, &token, &task, 1, &system.trust)
        .await
        .unwrap();
    assert!(verified.ok(), "{:?}", verified.failures);
    assert!(
        verified
            .lines
            .iter()
            .any(|l| l.starts_with("evaluation of model version 0")),
        "{:?}",
        verified.lines
    );

    // The console's task page shows them, the best version and why the task stopped.
    let page = console_page(&system, &token, &format!("/console/tasks/{task}")).await;
    assert!(page.contains(r#"id="evaluations""#), "{page}");
    assert!(page.contains(r#"data-version="0""#) && page.contains(r#"data-version="1""#));
    assert!(page.contains("Stopped early:"), "{page}");

    // Another tenant's partner cannot read them.
    let stranger = system.tenant("stranger").await.unwrap();
    assert_eq!(evaluations(&system, &stranger, &task).await.0, 404);
}

/// A task without evaluation lists none, and its devices send no metrics (a metrics tensor
/// would have the whole update refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_without_evaluation_lists_none() {
    let (system, _dir) = start(now_clock()).await;
    let (token, task) = open_task(&system, "plain", 50.0).await;
    collect(&system, "plain", 1, true).await;
    let outcome = system.worker("w1").run_once().await.unwrap().unwrap();
    assert_eq!(outcome.excluded, 0);
    let (status, body) = evaluations(&system, &token, &task).await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!({"evaluation": null, "evaluations": [], "best_model_version": null,
               "best_too_noisy": false, "stopped_early": null})
    );
}

/// On demand: the partner asks (202) while round 2 collects; round 3, the next to open, takes
/// the request: its assignments say `evaluate` and its release carries the metrics; one more
/// request than the policy allows is refused (409), as is one for a task that allows none, and
/// another tenant's task is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_on_demand_evaluation_evaluates_the_next_round_to_open_within_the_policy() {
    let (system, _dir) = start(now_clock()).await;
    let (token, task) = open_task_with(
        &system,
        "on-demand",
        50.0,
        json!({"evaluation": {"every": 0, "max_examples": 20, "stddev": 20.0, "on_demand": 1}}),
    )
    .await;
    let ask = |token: String| {
        let url = format!("{}/v1/tasks/{task}/evaluations", system.url);
        async move {
            let reply = reqwest::Client::new()
                .post(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            (
                reply.status().as_u16(),
                reply.json::<Value>().await.unwrap(),
            )
        }
    };
    let worker = system.worker("w1");
    collect(&system, "on-demand", 1, true).await;
    worker.run_once().await.unwrap().unwrap();
    // Through the console's form (with its CSRF token), then the API: one request, waiting.
    let (http, cookie) = console_session(&system, &token).await;
    let page = http
        .get(format!("{}/console/tasks/{task}", system.url))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let action = format!(r#"action="/console/tasks/{task}/evaluations""#);
    let form = &page[page.find(&action).expect("the on-demand form")..];
    let marker = r#"name="csrf" value=""#;
    let start = form.find(marker).unwrap() + marker.len();
    let csrf = &form[start..start + form[start..].find('"').unwrap()];
    let posted = http
        .post(format!("{}/console/tasks/{task}/evaluations", system.url))
        .header("cookie", &cookie)
        .header("origin", &system.url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}"))
        .send()
        .await
        .unwrap();
    assert_eq!(posted.status(), 303);
    let (status, body) = ask(token.clone()).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(
        (body["used"].as_u64(), body["allowed"].as_u64()),
        (Some(0), Some(1))
    );
    // Round 2 was open already: it does not evaluate; round 3 takes the request.
    collect(&system, "on-demand", 2, true).await;
    worker.run_once().await.unwrap().unwrap();
    let assigned = system.db.checkin_candidates("on-demand").await.unwrap();
    assert_eq!(assigned.len(), 1);
    assert!(assigned[0].on_demand_evaluation && assigned[0].round_number == 3);
    // Round 3 took the one on-demand evaluation the policy allows: another is refused.
    let (status, body) = ask(token.clone()).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("used all 1"),
        "{body}"
    );
    // A task in its last round (here its only one), with requests left: nothing would take one.
    let (wide_token, wide) = open_task_with(
        &system,
        "on-demand-wide",
        50.0,
        json!({"evaluation": {"every": 0, "max_examples": 20, "stddev": 20.0, "on_demand": 3},
               "rounds": 1}),
    )
    .await;
    let reply = reqwest::Client::new()
        .post(format!("{}/v1/tasks/{wide}/evaluations", system.url))
        .bearer_auth(&wide_token)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 409);
    let body: Value = reply.json().await.unwrap();
    assert!(
        body["detail"].as_str().unwrap().contains("last round"),
        "{body}"
    );
    collect(&system, "on-demand", 3, true).await;
    worker.run_once().await.unwrap().unwrap();
    let (_, listed) = evaluations(&system, &token, &task).await;
    let points = listed["evaluations"].as_array().unwrap();
    assert_eq!(points.len(), 1, "{listed}");
    assert_eq!(
        (
            points[0]["round"].as_u64(),
            points[0]["model_version"].as_u64()
        ),
        (Some(3), Some(2))
    );
    assert_eq!(points[0]["on_demand"], true, "{listed}");
    assert!(
        (points[0]["examples"].as_f64().unwrap() - 400.0).abs() < 100.0,
        "{listed}"
    );
    // The task completed: nothing more to evaluate.
    let (status, body) = ask(token.clone()).await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("COMPLETED"),
        "{body}"
    );
    let stranger = system.tenant("stranger").await.unwrap();
    assert_eq!(ask(stranger).await.0, 404);

    let (plain_token, plain) = open_task(&system, "no-on-demand", 50.0).await;
    let reply = reqwest::Client::new()
        .post(format!("{}/v1/tasks/{plain}/evaluations", system.url))
        .bearer_auth(&plain_token)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 409);
    assert_eq!(reply.headers()["content-type"], "application/problem+json");
}

/// The round that takes a request: a retried attempt of an on-demand round keeps the flag (and
/// the request stays used), and a round the schedule evaluates anyway takes a request without
/// using one up.
#[tokio::test]
async fn a_retried_attempt_keeps_its_on_demand_flag_and_a_scheduled_round_absorbs_a_request() {
    let app = common::TestApp::new().await;
    let token = app.tenant("acme").await;
    let evaluation =
        |every: u32| json!({"every": every, "max_examples": 10, "stddev": 20.0, "on_demand": 1});
    let ask = |task: String| {
        let (app, token) = (&app, token.clone());
        async move {
            app.call(
                axum::http::Method::POST,
                &format!("/v1/tasks/{task}/evaluations"),
                Some(&token),
                None,
            )
            .await
        }
    };
    let flagged = |population: &'static str| {
        let app = &app;
        async move {
            let candidates = app.db.checkin_candidates(population).await.unwrap();
            assert_eq!(candidates.len(), 1);
            (candidates[0].attempt, candidates[0].on_demand_evaluation)
        }
    };
    // A task of `population` evaluating every `every` rounds, asked to evaluate on demand
    // before round 1 opens; then model version 0 opens round 1.
    let asked_then_opened = |population: &'static str, every: u32| {
        let (app, token) = (&app, token.clone());
        async move {
            let task = app
                .create_task(
                    &token,
                    json!({"population": population, "rounds": 2, "report_goal": 1,
                           "min_reports": 1,
                           "privacy": {"epsilon": 50.0, "delta": 1e-6, "clip_norm": 1.0},
                           "evaluation": evaluation(every)}),
                )
                .await;
            let reply = app
                .call(
                    axum::http::Method::POST,
                    &format!("/v1/tasks/{task}/evaluations"),
                    Some(&token),
                    None,
                )
                .await;
            assert_eq!(reply.status, 202);
            let put = app
                .put_bytes(
                    &format!("/v1/tasks/{task}/model"),
                    &token,
                    common::model_bytes(),
                )
                .await;
            assert_eq!(put.status, 201);
            task
        }
    };
    // Only on demand: round 1 takes the request.
    let task = asked_then_opened("retried", 0).await;
    assert_eq!(flagged("retried").await, (1, true));
    // Its deadline passes with no report: attempt 2 of round 1 is still the on-demand round.
    app.clock.advance(std::time::Duration::from_secs(600));
    confed::scheduler::Scheduler::new(app.db.clone())
        .tick()
        .await
        .unwrap();
    assert_eq!(flagged("retried").await, (2, true));
    let again = ask(task).await;
    assert_eq!(again.status, 409, "the one allowed is used");

    // Scheduled every round: round 1 takes the request, evaluates anyway, uses nothing up.
    let scheduled = asked_then_opened("scheduled", 1).await;
    assert_eq!(flagged("scheduled").await, (1, false));
    let reply = ask(scheduled).await;
    assert_eq!(reply.status, 202);
    assert_eq!(reply.json()["used"], 0);
}
