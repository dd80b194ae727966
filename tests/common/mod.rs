//! A test harness: the real router over a real task database (SQLite, or PostgreSQL: see
//! `database.rs`) and blob directory in a temp dir,
//! with a manual clock. Requests go through the full middleware stack without a socket.
#![allow(dead_code)]

pub(crate) mod database;
pub(crate) mod direct_upload;
pub(crate) mod forgery;
pub(crate) mod gcs;
pub(crate) mod issuer;
pub(crate) mod keyservices;
pub(crate) mod process;
pub(crate) mod serving;
pub(crate) mod system;

use confed::clock::Millis;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use confed::app::{AppState, Limits};
use confed::auth::AdminToken;
use confed::blob::LocalBlobStore;
use confed::clock::ManualClock;
use confed::db::{Db, NewTenant};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

pub(crate) const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef0123456789";
pub(crate) const WORKER_TOKEN: &str = "test-worker-token-0123456789abcdef012345678";
pub(crate) const START_MILLIS: i64 = 1_800_000_000_000;

pub(crate) struct TestApp {
    pub router: Router,
    /// What the router serves from (to rebuild it with other settings).
    #[allow(dead_code)]
    pub state: AppState,
    pub db: Db,
    /// The PostgreSQL database's URL when the tests run on PostgreSQL.
    pub database_url: Option<String>,
    pub clock: Arc<ManualClock>,
    /// A 2-of-2 task key signed by two test key services, as devices receive it.
    pub key: TestKey,
    pub _dir: tempfile::TempDir,
}

pub(crate) struct TestKey {
    pub key_id: String,
    pub private_key: confed_protocol::hpke::PrivateKey,
    pub trusted: Vec<confed_protocol::trust::TrustedKeyService>,
}

/// Key sets of two key services vouching for one fresh key, valid around START_MILLIS.
fn test_key() -> (TestKey, Vec<confed_attestation::exchange::KeySet>) {
    use base64::Engine as _;
    use confed_attestation::exchange::{
        KeySet, SignedPublicKey, encode_verifying_key, generate_signing_key, sign_key,
    };
    let (private_key, public) = confed_protocol::hpke::generate_keypair();
    let mut sets = Vec::new();
    let mut trusted = Vec::new();
    for id in ["ks1", "ks2"] {
        let signing = generate_signing_key();
        let mut entry = SignedPublicKey {
            key_id: "ktest".into(),
            suite: confed_protocol::hpke::SUITE.into(),
            public_key: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(public.0),
            not_before: START_MILLIS / 1000 - 3600,
            not_after: START_MILLIS / 1000 + 30 * 86_400,
            threshold: 2,
            shares: 2,
            state: "active".into(),
            signature: String::new(),
        };
        sign_key(&signing, id, &mut entry);
        let verifying = encode_verifying_key(signing.verifying_key());
        trusted.push(confed_protocol::trust::TrustedKeyService::new(id, &verifying).unwrap());
        // Each key service's masking key, for masked tasks (docs/secure-aggregation.md).
        let (_, masking) = confed_protocol::hpke::generate_keypair();
        sets.push(KeySet {
            keyservice_id: id.into(),
            verifying_key: verifying,
            keys: vec![entry],
            masking_key: Some(confed_protocol::masking_keys::sign_masking_key(
                &signing, id, &masking,
            )),
        });
    }
    (
        TestKey {
            key_id: "ktest".into(),
            private_key,
            trusted,
        },
        sets,
    )
}

pub(crate) struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts a problem+json answer with this status and returns the problem.
    pub(crate) fn problem(&self, status: StatusCode) -> Value {
        assert_eq!(
            self.status,
            status,
            "body: {}",
            String::from_utf8_lossy(&self.body)
        );
        assert_eq!(
            self.headers.get(header::CONTENT_TYPE).unwrap(),
            "application/problem+json"
        );
        let problem = self.json();
        assert_eq!(problem["status"], status.as_u16());
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .starts_with("urn:confed:problem:")
        );
        assert!(!problem["detail"].as_str().unwrap().is_empty());
        problem
    }
}

impl TestApp {
    pub(crate) async fn new() -> Self {
        Self::with(Some(ADMIN_TOKEN), Limits::default()).await
    }

    /// A test app whose devices get keys from `keys` instead of the test key.
    pub(crate) async fn with_keys(keys: confed::keys::directory::KeyDirectory) -> Self {
        Self::build(Some(ADMIN_TOKEN), Limits::default(), Some(keys)).await
    }

    pub(crate) async fn with(admin: Option<&str>, limits: Limits) -> Self {
        Self::build(admin, limits, None).await
    }

    /// The same app with another scheduling policy.
    #[allow(dead_code)]
    pub(crate) fn with_scheduling(mut self, policy: confed::scheduling::SchedulingPolicy) -> Self {
        self.state.scheduling = policy;
        self.router = confed::web::router(self.state.clone());
        self
    }

