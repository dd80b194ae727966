//! A real `confed serve` process for the benchmarks that measure it from outside (`flood`,
//! `round`): the release binary (`cargo build --release` first, or `CONFED_BIN`), started on a
//! free loopback port in a temp data directory, with what it prints on start read back.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

// Each benchmark reads what it needs of a started server.
#[allow(dead_code)]
pub struct Server {
    pub child: Child,
    pub url: String,
    /// The `demo` tenant's token (printed on the first start).
    pub token: String,
    /// The embedded key services' device trust file.
    pub trust: String,
    /// The embedded key services' base URLs.
    pub keyservices: Vec<String>,
    /// Each aggregated round's job time in seconds (`seconds=` of its log line), in order.
    pub jobs: std::sync::mpsc::Receiver<f64>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `confed` binary the benchmark runs: `CONFED_BIN`, else the workspace's release build.
pub fn binary() -> String {
    std::env::var("CONFED_BIN")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/confed").into())
}

/// Starts `confed serve` (the embedded system) and waits until it listens.
pub fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        // Errors, and each aggregated round's line with the time of its steps.
        .env("RUST_LOG", "error,confed::aggregation=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the release binary (cargo build --release) or CONFED_BIN");
    // The server's log goes on to ours; job times are picked out of it on the way.
    let (job_tx, jobs) = std::sync::mpsc::channel();
    let log = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in log.lines().map_while(Result::ok) {
            eprintln!("{line}");
            let seconds = line
                .contains("round aggregated")
                .then(|| {
                    line.split_once(" seconds=")?
                        .1
                        .split(' ')
                        .next()?
                        .parse()
                        .ok()
                })
                .flatten();
            if let Some(seconds) = seconds {
                let _ = job_tx.send(seconds);
            }
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut token, mut trust, mut keyservices) = (String::new(), String::new(), Vec::new());
    let url = loop {
        let line = lines.next().expect("server output").unwrap();
        if let Some(t) = line.strip_prefix("CONFED_DEMO_TOKEN=") {
            token = t.into();
        }
        if let Some((_, path)) = line.split_once("Device trust file: ") {
            trust = path.into();
        }
        if let Some(list) = line.strip_prefix("confed: embedded key services: ") {
            keyservices = list
                .split(' ')
                .filter_map(|e| e.split_once('=').map(|(_, url)| url.to_string()))
                .collect();
        }
        if let Some(url) = line.strip_prefix("confed: serving on ") {
            break url.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        url,
        token,
        trust,
        keyservices,
        jobs,
        _dir: dir,
    }
}
