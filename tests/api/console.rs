//! The partner console's security properties, on each database engine: sign-in exchanges the
//! token for an HttpOnly, SameSite=Strict session cookie; sessions expire and end at sign-out
//! on the server; forms without the session's CSRF token, or posted from another site, are
//! refused; another tenant's task is not reachable; every page carries the security headers.
//! (The pages in a real browser: tests/browser/.)

use crate::common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use common::{Reply, TestApp};
use serde_json::json;

const HOST: &str = "127.0.0.1:8080";

fn form(path: &str, cookie: Option<&str>, body: &str) -> Request<Body> {
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::HOST, HOST)
        .header(header::ORIGIN, format!("http://{HOST}"))
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    request.body(Body::from(body.to_string())).unwrap()
}

fn get(path: &str, cookie: Option<&str>) -> Request<Body> {
    let mut request = Request::builder().uri(path).header(header::HOST, HOST);
    if let Some(cookie) = cookie {
        request = request.header(header::COOKIE, cookie);
    }
    request.body(Body::empty()).unwrap()
}

fn text(reply: &Reply) -> String {
    String::from_utf8_lossy(&reply.body).into_owned()
}

fn urlencode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A task's state, as the API reports it to its tenant.
async fn task_state(app: &TestApp, token: &str, task: &str) -> serde_json::Value {
    app.call(Method::GET, &format!("/v1/tasks/{task}"), Some(token), None)
        .await
        .json()["state"]
        .clone()
}

/// Signs in with `token`; returns the cookie pair to send back (`name=value`).
async fn sign_in(app: &TestApp, token: &str) -> String {
    let reply = app
        .send(form(
            "/console/sign-in",
            None,
            &format!("token={}", urlencode(token)),
        ))
        .await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER, "{}", text(&reply));
    assert_eq!(reply.headers[header::LOCATION], "/console/tasks");
    let set_cookie = reply.headers[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        !set_cookie.contains(token),
        "the token must not be the cookie"
    );
    set_cookie.split(';').next().unwrap().to_string()
}

/// The CSRF token the page at `path` puts in its forms.
async fn csrf_of(app: &TestApp, cookie: &str, path: &str) -> String {
    let page = text(&app.send(get(path, Some(cookie))).await);
    let marker = r#"name="csrf" value=""#;
    let start = page.find(marker).expect("a form with a CSRF field") + marker.len();
    page[start..start + page[start..].find('"').unwrap()].to_string()
}

#[tokio::test]
async fn sign_in_sets_a_strict_http_only_cookie_and_a_wrong_token_sets_none() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let reply = app
            .send(form(
                "/console/sign-in",
                None,
                &format!("token={}", urlencode(&token)),
            ))
            .await;
        let cookie = reply.headers[header::SET_COOKIE].to_str().unwrap();
        assert!(cookie.starts_with("confed_session="), "{engine}: {cookie}");
        for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=3600"] {
            assert!(
                cookie.contains(attribute),
                "{engine}: {cookie} lacks {attribute}"
            );
        }
        let wrong = app
            .send(form(
                "/console/sign-in",
                None,
                "token=cft_0123456789abcdef_wrong",
            ))
            .await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{engine}");
        assert!(wrong.headers.get(header::SET_COOKIE).is_none(), "{engine}");
        assert!(text(&wrong).contains("not valid"), "{engine}");
    }
}

