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
