#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! A job's listing (`Db::job_contributions`: a round's completed contributions, read in pages of
//! 10,000 by ref), what every lease of a round's job reads first, for rounds of 1,000, 10,000 and
//! 100,000 contributions: on SQLite, and with `CONFED_BENCH_DATABASE_URL=postgres://...` on a
//! fresh database of that PostgreSQL server, as a superuser (`deploy/local/postgres.sh start DIR
//! PORT` gives one).
//! `cargo bench --bench listing` prints the first read and the best and median of five more.
//!
//! The rows are written straight into `assignments` by a connection with foreign keys off (no
//! task or round rows): what is measured is the listing, not how its rows got there. Each round
//! also has a tenth as many assignments in other states, and another round as many rows again.

use std::time::{Duration, Instant};

use confed::db::Db;

// Only its fresh PostgreSQL database is used here.
#[allow(dead_code)]
mod support;

const SIZES: [usize; 3] = [1_000, 10_000, 100_000];

/// One assignment row: ref, round, state, blob key, BLAKE3 (hex), the shape devices leave.
struct Row {
    id: String,
    round: String,
    state: &'static str,
    blob_key: Option<String>,
    blake3: Option<String>,
}

fn hex64() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// `completed` completed contributions of a new round, a tenth as many assigned ones beside them
/// and as many rows of another round; returns the round's id and the rows.
fn round_rows(completed: usize) -> (String, Vec<Row>) {
    let round = uuid::Uuid::new_v4().to_string();
    let other = uuid::Uuid::new_v4().to_string();
    let tenant_and_task = format!(
        "{}/{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let mut rows = Vec::with_capacity(completed * 2 + completed / 10);
    for (index, (round, state)) in std::iter::repeat_n((&round, "COMPLETED"), completed)
        .chain(std::iter::repeat_n((&round, "ASSIGNED"), completed / 10))
        .chain(std::iter::repeat_n((&other, "COMPLETED"), completed))
        .enumerate()
    {
        let id = hex64();
        let done = state == "COMPLETED";
        rows.push(Row {
            blob_key: done.then(|| {
                format!("contributions/{tenant_and_task}/{round}/1/{index:08}/{id}.sealed")
            }),
            blake3: done.then(hex64),
            id,
            round: round.clone(),
            state,
        });
    }
    (round, rows)
}

fn sql_text(value: &Option<String>) -> String {
    // The bench's own hex, digits and separators: nothing to escape.
    value.as_ref().map_or("NULL".into(), |v| format!("'{v}'"))
}

/// The rows as multi-row INSERTs of 1,000 (both engines take this SQL).
fn inserts(rows: &[Row]) -> Vec<String> {
    rows.chunks(1_000)
        .map(|chunk| {
            let values: Vec<String> = chunk
                .iter()
                .map(|r| {
                    format!(
                        "('{}', '{}', '{}', 0, 0, 0, {}, {})",
                        r.id,
                        r.round,
                        r.state,
                        sql_text(&r.blob_key),
                        sql_text(&r.blake3)
                    )
                })
                .collect();
            format!(
                "INSERT INTO assignments (id, round_id, state, expires_at, created_at, updated_at, \
                 blob_key, contribution_blake3) VALUES {}",
                values.join(", ")
            )
        })
        .collect()
}

/// The first listing of `round` (cold), then five more: (first, best, median).
async fn timed(db: &Db, round: &str, expected: usize) -> (Duration, Duration, Duration) {
    let mut times = Vec::new();
    for _ in 0..6 {
        let started = Instant::now();
        let listed = db.job_contributions(round).await.unwrap();
        times.push(started.elapsed());
        assert_eq!(
            listed.len(),
            expected,
            "the listing lists every contribution"
        );
        assert!(
            listed
                .windows(2)
                .all(|pair| pair[0].assignment_ref < pair[1].assignment_ref),
            "each once, in order"
        );
    }
    let first = times.remove(0);
    times.sort();
    (first, times[0], times[times.len() / 2])
}

fn print(engine: &str, size: usize, (first, best, median): (Duration, Duration, Duration)) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "listing, {engine}, {size} contributions: first {:.1} ms, best {:.1} ms, median {:.1} ms ({:.0} contributions/s at the median)",
        ms(first),
        ms(best),
        ms(median),
        size as f64 / median.as_secs_f64()
    );
}

async fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("confed.db");
    let db = Db::open_sqlite(&path).await.unwrap();
    for size in SIZES {
        let (round, rows) = round_rows(size);
        {
            let mut writer = rusqlite::Connection::open(&path).unwrap();
            writer.busy_timeout(Duration::from_secs(10)).unwrap();
            // No task or round rows: foreign keys off for this connection.
            writer.execute_batch("PRAGMA foreign_keys = OFF").unwrap();
            let tx = writer.transaction().unwrap();
            for insert in inserts(&rows) {
                tx.execute_batch(&insert).unwrap();
            }
            tx.commit().unwrap();
        }
        print("SQLite", size, timed(&db, &round, size).await);
    }
}

async fn postgres(server: &str) {
    use sqlx::Connection as _;
    let (url, name) = support::fresh_database(server).await;
    let db = Db::open_postgres(&url).await.unwrap();
    let mut writer = sqlx::AnyConnection::connect(&url).await.unwrap();
    // No task or round rows: the foreign keys' triggers off for this connection (superuser).
    sqlx::raw_sql("SET session_replication_role = replica")
        .execute(&mut writer)
        .await
        .unwrap();
    for size in SIZES {
        let (round, rows) = round_rows(size);
        for insert in inserts(&rows) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(insert))
                .execute(&mut writer)
                .await
                .unwrap();
        }
        sqlx::raw_sql("ANALYZE assignments")
            .execute(&mut writer)
            .await
            .unwrap();
        print("PostgreSQL", size, timed(&db, &round, size).await);
    }
    writer.close().await.ok();
    drop(db);
    support::drop_database(server, &name).await;
}

#[tokio::main]
async fn main() {
    sqlite().await;
    if let Ok(server) = std::env::var("CONFED_BENCH_DATABASE_URL") {
        postgres(&server).await;
    }
}
