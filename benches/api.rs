#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Partner API load figures (run with `cargo bench --bench api`): a real server on loopback over a
//! SQLite database in a temp directory, driven by concurrent HTTP clients. Bounded in count; prints
//! throughput and latency percentiles per operation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

const CLIENTS: usize = 16;

async fn run<F, Fut>(label: &str, total: usize, op: F)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..CLIENTS {
        let op = op.clone();
        workers.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            for i in (worker..total).step_by(CLIENTS) {
                let t = Instant::now();
                op(i).await;
                latencies.push(t.elapsed());
            }
            latencies
        }));
    }
    let mut latencies: Vec<Duration> = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.unwrap());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let pct = |p: usize| {
        latencies[(latencies.len() * p / 100).min(latencies.len() - 1)].as_secs_f64() * 1e3
    };
    println!(
        "{label:<40} {:>8.0} req/s   p50 {:>6.2} ms   p99 {:>6.2} ms   ({total} requests, {CLIENTS} clients)",
        total as f64 / elapsed.as_secs_f64(),
        pct(50),
        pct(99)
    );
}

mod support;

#[tokio::main]
async fn main() {
    let server = support::start(Default::default()).await;
    let token = Arc::new(server.token.clone());
    let base = Arc::new(server.base.clone());
    let client = confed_protocol::http::client(Duration::from_secs(30));
    let body = Arc::new(json!({
        "population": "bench", "rounds": 10, "report_goal": 100,
        "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
    }));

    let create = {
        let (client, base, token, body) =
            (client.clone(), base.clone(), token.clone(), body.clone());
        move |_| {
            let (client, base, token, body) =
                (client.clone(), base.clone(), token.clone(), body.clone());
            async move {
                let r = client
                    .post(format!("{base}/v1/tasks"))
                    .bearer_auth(&*token)
                    .json(&*body)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 201);
            }
        }
    };
    run("POST /v1/tasks (quota check + insert)", 2000, create).await;

    let first: serde_json::Value = client
        .get(format!("{base}/v1/tasks?limit=1"))
        .bearer_auth(&*token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = Arc::new(first["tasks"][0]["id"].as_str().unwrap().to_string());
    let get = {
        let (client, base, token, id) = (client.clone(), base.clone(), token.clone(), id.clone());
        move |_| {
            let (client, base, token, id) =
                (client.clone(), base.clone(), token.clone(), id.clone());
            async move {
                let r = client
                    .get(format!("{base}/v1/tasks/{id}"))
                    .bearer_auth(&*token)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }
    };
    run("GET /v1/tasks/{id} (auth + read)", 10_000, get).await;

    let list = {
        let (client, base, token) = (client.clone(), base.clone(), token.clone());
        move |_| {
            let (client, base, token) = (client.clone(), base.clone(), token.clone());
            async move {
                let r = client
                    .get(format!("{base}/v1/tasks?limit=20"))
                    .bearer_auth(&*token)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }
    };
    run("GET /v1/tasks?limit=20 (page of 2000)", 5_000, list).await;

    let unauthorized = {
        let (client, base) = (client.clone(), base.clone());
        move |_| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let r = client
                    .get(format!("{base}/v1/tasks"))
                    .bearer_auth("cft_0123456789abcdef_wrong")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 401);
            }
        }
    };
    run("GET /v1/tasks, wrong token (401)", 10_000, unauthorized).await;

    // A cancelled task: its failure_reason is read from the state history (issue 31).
    let cancelled = client
        .post(format!("{base}/v1/tasks/{id}/cancel"))
        .bearer_auth(&*token)
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), 200);
    let get_cancelled = {
        let (client, base, token, id) = (client.clone(), base.clone(), token.clone(), id.clone());
        move |_| {
            let (client, base, token, id) =
                (client.clone(), base.clone(), token.clone(), id.clone());
            async move {
                let r = client
                    .get(format!("{base}/v1/tasks/{id}"))
                    .bearer_auth(&*token)
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                let task: serde_json::Value = r.json().await.unwrap();
                assert_eq!(task["failure_reason"], "cancelled by partner");
            }
        }
    };
    run(
        "GET /v1/tasks/{id} of a cancelled task (+ failure_reason)",
        10_000,
        get_cancelled,
    )
    .await;

    // A Prometheus scrape: database gauges, readiness and the process metrics.
    let scrape = {
        let (client, base) = (client.clone(), base.clone());
        move |_| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let r = client.get(format!("{base}/metrics")).send().await.unwrap();
                assert_eq!(r.status(), 200);
            }
        }
    };
    run("GET /metrics (a scrape)", 1_000, scrape).await;
}
