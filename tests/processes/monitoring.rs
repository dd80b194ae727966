//! The shipped monitoring (deploy/monitoring/) against a real Prometheus scraping every process of
//! the local cluster: each target answers /metrics, the alert rules load and evaluate without
//! error, and every metric the rules and the dashboard name is exported. A renamed metric fails
//! here. Runs when `CONFED_TEST_PROMETHEUS` names a `prometheus` binary (`.ci/run` installs
//! Debian's); otherwise says so and passes.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): its check runs inside local_cluster's pass (on
//! PostgreSQL); its own test reads files.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

const BOUND: Duration = Duration::from_secs(90);

/// Every metric name in `text`: the words that start like confed's, the HTTP or the process
/// metrics (alert expressions and dashboard queries; `up` is Prometheus's own).
pub(crate) fn metric_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| {
            ["confed_", "process_", "http_request"]
                .iter()
                .any(|prefix| word.starts_with(prefix))
        })
        .map(str::to_string)
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn api(http: &reqwest::Client, base: &str, path: &str) -> Value {
    http.get(format!("{base}{path}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Scrapes `targets` (host:port, comma-separated) with the shipped rules loaded and checks them.
pub(crate) async fn check_shipped_monitoring(targets: &str) {
    let Some(binary) = std::env::var_os("CONFED_TEST_PROMETHEUS") else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOTE: CONFED_TEST_PROMETHEUS is not set: the alert rules and the dashboard were not \
             checked against a real Prometheus"
        );
        return;
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules = repo.join("deploy/monitoring/alerts.yml");
    let dashboard = repo.join("deploy/monitoring/dashboard.json");
    let dir = tempfile::tempdir().unwrap();
    let targets: Vec<&str> = targets.split(',').collect();
    let config = serde_json::json!({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [rules],
        "scrape_configs": [{"job_name": "confed-local", "static_configs": [{"targets": targets}]}],
    });
    // JSON is YAML: Prometheus reads it as its configuration.
    let config_file = dir.path().join("prometheus.yml");
    std::fs::write(&config_file, config.to_string()).unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _prometheus = tokio::process::Command::new(binary)
        .arg(format!("--config.file={}", config_file.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = confed_protocol::http::client(Duration::from_secs(10));

    // Every process is up, and the rules evaluated (none in error).
    let (up, evaluated) = tokio::time::timeout(BOUND, async {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let Ok(reply) = http.get(format!("{base}/api/v1/targets")).send().await else {
                continue;
            };
            let found: Value = reply.json().await.unwrap();
            let active = found["data"]["activeTargets"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let rules = api(&http, &base, "/api/v1/rules").await;
            let evaluated: Vec<Value> = rules["data"]["groups"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            let settled = active.len() == targets.len()
                && active.iter().all(|t| t["health"] != "unknown")
                && !evaluated.is_empty()
                && evaluated.iter().all(|r| r["health"] != "unknown");
            if settled {
                return (active, evaluated);
            }
        }
    })
    .await
    .expect("Prometheus scraped every target and evaluated every rule");
    let down: Vec<String> = up
        .iter()
        .filter(|t| t["health"] != "up")
        .map(|t| format!("{}: {}", t["scrapeUrl"], t["lastError"]))
        .collect();
    assert!(down.is_empty(), "targets not up: {down:?}");
    let broken: Vec<String> = evaluated
        .iter()
        .filter(|r| r["health"] != "ok")
        .map(|r| format!("{}: {}", r["name"], r["lastError"]))
        .collect();
    assert!(broken.is_empty(), "rules in error: {broken:?}");
    let shipped = metric_names(&std::fs::read_to_string(&rules).unwrap());
    assert!(
        shipped.len() > 15,
        "the rules name the metrics: {shipped:?}"
    );
    let mut named = shipped;
    named.extend(metric_names(&std::fs::read_to_string(&dashboard).unwrap()));

    // Every metric they name is exported by some process.
    let mut missing = Vec::new();
    for name in &named {
        let query = format!("count({{__name__=\"{name}\"}})");
        let found: Value = http
            .get(format!("{base}/api/v1/query"))
            .query(&[("query", query.as_str())])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if found["data"]["result"].as_array().is_none_or(Vec::is_empty) {
            missing.push(name.clone());
        }
    }
    assert!(
        missing.is_empty(),
        "metrics the rules or the dashboard name that no process exports: {missing:?}"
    );
    // Each kind of process says which it is.
    let info = api(&http, &base, "/api/v1/query?query=confed_build_info").await;
    let processes: BTreeSet<&str> = info["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["metric"]["process"].as_str())
        .collect();
    assert_eq!(
        processes,
        BTreeSet::from([
            "confed",
            "confed-enclave",
            "confed-issuer",
            "confed-keyservice"
        ]),
    );
}

#[test]
fn metric_names_are_read_from_rules_and_queries() {
    let names = metric_names(
        "expr: increase(confed_disk_full_total[5m]) > 0 and up{job=~\"confed.*\"}\n\
         \"expr\": \"histogram_quantile(0.99, rate(http_request_duration_seconds_bucket[5m]))\"",
    );
    assert_eq!(
        names,
        BTreeSet::from([
            "confed_disk_full_total".to_string(),
            "http_request_duration_seconds_bucket".to_string()
        ])
    );
}