    /// One app per engine a conformance suite runs on (`database::each_engine`), named.
    #[allow(dead_code)]
    pub(crate) async fn on_each_engine() -> Vec<(&'static str, Self)> {
        let app = |db, url, dir| Self::on(db, url, dir, Some(ADMIN_TOKEN), Limits::default(), None);
        let dir = tempfile::tempdir().unwrap();
        let sqlite = confed::db::Db::open_sqlite(&dir.path().join("confed.db"))
            .await
            .expect("opening the test database on SQLite");
        let mut apps = vec![("sqlite", app(sqlite, None, dir))];
        if let Some(server) = database::postgres_url() {
            let url = database::fresh_postgres_database(&server).await;
            let postgres = confed::db::Db::open_postgres(&url)
                .await
                .expect("opening the test database on PostgreSQL");
            apps.push((
                "postgres",
                app(postgres, Some(url), tempfile::tempdir().unwrap()),
            ));
        }
        apps
    }

    /// A test app on a fresh database of the PostgreSQL server at `server` (a test's own
    /// server, which it may stop and start).
    #[allow(dead_code)]
    pub(crate) async fn on_postgres(server: &str) -> Self {
        let url = database::fresh_postgres_database(server).await;
        let db = confed::db::Db::open_postgres(&url)
            .await
            .expect("opening the test database on PostgreSQL");
        let dir = tempfile::tempdir().unwrap();
        Self::on(
            db,
            Some(url),
            dir,
            Some(ADMIN_TOKEN),
            Limits::default(),
            None,
        )
    }

    async fn build(
        admin: Option<&str>,
        limits: Limits,
        keys: Option<confed::keys::directory::KeyDirectory>,
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (db, database_url) = database::test_database(dir.path()).await;
        Self::on(db, database_url, dir, admin, limits, keys)
    }

    fn on(
        db: confed::db::Db,
        database_url: Option<String>,
        dir: tempfile::TempDir,
        admin: Option<&str>,
        limits: Limits,
        keys: Option<confed::keys::directory::KeyDirectory>,
    ) -> Self {
        let clock = Arc::new(ManualClock::starting_at(Millis(START_MILLIS)));
        // One time for the whole app: the store stamps its writes with the test's clock.
        let db = db.with_clock(clock.clone());
        let (key, key_sets) = test_key();
        let state = AppState {
            db: db.clone(),
            blobs: Arc::new(LocalBlobStore::open(dir.path().join("blobs")).unwrap()),
            contributions: confed::blob::embedded_contributions(dir.path()).unwrap(),
            admin: admin.map(|t| AdminToken::from_secret(t.to_string()).unwrap()),
            limits,
            keys: keys.unwrap_or_else(|| confed::keys::directory::KeyDirectory::fixed(key_sets)),
            registry: Default::default(),
            worker_token: Some(AdminToken::from_secret(WORKER_TOKEN.to_string()).unwrap()),
            console: Default::default(),
            scheduling: Default::default(),
            partitioning: Default::default(),
            device_auth: Default::default(),
            mask_preparer: Default::default(),
        };
        Self {
            router: confed::web::router(state.clone()),
            state,
            db,
            database_url,
            clock,
            key,
            _dir: dir,
        }
    }

    /// Creates a tenant directly in the database and returns its token.
    pub(crate) async fn tenant(&self, name: &str) -> String {
        self.tenant_with(name, 10, 10_000).await
    }

    pub(crate) async fn tenant_with(
        &self,
        name: &str,
        max_active_tasks: i64,
        max_report_goal: i64,
    ) -> String {
        self.tenant_with_hours(
            name,
            max_active_tasks,
            max_report_goal,
            confed::api::admin::DEFAULT_MAX_DEVICE_HOURS,
        )
        .await
    }

    /// A tenant with its compute budget (device-hours) set.
    pub(crate) async fn tenant_with_hours(
        &self,
        name: &str,
        max_active_tasks: i64,
        max_report_goal: i64,
        max_device_hours: i64,
    ) -> String {
        let new = NewTenant {
            name: name.into(),
            max_active_tasks,
            max_report_goal,
            max_device_hours,
        };
        let (_, token) = self.db.create_tenant(&new).await.unwrap();
        token.to_string()
    }

    pub(crate) async fn send(&self, request: Request<Body>) -> Reply {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        Reply {
            status,
            headers,
            body,
        }
    }

