//! What only the PostgreSQL engine runs: the device store as single-statement CTEs and row locks,
//! for many replicas at once.

pub(super) mod batch;
pub(super) mod device;
pub(super) mod grouped;
pub(super) mod notify;
pub(super) mod readers;
pub(super) mod sets;

/// The PostgreSQL server the library's own PostgreSQL tests run on (`CONFED_TEST_DATABASE_URL`,
/// set by the CI's PostgreSQL pass), if any.
#[cfg(test)]
fn test_server() -> Option<String> {
    sqlx::any::install_default_drivers();
    std::env::var("CONFED_TEST_DATABASE_URL")
        .ok()
        .filter(|url| url.starts_with("postgres"))
}

/// A migrated, empty database of its own on the server the tests name, or `None`.
#[cfg(test)]
pub(in crate::db) async fn fresh_test_db() -> Option<crate::db::Db> {
    let server = test_server()?;
    let name = format!("confed_test_{}", uuid::Uuid::new_v4().simple());
    let mut admin = <sqlx::AnyConnection as sqlx::Connection>::connect(&server)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::Connection::close(admin).await.ok();
    let (base, query) = server.split_once('?').unwrap_or((&server, ""));
    let root = base.rsplit_once('/').map_or(base, |(root, _)| root);
    let url = match query {
        "" => format!("{root}/{name}"),
        query => format!("{root}/{name}?{query}"),
    };
    Some(crate::db::Db::open_postgres(&url).await.unwrap())
}
