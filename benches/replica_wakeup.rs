#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! How soon a replica hears of a round that another replica closed, on PostgreSQL (issue 15):
//! two `Db`s on one database stand for two replicas; 200 times, replica A announces a new job
//! as it does after a round's close commits (`Db::announce_job`: its own signal and `NOTIFY
//! confed_jobs`), and the time until replica B's `job_ready()` returns is taken. That is the
//! delay before a worker waiting on B (in process, or a long-polled lease) starts.
//!
//! `CONFED_TEST_DATABASE_URL=postgres://... cargo bench --bench replica_wakeup` (for example
//! with `deploy/local/postgres.sh start DIR 15432`).

use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    let Ok(url) = std::env::var("CONFED_TEST_DATABASE_URL") else {
        println!("replica_wakeup: set CONFED_TEST_DATABASE_URL to a PostgreSQL server; skipped");
        return;
    };
    let a = confed::db::Db::open_postgres(&url)
        .await
        .expect("replica A");
    let b = confed::db::Db::open_postgres(&url)
        .await
        .expect("replica B");
    let mut delays = Vec::new();
    for _ in 0..200 {
        let started = Instant::now();
        a.announce_job().await;
        tokio::time::timeout(Duration::from_secs(5), b.job_ready())
            .await
            .expect("replica B heard of the job");
        delays.push(started.elapsed().as_secs_f64() * 1e3);
        // A's own signal holds a permit nobody waits for here; take it.
        a.job_ready().await;
    }
    delays.sort_by(f64::total_cmp);
    let at = |q: f64| delays[((delays.len() - 1) as f64 * q) as usize];
    println!(
        "replica wake-up over LISTEN/NOTIFY, {} announcements: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        delays.len(),
        at(0.5),
        at(0.99),
        delays[delays.len() - 1]
    );
}
