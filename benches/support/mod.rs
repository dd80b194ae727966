//! The in-process server the benchmarks drive: the real router over SQLite and local blobs in a
//! temp directory, on a loopback port, with one tenant allowed a report goal of 1,000,000.

use std::sync::Arc;

use confed::app::{AppState, Limits};
use confed::blob::LocalBlobStore;
use confed::db::{Db, NewTenant};
use confed::keys::directory::KeyDirectory;

pub(crate) struct BenchServer {
    pub base: String,
    pub token: String,
    pub _dir: tempfile::TempDir,
}

pub(crate) async fn start(keys: KeyDirectory) -> BenchServer {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open_sqlite(&dir.path().join("confed.db"))
        .await
        .unwrap();
    let tenant = NewTenant {
        name: "bench".into(),
        max_active_tasks: 1_000_000,
        max_report_goal: 1_000_000,
        max_device_hours: 1_000_000_000,
    };
    let (_, token) = db.create_tenant(&tenant).await.unwrap();
    let state = AppState {
        db: db.clone(),
        blobs: Arc::new(LocalBlobStore::open(dir.path().join("blobs")).unwrap()),
        contributions: confed::blob::embedded_contributions(dir.path()).unwrap(),
        admin: None,
        limits: Limits::default(),
        keys,
        registry: Default::default(),
        worker_token: None,
        console: Default::default(),
        scheduling: Default::default(),
        partitioning: Default::default(),
        device_auth: Default::default(),
        mask_preparer: Default::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(listener, confed::web::router(state))
            .await
            .unwrap()
    });
    BenchServer {
        base,
        token: token.to_string(),
        _dir: dir,
    }
}
