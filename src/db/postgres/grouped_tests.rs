//! Grouped device reads on a real PostgreSQL server (`CONFED_TEST_DATABASE_URL`, as on the CI's
//! PostgreSQL pass; without it the cases that need one return). A statement is held in flight
//! by an advisory lock the test owns, so which reads wait for the next statement is decided by
//! the test, not by timing.

use std::sync::Arc;

use sqlx::{AnyConnection, Connection};

use super::{Grouped, may_be_one_keys};
use crate::db::DbError;
use crate::db::postgres::readers::Readers;

/// The lock a test's statements take (shared) before they read, so a test holding it exclusively
/// keeps its statement in flight: one per test and process, as tests run at once on one server.
#[derive(Clone, Copy)]
struct Hold(i64);

impl Hold {
    fn for_test(test: i64) -> Self {
        // Below 2^31 (a process id is below 2^22), so the key is (classid 0, objid key).
        Self((i64::from(std::process::id()) << 8) + test)
    }
}

/// How long the helpers below wait for what the test set up before they fail it.
const SETUP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

fn check_deadline(since: std::time::Instant, what: &str) {
    assert!(
        since.elapsed() < SETUP_DEADLINE,
        "gave up waiting for {what}"
    );
}

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
struct Numbered {
    n: i32,
}

/// Three keys' rows (`a`: one, `b`: two, `boom`: a division by zero), behind `hold`.
fn grouped(url: &str, hold: Hold) -> Arc<Grouped<Numbered>> {
    grouped_from(
        url,
        hold,
        "(SELECT (v.n / CASE WHEN v.k = 'boom' THEN 0 ELSE 1 END) AS n, v.k \
         FROM (VALUES ('a', 1), ('b', 2), ('b', 3), ('boom', 4)) AS v(k, n)) AS v",
    )
}

