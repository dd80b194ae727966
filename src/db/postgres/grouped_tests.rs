//! Grouped device reads on a real PostgreSQL server (`CONFED_TEST_DATABASE_URL`, as on the CI's
//! PostgreSQL pass; without it the cases that need one return). A statement is held in flight
//! by an advisory lock the test owns, so which reads wait for the next statement is decided by
//! the test, not by timing.

use std::sync::Arc;

use sqlx::{AnyConnection, Connection};

use super::{Grouped, like};
use crate::db::DbError;
use crate::db::postgres::readers::Readers;

/// The lock a test's statements take (shared) before they read, so a test holding it exclusively
/// keeps its statement in flight: one per test, as the tests run at once on one server.
#[derive(Clone, Copy)]
struct Hold(i64);

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Numbered {
    n: i32,
}

/// Three keys' rows (`a`: one, `b`: two, `boom`: a division by zero), behind `hold`.
fn grouped(url: &str, Hold(hold): Hold) -> Arc<Grouped<Numbered>> {
    Grouped::new(
        Readers::new(url),
        &format!(
            "SELECT (v.n / CASE WHEN v.k = 'boom' THEN 0 ELSE 1 END) AS n \
             FROM (VALUES ('a', 1), ('b', 2), ('b', 3), ('boom', 4)) AS v(k, n) \
             WHERE v.k = k.key AND (SELECT count(*) FROM \
             (SELECT pg_advisory_xact_lock_shared({hold})) AS held) = 1 ORDER BY n"
        ),
    )
}

async fn holder(url: &str, Hold(hold): Hold) -> AnyConnection {
    let mut holder = AnyConnection::connect(url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_lock({hold})"
    )))
    .execute(&mut holder)
    .await
    .unwrap();
    holder
}

async fn release(holder: &mut AnyConnection, Hold(hold): Hold) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_unlock({hold})"
    )))
    .execute(holder)
    .await
    .unwrap();
}

/// Waits (yielding, not sleeping) until a statement waits for the held lock.
async fn until_a_statement_waits(holder: &mut AnyConnection, Hold(hold): Hold) {
    loop {
        // A bigint advisory key below 2^31 is (classid 0, objid key).
        let waiting: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid = 0 AND objid = {hold}"
        )))
        .fetch_one(&mut *holder)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// Waits (yielding) until `count` reads wait for the next statement.
async fn until_waiting(grouped: &Grouped<Numbered>, count: usize) {
    while grouped.lock().reads.len() < count {
        tokio::task::yield_now().await;
    }
}

fn read(
    grouped: &Arc<Grouped<Numbered>>,
    key: &str,
) -> tokio::task::JoinHandle<Result<Vec<Numbered>, DbError>> {
    let (grouped, key) = (Arc::clone(grouped), key.to_string());
    tokio::spawn(async move { grouped.read(key).await })
}

fn ns(rows: Vec<Numbered>) -> Vec<i32> {
    rows.into_iter().map(|row| row.n).collect()
}

/// A grouped reader whose first read (of `a`) is in flight, held by a lock of the test's own.
struct Held {
    grouped: Arc<Grouped<Numbered>>,
    holder: AnyConnection,
    hold: Hold,
    first: tokio::task::JoinHandle<Result<Vec<Numbered>, DbError>>,
}

impl Held {
    async fn start(url: &str, test: i64) -> Self {
        let hold = Hold(0x0c0f_ed60 + test);
        let grouped = grouped(url, hold);
        let mut holder = holder(url, hold).await;
        let first = read(&grouped, "a");
        until_a_statement_waits(&mut holder, hold).await;
        Self {
            grouped,
            holder,
            hold,
            first,
        }
    }

