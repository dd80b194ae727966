//! `confed serve --embedded-ports START-END`: the embedded key services listen inside the range
//! (the first free ports, in order), and a range too small for them stops the start with a
//! message that says what to do.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): it checks the embedded key services' ports; no
//! store.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::serving;

const BOUND: Duration = Duration::from_secs(60);

/// `count` consecutive loopback ports that were free a moment ago (bound, then released).
fn free_ports(count: u16) -> u16 {
    'search: loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let start = first.local_addr().unwrap().port();
        if start > u16::MAX - count {
            continue;
        }
        let mut held = vec![first];
        for port in start + 1..start + count {
            match std::net::TcpListener::bind(("127.0.0.1", port)) {
                Ok(listener) => held.push(listener),
                Err(_) => continue 'search,
            }
        }
        return start;
    }
}

fn serve(dir: &std::path::Path, range: &str) -> tokio::process::Command {
    let mut command = serving::confed();
    command
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(["--embedded-ports", range]);
    command
}

#[tokio::test]
async fn the_embedded_key_services_listen_inside_the_given_range() {
    let dir = tempfile::tempdir().unwrap();
    let start = free_ports(4);
    let range = format!("{start}-{}", start + 3);
    let mut child = serve(dir.path(), &range)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let listed = tokio::time::timeout(BOUND, async {
        loop {
            let line = lines.next_line().await.unwrap().expect("serve exited");
            if let Some(list) = line.strip_prefix("confed: embedded key services: ") {
                return list.to_string();
            }
        }
    })
    .await
    .unwrap();
    let ports: Vec<u16> = listed
        .split(' ')
        .map(|entry| entry.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(ports, [start, start + 1, start + 2], "{listed}");
    child.kill().await.unwrap();
}

#[tokio::test]
async fn a_range_too_small_for_the_key_services_stops_the_start_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let start = free_ports(2);
    let range = format!("{start}-{}", start + 1);
    let output = tokio::time::timeout(BOUND, serve(dir.path(), &range).output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "no free port on 127.0.0.1 in {range} (all 2 taken); widen --embedded-ports"
        )),
        "{stderr}"
    );
    let malformed = tokio::time::timeout(BOUND, serve(dir.path(), "18090").output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(malformed.status.code(), Some(2), "a usage error");
    assert!(
        String::from_utf8_lossy(&malformed.stderr).contains("give START-END"),
        "{}",
        String::from_utf8_lossy(&malformed.stderr)
    );
}
