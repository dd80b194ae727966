//! The device reads' connections on a real PostgreSQL server (`CONFED_TEST_DATABASE_URL`, as on
//! the CI's PostgreSQL pass; without it there is nothing to run on and the case returns).

use std::sync::Arc;

use super::Readers;

/// The backend process id of the connection a read gets.
async fn backend(readers: &Arc<Readers>) -> i32 {
    readers
        .read(|conn| {
            Box::pin(async move {
                sqlx::query_scalar("SELECT pg_backend_pid()")
                    .fetch_one(conn)
                    .await
            })
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_finished_read_returns_its_connection_and_a_failed_one_closes_it() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let readers = Readers::new(&url, 1);
    let first = backend(&readers).await;
    assert_eq!(backend(&readers).await, first, "the connection is reused");
    let failed = readers
        .read(|conn| {
            Box::pin(async move {
                sqlx::query_scalar::<_, i32>("SELECT no_such_column FROM pg_class")
                    .fetch_one(conn)
                    .await
            })
        })
        .await;
    assert!(failed.is_err());
    assert_ne!(
        backend(&readers).await,
        first,
        "a connection whose statement failed is not reused"
    );
}