    pub(crate) async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = match body {
            Some(body) => request
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap())),
            None => request.body(Body::empty()),
        };
        self.send(request.unwrap()).await
    }

    /// PUT raw bytes with a content type and no token (device uploads).
    pub(crate) async fn put_raw(&self, path: &str, content_type: &str, bytes: Vec<u8>) -> Reply {
        let request = Request::builder()
            .method(Method::PUT)
            .uri(path)
            .header(header::CONTENT_TYPE, content_type)
            .body(Body::from(bytes))
            .unwrap();
        self.send(request).await
    }

    pub(crate) async fn put_bytes(&self, path: &str, token: &str, bytes: Vec<u8>) -> Reply {
        let request = Request::builder()
            .method(Method::PUT)
            .uri(path)
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(Body::from(bytes))
            .unwrap();
        self.send(request).await
    }

    /// A device that fits `task_body()`'s defaults checks in to its population.
    #[allow(dead_code)]
    pub(crate) async fn check_in(&self) -> Reply {
        let population = task_body(json!({}))["population"]
            .as_str()
            .unwrap()
            .to_string();
        self.call(
            Method::POST,
            &format!("/v1/populations/{population}/checkin"),
            None,
            Some(json!({"client_version": "1.4.0", "attributes": {"os": "android", "ram_gb": 8, "charging": true}})),
        )
        .await
    }

    /// Creates a task from `task_body()` merged with `overrides`; returns its id.
    pub(crate) async fn create_task(&self, token: &str, overrides: Value) -> String {
        let reply = self
            .call(
                Method::POST,
                "/v1/tasks",
                Some(token),
                Some(task_body(overrides)),
            )
            .await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        reply.json()["id"].as_str().unwrap().to_string()
    }

    /// Creates a task and uploads model version 0, so round 1 is collecting.
    pub(crate) async fn open_task(&self, token: &str, overrides: Value) -> String {
        let id = self.create_task(token, overrides).await;
        let reply = self
            .put_bytes(&format!("/v1/tasks/{id}/model"), token, model_bytes())
            .await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        id
    }
}

/// The upload window of the tests' tasks: devices send 100-200 ms after their assignment
/// (training in the tests takes a few milliseconds; the API's default is a minute or two).
pub(crate) static FAST_UPLOAD_WINDOW: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| json!({"start_ms": 100, "end_ms": 200}));

/// `spec` with `FAST_UPLOAD_WINDOW` where it names no upload window.
/// Creates a task of `spec` on a running server (`url`, the tenant's `token`) over HTTP and
/// uploads `model` as its version 0, opening round 1; the task's id.
pub(crate) async fn open_task_over_http(
    url: &str,
    token: &str,
    spec: Value,
    model: Vec<u8>,
) -> String {
    let http = confed_protocol::http::client(std::time::Duration::from_secs(60));
    let task: Value = http
        .post(format!("{url}/v1/tasks"))
        .bearer_auth(token)
        .json(&spec)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = task["id"]
        .as_str()
        .unwrap_or_else(|| panic!("the task was not created: {task}"))
        .to_string();
    let opened = http
        .put(format!("{url}/v1/tasks/{id}/model"))
        .bearer_auth(token)
        .body(model)
        .send()
        .await
        .unwrap();
    assert_eq!(opened.status(), 201, "model version 0 of {id}");
    id
}

pub(crate) fn with_fast_window(mut spec: Value) -> Value {
    if let Some(fields) = spec.as_object_mut() {
        fields
            .entry("upload_window")
            .or_insert_with(|| FAST_UPLOAD_WINDOW.clone());
    }
    spec
}

pub(crate) fn task_body(overrides: Value) -> Value {
    let mut body = json!({
        "population": "phones.en",
        "rounds": 3,
        "report_goal": 10,
        "min_reports": 5,
        "round_deadline_seconds": 600,
        "assignment_timeout_seconds": 60,
        "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
        "plan": {"epochs": 1, "batch_size": 32, "learning_rate": 0.1},
        "upload_window": FAST_UPLOAD_WINDOW.clone(),
    });
    body.as_object_mut()
        .unwrap()
        .extend(overrides.as_object().unwrap().clone());
    body
}

pub(crate) fn model_bytes() -> Vec<u8> {
    confed_worker_api::model::encode_f32_tensors(&[
        ("dense.weight", vec![2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        ("dense.bias", vec![2], &[0.0, 0.0]),
    ])
    .unwrap()
}

/// The workspace's `confed-enclave` binary, next to `confed`. `cargo test --workspace` builds it
/// before any test runs; run alone (`cargo test -p confed --test enclave_process`, say), the test
/// builds it if it is missing (an older build is used as is: run `cargo build --workspace` first).
pub(crate) fn enclave_binary() -> std::path::PathBuf {
    let confed = std::path::PathBuf::from(env!("CARGO_BIN_EXE_confed"));
    let binary = confed.with_file_name("confed-enclave");
    if !binary.exists() {
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "-p", "confed-enclave", "--bin", "confed-enclave"])
            .status()
            .unwrap();
        assert!(status.success(), "building confed-enclave failed");
    }
    binary
}