#[tokio::test]
async fn pages_need_a_live_session_which_expires_and_ends_at_sign_out() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let unsigned = app.send(get("/console/tasks", None)).await;
        assert_eq!(unsigned.status, StatusCode::SEE_OTHER, "{engine}");
        assert_eq!(unsigned.headers[header::LOCATION], "/console/sign-in");
        let forged = app
            .send(get(
                "/console/tasks",
                Some(&format!("confed_session={}", "A".repeat(43))),
            ))
            .await;
        assert_eq!(
            forged.status,
            StatusCode::SEE_OTHER,
            "{engine}: an unknown session"
        );

        // Expiry, by the injected clock: valid just before the hour, not at it.
        let cookie = sign_in(&app, &token).await;
        app.clock.advance(Duration::from_secs(3599));
        assert_eq!(
            app.send(get("/console/tasks", Some(&cookie))).await.status,
            StatusCode::OK
        );
        app.clock.advance(Duration::from_secs(1));
        let expired = app.send(get("/console/tasks", Some(&cookie))).await;
        assert_eq!(
            expired.status,
            StatusCode::SEE_OTHER,
            "{engine}: expired session"
        );

        // Sign-out ends the session on the server: the old cookie, replayed, is refused.
        let cookie = sign_in(&app, &token).await;
        let csrf = csrf_of(&app, &cookie, "/console/tasks").await;
        let out = app
            .send(form(
                "/console/sign-out",
                Some(&cookie),
                &format!("csrf={csrf}"),
            ))
            .await;
        assert_eq!(out.status, StatusCode::SEE_OTHER, "{engine}");
        assert!(
            out.headers[header::SET_COOKIE]
                .to_str()
                .unwrap()
                .contains("Max-Age=0")
        );
        let replayed = app.send(get("/console/tasks", Some(&cookie))).await;
        assert_eq!(
            replayed.status,
            StatusCode::SEE_OTHER,
            "{engine}: signed-out session"
        );
    }
}

#[tokio::test]
async fn forms_without_the_csrf_token_or_from_another_site_change_nothing() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let task = app.create_task(&token, json!({})).await;
        let cookie = sign_in(&app, &token).await;
        let csrf = csrf_of(&app, &cookie, &format!("/console/tasks/{task}")).await;
        let cancel = format!("/console/tasks/{task}/cancel");
        for body in [String::new(), "csrf=".into(), "csrf=guess".into()] {
            let reply = app.send(form(&cancel, Some(&cookie), &body)).await;
            assert_eq!(reply.status, StatusCode::FORBIDDEN, "{engine}: {body:?}");
        }
        // Another session's token is no good either.
        let other_cookie = sign_in(&app, &token).await;
        let other_csrf = csrf_of(&app, &other_cookie, "/console/tasks").await;
        assert_ne!(other_csrf, csrf);
        let reply = app
            .send(form(&cancel, Some(&cookie), &format!("csrf={other_csrf}")))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::FORBIDDEN,
            "{engine}: another session's token"
        );
        // The right token from another site's page.
        let mut cross = form(&cancel, Some(&cookie), &format!("csrf={csrf}"));
        cross
            .headers_mut()
            .insert(header::ORIGIN, "http://evil.example".parse().unwrap());
        assert_eq!(
            app.send(cross).await.status,
            StatusCode::FORBIDDEN,
            "{engine}: cross-site"
        );
        let state = task_state(&app, &token, &task).await;
        assert_eq!(state, "CREATED", "{engine}: nothing was cancelled");
        // The right token, from this site: cancelled.
        let reply = app
            .send(form(&cancel, Some(&cookie), &format!("csrf={csrf}")))
            .await;
        assert_eq!(
            reply.status,
            StatusCode::SEE_OTHER,
            "{engine}: {}",
            text(&reply)
        );
        let state = task_state(&app, &token, &task).await;
        assert_eq!(state, "CANCELLED", "{engine}");
    }
}

#[tokio::test]
async fn another_tenants_task_is_not_reachable() {
    for (engine, app) in TestApp::on_each_engine().await {
        let mine = app.tenant("acme").await;
        let theirs = app.tenant("rival").await;
        let their_task = app.open_task(&theirs, json!({})).await;
        let cookie = sign_in(&app, &mine).await;
        for path in [
            format!("/console/tasks/{their_task}"),
            format!("/console/tasks/{their_task}/models/0"),
        ] {
            let reply = app.send(get(&path, Some(&cookie))).await;
            assert_eq!(reply.status, StatusCode::NOT_FOUND, "{engine}: {path}");
        }
        let list = text(&app.send(get("/console/tasks", Some(&cookie))).await);
        assert!(!list.contains(&their_task), "{engine}");
        let csrf = csrf_of(&app, &cookie, "/console/tasks").await;
        let reply = app
            .send(form(
                &format!("/console/tasks/{their_task}/cancel"),
                Some(&cookie),
                &format!("csrf={csrf}"),
            ))
            .await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{engine}");
        let state = task_state(&app, &theirs, &their_task).await;
        assert_eq!(state, "OPEN", "{engine}");
    }
}

