#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The `confed-enclave` binary's command line: help works, and missing or bad configuration is
//! a clear error with exit status 1 (never a panic). The job loop it runs is tested over HTTP in
//! the root package (`tests/rounds/worker_api.rs`).

use std::process::Command;

fn enclave(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_confed-enclave"))
        .args(args)
        .env_remove("CONFED_WORKER_TOKEN")
        .env_remove("CONFED_SERVER")
        .env_remove("CONFED_KEYSERVICES")
        .env_remove("CONFED_THRESHOLD")
        .output()
        .unwrap()
}

#[test]
fn help_names_the_attester_choice() {
    let out = enclave(&["--help"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("confidential-space"));
}

#[test]
fn a_missing_worker_token_is_a_clear_error() {
    let out = enclave(&[
        "--server",
        "http://127.0.0.1:9",
        "--keyservice",
        "ks1=http://127.0.0.1:9",
        "--threshold",
        "1",
        "--once",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no worker token"));
}

#[test]
fn a_malformed_keyservice_is_refused() {
    let out = enclave(&[
        "--server",
        "http://x",
        "--keyservice",
        "ks1",
        "--threshold",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not ID=URL"));
}

#[test]
fn the_dev_attester_needs_its_key_file() {
    let out = Command::new(env!("CARGO_BIN_EXE_confed-enclave"))
        .args([
            "--server",
            "http://127.0.0.1:9",
            "--keyservice",
            "ks1=http://127.0.0.1:9",
            "--threshold",
            "1",
            "--attester",
            "dev",
            "--once",
        ])
        .env("CONFED_WORKER_TOKEN", "x".repeat(40))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dev-key"));
}

/// In Confidential Space the command line is fixed by the image; everything comes from the
/// environment the launch policy allows.
#[test]
fn configuration_can_come_from_the_environment() {
    let out = Command::new(env!("CARGO_BIN_EXE_confed-enclave"))
        .arg("--once")
        .env("CONFED_SERVER", "http://127.0.0.1:9")
        .env(
            "CONFED_KEYSERVICES",
            "ks1=http://127.0.0.1:9,ks2=http://127.0.0.1:9",
        )
        .env("CONFED_THRESHOLD", "2")
        .env_remove("CONFED_WORKER_TOKEN")
        .output()
        .unwrap();
    // Parsing succeeded: the first missing piece is the token.
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no worker token"));
}
