//! `confed serve` as a process on a loopback port, with its embedded key services and enclave
//! worker, and the partner calls the process-level tests make of it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// Upper bound for the server to start or a round to complete; only reached if something broke.
pub(crate) const BOUND: Duration = Duration::from_secs(120);

/// Polls until model `version` of `task` exists on the server at `url` (its enclave worker
/// released and applied the round) and returns it.
pub(crate) async fn wait_for_model(url: &str, token: &str, task: &str, version: u32) -> Vec<u8> {
    let http = confed_protocol::http::client(BOUND);
    tokio::time::timeout(BOUND, async {
        loop {
            let reply = http
                .get(format!("{url}/v1/tasks/{task}/models/{version}"))
                .bearer_auth(token)
                .send()
                .await
                .unwrap();
            if reply.status() == 200 {
                return reply.bytes().await.unwrap().to_vec();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the round was aggregated")
}

/// Simulated training devices `first..first + devices` of `population` (seed 7, the trust file
/// at `trust`), one contribution each, short retry waits, no state kept on disk.
pub(crate) fn simulated_devices(
    url: &str,
    population: &str,
    trust: &Path,
    devices: usize,
    first: u64,
    rows: usize,
) -> confed::tools::simulate::SimulationConfig {
    confed::tools::simulate::SimulationConfig {
        server: url.to_string(),
        population: population.into(),
        devices,
        first_device: first,
        concurrency: 4,
        rounds: 1,
        trust: confed_device::load_trust(trust).unwrap(),
        train: true,
        seed: 7,
        rows_per_device: rows,
        max_retry_wait: Duration::from_millis(20),
        idle_limit: 50,
        client_version: "1.0.0".into(),
        progress: false,
        bars: None,
        state_dir: None,
        analytics: None,
    }
}

pub(crate) struct Server {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    pub url: String,
    /// The demo tenant's token (printed on the first start).
    pub token: String,
    pub data: PathBuf,
    http: reqwest::Client,
}

impl Server {
    /// Starts `confed serve` on a new data directory `data`.
    pub(crate) async fn start(data: &Path) -> Self {
        let mut command = super::serving::confed();
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data);
        let started = super::serving::serving(command, BOUND).await;
        Self {
            child: started.child,
            lines: started.lines,
            url: started.url,
            token: started.demo_token.expect("a new data directory's token"),
            data: data.to_path_buf(),
            http: confed_protocol::http::client(BOUND),
        }
    }

    /// The device trust file of the embedded key services.
    pub(crate) fn trust_file(&self) -> PathBuf {
        self.data.join("embedded").join("trust.json")
    }

    pub(crate) async fn get_bytes(&self, path: &str) -> Vec<u8> {
        let reply = self
            .http
            .get(format!("{}{path}", self.url))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200, "GET {path}");
        reply.bytes().await.unwrap().to_vec()
    }

    pub(crate) async fn get(&self, path: &str) -> Value {
        serde_json::from_slice(&self.get_bytes(path).await).unwrap()
    }

    /// Creates a task of `spec` (with the tests' fast upload window unless it names one) and
    /// uploads `model` as version 0 (the task opens); its id.
    pub(crate) async fn open_task(&self, spec: Value, model: Vec<u8>) -> String {
        let created = self
            .http
            .post(format!("{}/v1/tasks", self.url))
            .bearer_auth(&self.token)
            .json(&super::with_fast_window(spec))
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 201, "{}", created.text().await.unwrap());
        let id = created.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let put = self
            .http
            .put(format!("{}/v1/tasks/{id}/model", self.url))
            .bearer_auth(&self.token)
            .body(model)
            .send()
            .await
            .unwrap();
        assert_eq!(put.status(), 201, "{}", put.text().await.unwrap());
        id
    }

    /// Polls until model `version` of `task` exists and returns it (`wait_for_model`).
    pub(crate) async fn wait_for_model(&self, task: &str, version: u32) -> Vec<u8> {
        wait_for_model(&self.url, &self.token, task, version).await
    }

    /// SIGTERM, then waits for a clean exit.
    pub(crate) async fn stop(mut self) {
        let pid = self.child.id().unwrap().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().await;
        assert!(killed.unwrap().success());
        while let Ok(Some(_)) = self.lines.next_line().await {}
        let status = tokio::time::timeout(BOUND, self.child.wait()).await;
        assert!(status.unwrap().unwrap().success());
    }
}
