//! The task database a test runs on: SQLite in the test's directory by default, or a fresh
//! PostgreSQL database when `CONFED_TEST_DATABASE_URL` names a PostgreSQL server
//! (`deploy/local/postgres.sh start DIR` prints one; `.ci/run` runs the suites both ways).

use std::path::Path;

use confed::db::Db;
use sqlx::Connection;

pub(crate) const POSTGRES_ENV: &str = "CONFED_TEST_DATABASE_URL";

/// The PostgreSQL server the tests should use, if any.
pub(crate) fn postgres_url() -> Option<String> {
    std::env::var(POSTGRES_ENV)
        .ok()
        .filter(|url| url.starts_with("postgres://") || url.starts_with("postgresql://"))
}

/// A new, empty, migrated task database for one test, and its URL when on PostgreSQL (a
/// second `Db` opened on it plays another replica).
pub(crate) async fn test_database(dir: &Path) -> (Db, Option<String>) {
    match postgres_url() {
        Some(server) => {
            let url = fresh_postgres_database(&server).await;
            let db = Db::open_postgres(&url)
                .await
                .expect("opening the test database on PostgreSQL");
            (db, Some(url))
        }
        None => (
            Db::open_sqlite(&dir.join("confed.db"))
                .await
                .expect("opening the test database on SQLite"),
            None,
        ),
    }
}

/// Creates a uniquely named database on `server` and returns its URL.
pub(crate) async fn fresh_postgres_database(server: &str) -> String {
    sqlx::any::install_default_drivers();
    let name = format!("confed_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::AnyConnection::connect(server)
        .await
        .unwrap_or_else(|e| panic!("{POSTGRES_ENV}={server}: cannot connect: {e}"));
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("CREATE DATABASE");
    admin.close().await.ok();
    let (base, query) = match server.split_once('?') {
        Some((base, query)) => (base, format!("?{query}")),
        None => (server, String::new()),
    };
    let root = base.rsplit_once('/').map_or(base, |(root, _)| root);
    format!("{root}/{name}{query}")
}
