//! The in-process server the benchmarks drive: the real router over SQLite (or API replicas over
//! one PostgreSQL database) and local blobs in a temp directory, on a loopback port, with one
//! tenant allowed a report goal of 1,000,000.

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
    let token = bench_tenant(&db).await;
    serve(db, keys, token, dir, None).await
}

/// `replicas` servers (API replicas) over the one PostgreSQL database at `url`, each with its own
/// connections, group-commit connection and contribution log, sharing one blob store (models:
/// GCS in scale-out, a directory here), as scale-out runs them; the same tenant's token works on
/// all of them. The first server keeps the shared blob directory.
#[allow(dead_code)]
pub(crate) async fn start_replicas(
    keys: KeyDirectory,
    url: &str,
    replicas: usize,
) -> Vec<BenchServer> {
    let mut token: Option<String> = None;
    let mut servers = Vec::new();
    let shared = tempfile::tempdir().unwrap();
    let blobs = shared.path().join("blobs");
    let mut shared = Some(shared);
    for _ in 0..replicas {
        let db = Db::open(url).await.unwrap();
        let token = match &token {
            Some(token) => token.clone(),
            None => token.insert(bench_tenant(&db).await).clone(),
        };
        let dir = shared
            .take()
            .unwrap_or_else(|| tempfile::tempdir().unwrap());
        servers.push(serve(db, keys.clone(), token, dir, Some(&blobs)).await);
    }
    servers
}

/// A new, empty database on the PostgreSQL server at `server` (a URL naming any database on it),
/// so each measurement starts as SQLite's does, from nothing: measured on one database that
/// kept every earlier run's rows, the same load ran at two thirds of the speed by the third run
/// (tables and indexes past `shared_buffers`, checkpoints of the earlier runs' writes). Returns
/// its URL and its name, for `drop_database`.
#[allow(dead_code)]
pub(crate) async fn fresh_database(server: &str) -> (String, String) {
    use sqlx::Connection as _;
    sqlx::any::install_default_drivers();
    let name = format!("confed_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::AnyConnection::connect(server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.ok();
    let (base, query) = server.split_once('?').unwrap_or((server, ""));
    let root = base.rsplit_once('/').map_or(base, |(root, _)| root);
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    (format!("{root}/{name}{query}"), name)
}

/// Drops the database `name` that `fresh_database` made on `server`, with any connection still
/// open to it.
#[allow(dead_code)]
pub(crate) async fn drop_database(server: &str, name: &str) {
    use sqlx::Connection as _;
    let mut admin = sqlx::AnyConnection::connect(server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    admin.close().await.ok();
}

/// A tenant allowed a report goal of 1,000,000 (named after this process and the call, so runs
/// against one PostgreSQL database do not collide); returns its token.
async fn bench_tenant(db: &Db) -> String {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tenant = NewTenant {
        name: format!("bench-{}-{call}", std::process::id()),
        max_active_tasks: 1_000_000,
        max_report_goal: 1_000_000,
        max_device_hours: 1_000_000_000,
    };
    let (_, token) = db.create_tenant(&tenant).await.unwrap();
    token.to_string()
}

/// The router over `db`, with contributions in `dir` and blobs in `blobs` (`dir/blobs` when
/// `None`), on a loopback port.
async fn serve(
    db: Db,
    keys: KeyDirectory,
    token: String,
    dir: tempfile::TempDir,
    blobs: Option<&std::path::Path>,
) -> BenchServer {
    let blobs = blobs.map_or_else(|| dir.path().join("blobs"), std::path::Path::to_path_buf);
    let state = AppState {
        db: db.clone(),
        blobs: Arc::new(LocalBlobStore::open(blobs).unwrap()),
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
        token,
        _dir: dir,
    }
}
