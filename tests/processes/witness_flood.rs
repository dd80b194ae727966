//! A compromised peer floods a key service process with pushes of its own head far ahead (issue
//! 47): before, every push fetched and held its own copy of the records in between (16
//! concurrent pushes of a head 4,096 records ahead took a key service from 16 to 313 MB). Now
//! one verification of a peer runs at a time, one page of records (at most 1 MB) in memory, and
//! the pushes that arrive meanwhile are answered at once: the process's peak memory stays under
//! `PEAK_BOUND` above where it started, for 16 and for 64 concurrent pushes.
//!
//! The key service under test is a real `confed keyservice` process (or, to measure another
//! build, the `confed-keyservice` binary named by `CONFED_TEST_KEYSERVICE_BIN`); its peer is a
//! key service in this process whose log it writes itself, as a compromised operator would:
//! 4,096 records of 2 KiB each, all chained and signed, so the honest side has every reason to
//! fetch and verify them.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key service processes only; no task database or
//! blob store.

use crate::common;

use std::time::Duration;

use common::keyservices::{Behaviour, START, World, serve};
use common::serving::{confed, serving};
use confed::keyservice::KeyService;
use confed::keyservice::audit::{Decision, SignedHead};

const BOUND: Duration = Duration::from_secs(60);
/// How far ahead each flood's head is: as far as one call of a witness follows (the issue's
/// 4,096: what the code before the fix fetched in full for every push).
const AHEAD: usize = 4_096;
/// What a compromised peer may cost an honest key service at the peak of a flood, in MiB above
/// its resident memory before the flood: one page of records and its parse, and the buffers of
/// up to 64 connections (measured: 0 MiB for 16 pushes, 3 for 64). The code before the fix,
/// measured with this test in the same debug build: 36 MiB for 16 pushes, 593 for 64.
const PEAK_BOUND_MIB: u64 = 16;

/// `VmRSS` and `VmHWM` (peak) of process `pid`, in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in /proc/{pid}/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the process's peak (`VmHWM`) to its current resident memory.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// Appends `count` refusal records of about 2 KiB each to `peer`'s log and returns its new head.
fn write_far_ahead(peer: &KeyService, count: usize) -> SignedHead {
    let mut guard = peer.audit.lock().unwrap();
    let padding = "x".repeat(2_000);
    for i in 0..count {
        guard
            .0
            .append(Decision::note(
                START,
                &peer.id,
                "refused",
                format!("{i} {padding}"),
            ))
            .unwrap();
    }
    guard.0.signed_head(&peer.id)
}

/// The key service process under test, with `peer_url` as its one peer `ks2`.
async fn start_key_service(world: &World, peer_url: &str) -> (tokio::process::Child, String) {
    let dir = world.dir.path();
    let peers = serde_json::json!({"peers": [{
        "id": "ks2",
        "url": peer_url,
        "verifying_key": confed_attestation::exchange::encode_verifying_key(
            world.signing_key(2).verifying_key()),
    }]});
    std::fs::write(dir.join("peers.json"), peers.to_string()).unwrap();
    let policy_dir = dir.join("policies");
    std::fs::create_dir_all(&policy_dir).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/policies/dev.toml"),
        policy_dir.join("dev.toml"),
    )
    .unwrap();
    std::fs::write(
        policy_dir.join("dev-attester.jwks.json"),
        world.attester.jwks_json().to_string(),
    )
    .unwrap();
    let share = world.share_files[0].clone();
    // Pulls every second: after a flood, the rest of the way is followed by pulls.
    let mut args: Vec<std::ffi::OsString> = [
        "--id",
        "ks1",
        "--listen",
        "127.0.0.1:0",
        "--witness-pull-seconds",
        "1",
    ]
    .map(Into::into)
    .to_vec();
    for (flag, path) in [
        ("--share", share),
        ("--policy", policy_dir.join("dev.toml")),
        ("--signing-key", dir.join("ks1-signing.pem")),
        ("--audit-log", dir.join("audit-ks1-process.jsonl")),
        ("--peers", dir.join("peers.json")),
    ] {
        args.push(flag.into());
        args.push(path.into());
    }
    let command = match std::env::var_os("CONFED_TEST_KEYSERVICE_BIN") {
        Some(binary) => {
            let mut command = tokio::process::Command::new(binary);
            command.env("RUST_LOG", "warn").kill_on_drop(true);
            command.args(args);
            command
        }
        None => {
            let mut command = confed();
            command.arg("keyservice").args(args);
            command
        }
    };
    let started = serving(command, BOUND).await;
    (started.child, started.url)
}

/// Waits until the key service at `url` witnessed `peer`'s head `head` (or any later one).
async fn witnessed_at_least(url: &str, head: &SignedHead) {
    let http = confed_protocol::http::client(BOUND);
    let reached = tokio::time::timeout(BOUND, async {
        loop {
            let answer = http
                .get(format!("{url}/v1/audit/witnessed/ks2"))
                .send()
                .await
                .unwrap();
            if answer.status() == 200 {
                let kept: serde_json::Value = answer.json().await.unwrap();
                if kept["witnessed"]["records"]
                    .as_u64()
                    .is_some_and(|records| records >= head.records)
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(reached.is_ok(), "the key service never kept ks2's head");
}

/// `pushes` concurrent pushes of `head`; returns how many were answered 200.
async fn flood(url: &str, head: &SignedHead, pushes: usize) -> usize {
    let http = confed_protocol::http::client(BOUND);
    let body = serde_json::to_vec(head).unwrap();
    let mut answers = tokio::task::JoinSet::new();
    for _ in 0..pushes {
        let (http, body, url) = (http.clone(), body.clone(), url.to_string());
        answers.spawn(async move {
            http.post(format!("{url}/v1/audit/witness"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
        });
    }
    let mut ok = 0;
    while let Some(answer) = answers.join_next().await {
        if answer.unwrap().is_ok_and(|status| status == 200) {
            ok += 1;
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floods_of_16_and_64_far_ahead_pushes_keep_the_key_services_memory_bounded() {
    confed_protocol::http::install_crypto_provider();
    let world = World::new(2, 3);
    let peer = world.service(2, Behaviour::Honest, &world.share_files[1..2]);
    let peer_url = serve(confed::keyservice::routes::router(peer.clone())).await;
    let (child, url) = start_key_service(&world, &peer_url).await;
    let pid = child.id().expect("running");
    // It keeps ks2's first head as it is (its first pull, at start).
    let first = peer.audit.lock().unwrap().0.signed_head("ks2");
    witnessed_at_least(&url, &first).await;

    for pushes in [16, 64] {
        let head = write_far_ahead(&peer, AHEAD);
        reset_peak(pid);
        let (before, _) = memory_kib(pid);
        let answered = flood(&url, &head, pushes).await;
        let (after, peak) = memory_kib(pid);
        eprintln!(
            "witness flood: {pushes} concurrent pushes of a head {AHEAD} records (about {} MiB) \
             ahead: resident {} MiB before, peak {} MiB, {} MiB after; {answered} answered 200",
            AHEAD * 2 / 1024,
            before / 1024,
            peak / 1024,
            after / 1024
        );
        assert_eq!(answered, pushes, "every push answered (at once when busy)");
        assert!(
            peak.saturating_sub(before) < PEAK_BOUND_MIB * 1024,
            "{pushes} pushes: peak {peak} KiB from {before} KiB, over the {PEAK_BOUND_MIB} MiB bound"
        );
        // The flood does not stop the honest work: the head is followed to its end.
        witnessed_at_least(&url, &head).await;
    }
}
