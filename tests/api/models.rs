//! Model routes: upload version 0 (opens the task) and download with caching.

use crate::common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use common::{TestApp, model_bytes};
use confed::app::Limits;
use serde_json::json;

#[tokio::test]
async fn upload_opens_the_task_and_round_one() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let reply = app
        .put_bytes(&format!("/v1/tasks/{id}/model"), &token, model_bytes())
        .await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let task = reply.json();
    assert_eq!(task["state"], "OPEN");
    assert_eq!(task["model_version"], 0);
    assert_eq!(task["current_round"], 1);
    let history = app.db.history(&id).await.unwrap();
    let states: Vec<_> = history
        .iter()
        .map(|h| (h.from_state.as_deref(), h.to_state.as_str()))
        .collect();
    assert_eq!(states, [(None, "CREATED"), (Some("CREATED"), "OPEN")]);
}

#[tokio::test]
async fn upload_refuses_what_is_not_a_model() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let nan_model =
        confed_worker_api::model::encode_f32_tensors(&[("w", vec![1], &[f32::NAN])]).unwrap();
    for (bytes, expect) in [
        (b"not safetensors".to_vec(), "not a valid safetensors"),
        (nan_model, "non-finite"),
        (Vec::new(), "not a valid safetensors"),
    ] {
        let reply = app
            .put_bytes(&format!("/v1/tasks/{id}/model"), &token, bytes)
            .await;
        let detail = reply.problem(StatusCode::BAD_REQUEST)["detail"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(detail.contains(expect), "{detail}");
    }
    let task = app
        .call(Method::GET, &format!("/v1/tasks/{id}"), Some(&token), None)
        .await
        .json();
    assert_eq!(task["state"], "CREATED");
}

#[tokio::test]
async fn second_upload_is_409_and_keeps_version_zero() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.open_task(&token, json!({})).await;
    let other = confed_worker_api::model::encode_f32_tensors(&[("w", vec![1], &[9.0])]).unwrap();
    let reply = app
        .put_bytes(&format!("/v1/tasks/{id}/model"), &token, other)
        .await;
    assert!(
        reply.problem(StatusCode::CONFLICT)["detail"]
            .as_str()
            .unwrap()
            .contains("OPEN")
    );
    let model = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{id}/models/0"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(model.body, model_bytes());
}

#[tokio::test]
async fn upload_to_unknown_task_is_404_and_without_token_401() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    app.put_bytes("/v1/tasks/nope/model", &token, model_bytes())
        .await
        .problem(StatusCode::NOT_FOUND);
    let request = Request::put("/v1/tasks/nope/model")
        .body(Body::from(model_bytes()))
        .unwrap();
    app.send(request).await.problem(StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn upload_over_the_model_limit_is_413() {
    let limits = Limits {
        model_bytes: 1024,
        ..Limits::default()
    };
    let app = TestApp::with(None, limits).await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let big =
        confed_worker_api::model::encode_f32_tensors(&[("w", vec![1000], &[0.5; 1000])]).unwrap();
    app.put_bytes(&format!("/v1/tasks/{id}/model"), &token, big)
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE);
}

/// A model upload declaring 10 GB was read into memory up to the 512 MiB limit before the 413.
/// Refused on its declared length: the body is never polled (it would panic here).
#[tokio::test]
async fn a_model_upload_declaring_ten_gigabytes_is_refused_before_a_byte_is_read() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.create_task(&token, json!({})).await;
    let never_read = futures_util::stream::once(async {
        panic!("the body of a refused upload was read");
        #[allow(unreachable_code)]
        Ok::<_, std::io::Error>(bytes::Bytes::new())
    });
    let request = Request::builder()
        .method("PUT")
        .uri(format!("/v1/tasks/{id}/model"))
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/octet-stream")
        .header("content-length", (10u64 << 30).to_string())
        .body(Body::from_stream(never_read))
        .unwrap();
    let problem = app
        .send(request)
        .await
        .problem(StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        problem["detail"].as_str().unwrap().contains("10737418240"),
        "{problem}"
    );
}

#[tokio::test]
async fn download_returns_bytes_with_strong_etag_and_304_on_match() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.open_task(&token, json!({})).await;
    let reply = app
        .call(
            Method::GET,
            &format!("/v1/tasks/{id}/models/0"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, model_bytes());
    assert_eq!(
        reply.headers[header::CONTENT_TYPE],
        "application/octet-stream"
    );
    assert!(
        reply.headers[header::CACHE_CONTROL]
            .to_str()
            .unwrap()
            .contains("immutable")
    );
    let etag = reply.headers[header::ETAG].to_str().unwrap().to_string();
    assert!(etag.starts_with('"') && !etag.starts_with("W/"));

    let request = Request::get(format!("/v1/tasks/{id}/models/0"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::IF_NONE_MATCH, &etag)
        .body(Body::empty())
        .unwrap();
    let cached = app.send(request).await;
    assert_eq!(cached.status, StatusCode::NOT_MODIFIED);
    assert!(cached.body.is_empty());
}

#[tokio::test]
async fn download_errors_name_the_problem() {
    let app = TestApp::new().await;
    let token = app.tenant("acme").await;
    let id = app.open_task(&token, json!({})).await;
    app.call(
        Method::GET,
        &format!("/v1/tasks/{id}/models/1"),
        Some(&token),
        None,
    )
    .await
    .problem(StatusCode::NOT_FOUND);
    app.call(
        Method::GET,
        &format!("/v1/tasks/{id}/models/latest"),
        Some(&token),
        None,
    )
    .await
    .problem(StatusCode::BAD_REQUEST);
    app.call(Method::GET, &format!("/v1/tasks/{id}/models/0"), None, None)
        .await
        .problem(StatusCode::UNAUTHORIZED);
    let created = app.create_task(&token, json!({})).await;
    app.call(
        Method::GET,
        &format!("/v1/tasks/{created}/models/0"),
        Some(&token),
        None,
    )
    .await
    .problem(StatusCode::NOT_FOUND);
}