#[tokio::test]
async fn the_new_task_form_creates_a_task_or_names_the_bad_fields() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let cookie = sign_in(&app, &token).await;
    let csrf = csrf_of(&app, &cookie, "/console/tasks/new").await;
    let fields = "population=phones&rounds=4&report_goal=10&min_reports=&epsilon=0&delta=1e-6&clip_norm=1&round_deadline_seconds=&assignment_timeout_seconds=&server_learning_rate=&plan=";
    let bad = app
        .send(form(
            "/console/tasks",
            Some(&cookie),
            &format!("csrf={csrf}&{fields}"),
        ))
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let page = text(&bad);
    assert!(page.contains(r#"id="epsilon-problem""#), "{page}");
    assert!(
        page.contains(r#"value="phones""#),
        "the typed values are kept"
    );
    let tasks = app
        .call(Method::GET, "/v1/tasks", Some(&token), None)
        .await
        .json();
    assert_eq!(tasks["tasks"].as_array().unwrap().len(), 0);

    let good = fields.replace("epsilon=0", "epsilon=4");
    let reply = app
        .send(form(
            "/console/tasks",
            Some(&cookie),
            &format!("csrf={csrf}&{good}"),
        ))
        .await;
    assert_eq!(reply.status, StatusCode::SEE_OTHER, "{}", text(&reply));
    let location = reply.headers[header::LOCATION].to_str().unwrap();
    let id = location.strip_prefix("/console/tasks/").unwrap();
    let task = app
        .call(Method::GET, &format!("/v1/tasks/{id}"), Some(&token), None)
        .await
        .json();
    assert_eq!(
        (task["state"].as_str(), task["rounds"].as_i64()),
        (Some("CREATED"), Some(4))
    );
    assert_eq!(
        task["min_reports"], 10,
        "an empty field takes the API's default"
    );
}

/// A refusal no field shows (the privacy plan) is in the banner in the API's words; text in a
/// number field is named with its field, all at once; a named task is listed by its name.
#[tokio::test]
async fn the_form_shows_every_refusal_and_a_task_keeps_its_name() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let cookie = sign_in(&app, &token).await;
    let csrf = csrf_of(&app, &cookie, "/console/tasks/new").await;
    let post = |fields: String| {
        let cookie = cookie.clone();
        let csrf = csrf.clone();
        let app = &app;
        async move {
            app.send(form(
                "/console/tasks",
                Some(&cookie),
                &format!("csrf={csrf}&{fields}"),
            ))
            .await
        }
    };
    let unusable = post(
        "population=phones&rounds=100&report_goal=2&epsilon=0.5&delta=1e-6&clip_norm=1".into(),
    )
    .await;
    assert_eq!(unusable.status, StatusCode::BAD_REQUEST);
    let page = text(&unusable);
    assert!(
        page.contains(r#"<div class="problem" id="form-problems" role="alert"><p>The task was not created: privacy: "#)
            && page.contains("report_goal"),
        "the plan's refusal, in the banner: {page}"
    );
    let typed =
        post("population=phones&rounds=abc&report_goal=10&epsilon=x&delta=1e-6&clip_norm=1".into())
            .await;
    let page = text(&typed);
    assert!(
        page.contains(r#"<p class="problem" id="rounds-problem">must be a whole number (got &quot;abc&quot;)</p>"#)
            && page.contains(r#"<p class="problem" id="epsilon-problem">must be a number (got &quot;x&quot;)</p>"#),
        "{page}"
    );
    assert!(page.contains(r#"type="number""#), "number inputs");
    let named = post(format!(
        "name={}&population=phones&rounds=3&report_goal=10&epsilon=8&delta=1e-6&clip_norm=1&round_deadline_seconds=120&server_optimizer=fedadam&mechanism=gaussian",
        urlencode("Next word <en-US>")
    ))
    .await;
    assert_eq!(named.status, StatusCode::SEE_OTHER, "{}", text(&named));
    let id = named.headers[header::LOCATION]
        .to_str()
        .unwrap()
        .strip_prefix("/console/tasks/")
        .unwrap()
        .to_string();
    let task = app
        .call(Method::GET, &format!("/v1/tasks/{id}"), Some(&token), None)
        .await
        .json();
    assert_eq!(task["name"], "Next word <en-US>");
    assert_eq!(
        task["assignment_timeout_seconds"], 120,
        "a short deadline brings its own assignment timeout"
    );
    assert_eq!(task["server_optimizer"]["name"], "fedadam");
    assert_eq!(
        task["upload_window"],
        serde_json::json!({"start_ms": 57_500, "end_ms": 115_000}),
        "the default window, within the 120 s assignment timeout less 5 s (its start at most half its end)"
    );
    // The upload window, and a refusal of its end named on its field.
    let windowed = post(
        "population=phones&rounds=3&report_goal=10&epsilon=8&delta=1e-6&clip_norm=1&upload_window_start_ms=200&upload_window_end_ms=900".into(),
    )
    .await;
    assert_eq!(
        windowed.status,
        StatusCode::SEE_OTHER,
        "{}",
        text(&windowed)
    );
    let late = post(
        "population=phones&rounds=3&report_goal=10&epsilon=8&delta=1e-6&clip_norm=1&assignment_timeout_seconds=10&upload_window_start_ms=0&upload_window_end_ms=9000".into(),
    )
    .await;
    assert_eq!(late.status, StatusCode::BAD_REQUEST);
    assert!(
        text(&late).contains(r#"id="upload_window_end_ms-problem">must be between 0 and 5000"#),
        "{}",
        text(&late)
    );
    // Only one end of the window: refused with a message, not stored half.
    let half = post(
        "population=phones&rounds=3&report_goal=10&epsilon=8&delta=1e-6&clip_norm=1&upload_window_start_ms=200".into(),
    )
    .await;
    assert_eq!(half.status, StatusCode::BAD_REQUEST, "{}", text(&half));
    assert!(text(&half).contains("end_ms"), "{}", text(&half));
    let list = text(&app.send(get("/console/tasks", Some(&cookie))).await);
    assert!(
        list.contains("Next word &lt;en-US&gt;<br><code class=\"id\">"),
        "{list}"
    );
}

#[tokio::test]
async fn every_console_answer_carries_the_security_headers() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let cookie = sign_in(&app, &token).await;
    for (path, cookie) in [
        ("/console/sign-in", None),
        ("/console/tasks", Some(cookie.as_str())),
        ("/console/tasks/no-such-task", Some(cookie.as_str())),
        ("/console/populations", Some(cookie.as_str())),
    ] {
        let reply = app.send(get(path, cookie)).await;
        let csp = reply.headers[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap();
        assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"));
        assert!(!csp.contains("script-src"), "no script is allowed: {csp}");
        assert_eq!(reply.headers[header::X_FRAME_OPTIONS], "DENY", "{path}");
        assert_eq!(reply.headers[header::CACHE_CONTROL], "no-store", "{path}");
        assert_eq!(
            reply.headers[header::X_CONTENT_TYPE_OPTIONS],
            "nosniff",
            "{path}"
        );
    }
    let missing = app
        .send(get("/console/tasks/no-such-task", Some(&cookie)))
        .await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert!(
        text(&missing).contains("no-such-task"),
        "the error page says what is missing"
    );
}

#[tokio::test]
async fn task_page_and_populations_count_the_rounds_assignments_and_check_ins() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let task = app.open_task(&token, json!({})).await;
        for _ in 0..2 {
            let reply = app.check_in().await;
            assert_eq!(
                reply.status,
                StatusCode::CREATED,
                "{engine}: {}",
                text(&reply)
            );
        }
        let cookie = sign_in(&app, &token).await;
        let page = text(
            &app.send(get(&format!("/console/tasks/{task}"), Some(&cookie)))
                .await,
        );
        assert!(page.contains(r#"<tr data-round="1">"#), "{engine}: {page}");
        assert!(
            page.contains(r#"<td class="num" data-field="assigned">2</td>"#),
            "{engine}: {page}"
        );
        assert!(
            page.contains(r#"<meta http-equiv="refresh""#),
            "{engine}: a live round refreshes"
        );
        let populations = text(&app.send(get("/console/populations", Some(&cookie))).await);
        assert!(
            populations.contains(r#"<strong data-field="checkins">2</strong>"#),
            "{engine}: {populations}"
        );
        assert!(
            populations.contains(r#"<tr data-outcome="assigned">"#),
            "{engine}"
        );
        assert!(
            populations.contains(&format!(r#"<li data-task="{task}">"#)),
            "{engine}"
        );
    }
}

/// Declines are counted apart from failures, the live round shows its deadline, and a cancelled
/// task says why on its page and on its failed round.
#[tokio::test]
async fn task_page_counts_declines_apart_shows_the_deadline_and_why_the_task_ended() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let task = app.open_task(&token, json!({})).await;
    let mut reports = Vec::new();
    for outcome in [
        json!({"outcome": "not_eligible"}),
        json!({"outcome": "failed"}),
    ] {
        let assignment = app.check_in().await.json();
        let path = assignment["report_url"].as_str().unwrap().to_string();
        reports.push(
            app.call(Method::POST, &path, None, Some(outcome))
                .await
                .status,
        );
    }
    assert_eq!(reports, [StatusCode::OK, StatusCode::OK]);
    let cookie = sign_in(&app, &token).await;
    let page = text(
        &app.send(get(&format!("/console/tasks/{task}"), Some(&cookie)))
            .await,
    );
    assert!(
        page.contains(r#"<td class="num" data-field="declined">1</td>"#)
            && page.contains(r#"<td class="num" data-field="failed">1</td>"#),
        "{page}"
    );
    // The declines are explained as a device's own rule, not drop-out.
    assert!(
        page.contains(r#"<p class="note" id="declined-note">Declined in round 1: 1 of its 2 assignments. A device declines a round it has already served"#),
        "{page}"
    );
    assert!(page.contains("check-ins, not devices"), "{page}");
    assert!(page.contains(r#"<dd id="live-round">1, "#), "{page}");
    assert!(page.contains("deadline <time datetime="), "{page}");
    assert!(page.contains(" (in 10 min 0 s)"), "{page}");

    let cancelled = app
        .call(
            Method::POST,
            &format!("/v1/tasks/{task}/cancel"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(cancelled.json()["failure_reason"], "cancelled by partner");
    let page = text(
        &app.send(get(&format!("/console/tasks/{task}"), Some(&cookie)))
            .await,
    );
    assert!(
        page.contains(r#"<p class="problem" id="failure-reason" role="status">Cancelled: cancelled by partner</p>"#),
        "{page}"
    );
    assert!(
        page.contains(
            r#"data-field="failure_reason"><summary>why</summary>task cancelled</details>"#
        ),
        "{page}"
    );
    assert!(!page.contains("live-round"), "no live round once cancelled");
}

#[tokio::test]
async fn text_from_the_database_is_escaped_not_run() {
    let app = TestApp::new().await;
    let name = r#"<script>alert("x")</script>"#;
    let token = app.tenant(name).await;
    let cookie = sign_in(&app, &token).await;
    let page = text(&app.send(get("/console/tasks", Some(&cookie))).await);
    assert!(!page.contains("<script>"), "{page}");
    assert!(
        page.contains("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"),
        "{page}"
    );
}

#[tokio::test]
async fn a_tenant_keeps_at_most_twenty_sessions_the_oldest_end_first() {
    for (engine, app) in TestApp::on_each_engine().await {
        let token = app.tenant("acme").await;
        let first = sign_in(&app, &token).await;
        let mut second = String::new();
        for i in 0..20 {
            app.clock.advance(Duration::from_millis(1));
            let cookie = sign_in(&app, &token).await;
            if i == 0 {
                second = cookie;
            }
        }
        let ended = app.send(get("/console/tasks", Some(&first))).await;
        assert_eq!(
            ended.status,
            StatusCode::SEE_OTHER,
            "{engine}: the 21st ends the oldest"
        );
        let kept = app.send(get("/console/tasks", Some(&second))).await;
        assert_eq!(
            kept.status,
            StatusCode::OK,
            "{engine}: the twenty newest live on"
        );
    }
}

#[tokio::test]
async fn a_post_that_does_not_say_where_it_comes_from_is_refused() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let mut request = form(
        "/console/sign-in",
        None,
        &format!("token={}", urlencode(&token)),
    );
    request.headers_mut().remove(header::ORIGIN);
    let reply = app.send(request).await;
    assert_eq!(reply.status, StatusCode::FORBIDDEN);
    assert!(reply.headers.get(header::SET_COOKIE).is_none());
}