    /// Lets the first statement finish once `waiting` reads wait for the next one, and checks
    /// the first read's answer.
    async fn release_when_waiting(mut self, waiting: usize) -> Arc<Grouped<Numbered>> {
        until_waiting(&self.grouped, waiting).await;
        release(&mut self.holder, self.hold).await;
        assert_eq!(ns(self.first.await.unwrap().unwrap()), [1]);
        self.grouped
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_that_arrive_during_a_statement_share_the_next_and_each_gets_its_own_rows() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let held = Held::start(&url, 1).await;
    let later = ["b", "a", "missing", "b"].map(|key| read(&held.grouped, key));
    let grouped = held.release_when_waiting(4).await;

    let mut answers = Vec::new();
    for read in later {
        answers.push(ns(read.await.unwrap().unwrap()));
    }
    assert_eq!(
        answers,
        [vec![2, 3], vec![1], vec![], vec![2, 3]],
        "each read gets its own key's rows, and a key read twice gets them twice"
    );
    assert_eq!(
        grouped.statements_run(),
        2,
        "the four reads that waited shared one statement"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_read_fails_fails_only_its_own_reads_not_the_rest_of_its_group() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let held = Held::start(&url, 2).await;
    let group = ["a", "boom", "b", "boom"].map(|key| read(&held.grouped, key));
    let grouped = held.release_when_waiting(4).await;

    let [a, boom, b, boom_again] = group;
    assert_eq!(ns(a.await.unwrap().unwrap()), [1]);
    assert_eq!(ns(b.await.unwrap().unwrap()), [2, 3]);
    for failed in [boom, boom_again] {
        let error = failed.await.unwrap().unwrap_err();
        assert!(
            error.to_string().contains("division by zero"),
            "each read of the failing key says why: {error}"
        );
        assert!(!error.is_unavailable(), "a fault, not an outage: {error}");
    }
    assert_eq!(
        grouped.statements_run(),
        5,
        "the first, the group's, then each of its three keys alone"
    );
    assert_eq!(ns(grouped.read("b".into()).await.unwrap()), [2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_whose_caller_goes_away_leaves_the_others_of_its_group_answered() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let held = Held::start(&url, 3).await;
    let gone = read(&held.grouped, "b");
    let kept = read(&held.grouped, "b");
    until_waiting(&held.grouped, 2).await;
    gone.abort();
    let grouped = held.release_when_waiting(2).await;

    assert_eq!(ns(kept.await.unwrap().unwrap()), [2, 3]);
    assert_eq!(ns(grouped.read("a".into()).await.unwrap()), [1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_reads_than_a_statement_takes_are_split_and_all_answered() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let held = Held::start(&url, 4).await;
    let count = super::MAX_GROUP + 3;
    let many: Vec<_> = (0..count)
        .map(|i| read(&held.grouped, ["a", "b", "missing"][i % 3]))
        .collect();
    let grouped = held.release_when_waiting(count).await;

    for (i, read) in many.into_iter().enumerate() {
        let expected: &[i32] = [&[1][..], &[2, 3][..], &[][..]][i % 3];
        assert_eq!(ns(read.await.unwrap().unwrap()), expected, "read {i}");
    }
    assert_eq!(grouped.statements_run(), 3, "one, then MAX_GROUP, then 3");
}

#[test]
fn an_error_shared_with_the_group_keeps_its_class() {
    let outage = DbError::Sqlx(sqlx::Error::PoolTimedOut);
    assert!(like(&outage).is_unavailable());
    let fault = DbError::Sqlx(sqlx::Error::RowNotFound);
    assert!(!like(&fault).is_unavailable());
    assert!(
        like(&fault)
            .to_string()
            .contains(&sqlx::Error::RowNotFound.to_string())
    );
}

/// The clock is paused after the warm-up read (which opens the connection), so the two seconds
/// pass when nothing else can run: while the held statement waits for the lock.
#[tokio::test(flavor = "current_thread")]
async fn a_read_that_cannot_join_a_statement_in_time_is_refused_as_a_busy_pool_refuses() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let hold = Hold(0x0c0f_ed60 + 5);
    let grouped = grouped(&url, hold);
    assert_eq!(ns(grouped.read("a".into()).await.unwrap()), [1]);
    let mut holder = holder(&url, hold).await;
    tokio::time::pause();
    let first = read(&grouped, "a");
    until_a_statement_waits(&mut holder, hold).await;
    let late = read(&grouped, "b");
    until_waiting(&grouped, 1).await;

    // Ten (paused) seconds: without the refusal it would wait for the held statement.
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), late)
        .await
        .expect("refused at ACQUIRE_TIMEOUT, not left waiting")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(refused, DbError::Sqlx(sqlx::Error::PoolTimedOut)),
        "{refused}"
    );
    assert!(refused.is_unavailable(), "503 with Retry-After");
    assert_eq!(grouped.lock().reads.len(), 0, "it no longer waits");
    release(&mut holder, hold).await;
    assert_eq!(
        ns(first.await.unwrap().unwrap()),
        [1],
        "the read already in a statement is answered however long it took"
    );
}