/// Rows `(k, n)` of `rows` (a table or a subquery with its alias `v`) by key, behind `hold`.
fn grouped_from(url: &str, Hold(hold): Hold, rows: &str) -> Arc<Grouped<Numbered>> {
    Grouped::new(
        "test",
        Readers::new(url, 1),
        &format!(
            "SELECT v.n FROM {rows} WHERE v.k = grouped_keys.key AND (SELECT count(*) FROM \
             (SELECT pg_advisory_xact_lock_shared({hold})) AS held) = 1 ORDER BY v.n"
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
    let since = std::time::Instant::now();
    loop {
        check_deadline(since, "a statement to wait for the held lock");
        let waiting: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND classid = 0 AND objid = {hold} AND database = \
             (SELECT oid FROM pg_database WHERE datname = current_database())"
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
    let since = std::time::Instant::now();
    while grouped.lock().reads.len() < count {
        check_deadline(since, "reads to wait for the next statement");
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
        let hold = Hold::for_test(test);
        Self::start_with(url, hold, grouped(url, hold)).await
    }

    async fn start_with(url: &str, hold: Hold, grouped: Arc<Grouped<Numbered>>) -> Self {
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
    let mut held = Held::start(&url, 3).await;
    let gone = read(&held.grouped, "b");
    let kept = read(&held.grouped, "b");
    until_waiting(&held.grouped, 2).await;
    gone.abort();
    held.first.abort();
    release(&mut held.holder, held.hold).await;

    assert_eq!(ns(kept.await.unwrap().unwrap()), [2, 3]);
    assert_eq!(
        held.grouped.statements_run(),
        2,
        "the statement of the read that went away ran on, and the next one was the group's"
    );
    assert_eq!(ns(held.grouped.read("a".into()).await.unwrap()), [1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_sees_every_write_committed_before_it_arrived_while_a_statement_runs() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let hold = Hold::for_test(6);
    let table = format!("grouped_reads_{}", hold.0);
    let mut setup = AnyConnection::connect(&url).await.unwrap();
    for statement in [
        format!("DROP TABLE IF EXISTS {table}"),
        format!("CREATE TABLE {table} (k TEXT PRIMARY KEY, n INTEGER NOT NULL)"),
        format!("INSERT INTO {table} VALUES ('a', 1)"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut setup)
            .await
            .unwrap();
    }
    let grouped = grouped_from(&url, hold, &format!("{table} AS v"));
    let held = Held::start_with(&url, hold, grouped).await;
    // Committed after the held statement took its snapshot, before the next read arrives.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} VALUES ('c', 7)"
    )))
    .execute(&mut setup)
    .await
    .unwrap();
    let c = read(&held.grouped, "c");
    held.release_when_waiting(1).await;

    assert_eq!(ns(c.await.unwrap().unwrap()), [7]);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&mut setup)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_reads_than_a_statement_takes_are_split_and_all_answered() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let held = Held::start(&url, 4).await;
    // MAX_GROUP + 3 distinct keys, `a` and `b` among them, and `a` read again after each:
    // reads of a key already in the group do not count against its size.
    let keys: Vec<String> = ["a".to_string(), "b".to_string()]
        .into_iter()
        .chain((0..super::MAX_GROUP + 1).map(|i| format!("missing-{i}")))
        .flat_map(|key| [key, "a".to_string()])
        .collect();
    let many: Vec<_> = keys.iter().map(|key| read(&held.grouped, key)).collect();
    let grouped = held.release_when_waiting(keys.len()).await;

    for (key, read) in keys.iter().zip(many) {
        let expected: &[i32] = match key.as_str() {
            "a" => &[1],
            "b" => &[2, 3],
            _ => &[],
        };
        assert_eq!(ns(read.await.unwrap().unwrap()), expected, "read of {key}");
    }
    assert_eq!(
        grouped.statements_run(),
        3,
        "the first, then MAX_GROUP keys, then the last 3"
    );
}

/// The clock is paused once the first statement waits for the held lock (its connection opened
/// and its statement sent), so the two seconds pass when nothing else can run.
#[tokio::test(flavor = "current_thread")]
async fn a_read_that_cannot_join_a_statement_in_time_is_refused_as_a_busy_pool_refuses() {
    let Some(url) = super::super::test_server() else {
        return;
    };
    let mut held = Held::start(&url, 5).await;
    tokio::time::pause();
    let late = read(&held.grouped, "b");
    until_waiting(&held.grouped, 1).await;

    // Ten (paused) seconds: without the refusal it would wait for the held statement.
    let refused = tokio::time::timeout(std::time::Duration::from_secs(10), late)
        .await
        .expect("refused at ACQUIRE_TIMEOUT, not left waiting")
        .unwrap()
        .unwrap_err();
    // Before any other wait, so the held statement's own timeout does not pass in paused time.
    tokio::time::resume();
    assert!(
        matches!(refused, DbError::Sqlx(sqlx::Error::PoolTimedOut)),
        "{refused}"
    );
    assert!(refused.is_unavailable(), "503 with Retry-After");
    assert_eq!(held.grouped.lock().reads.len(), 0, "it no longer waits");
    release(&mut held.holder, held.hold).await;
    assert_eq!(
        ns(held.first.await.unwrap().unwrap()),
        [1],
        "the read already in a statement is answered however long it waited"
    );
}

#[test]
fn only_a_failure_one_key_could_cause_is_read_again_key_by_key() {
    let decode = DbError::Sqlx(sqlx::Error::Decode("not text".into()));
    assert!(may_be_one_keys(&decode));
    for not_a_key in [
        DbError::Sqlx(sqlx::Error::PoolTimedOut),
        DbError::Sqlx(sqlx::Error::Io(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        ))),
        DbError::Sqlx(sqlx::Error::Protocol("unexpected message".into())),
    ] {
        assert!(
            !may_be_one_keys(&not_a_key),
            "{not_a_key}: the group fails at once"
        );
    }
}
