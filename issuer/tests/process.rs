#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The `confed-issuer` binary as its operator runs it: a key generated owner-only, a key others
//! can read refused, the service announcing itself (dev attester loudly), answering its
//! directory, and stopping cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

fn issuer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_confed-issuer"))
}

/// The address a started issuer announces on its first line of standard output.
fn serving_address(child: &mut std::process::Child) -> String {
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    line.trim()
        .strip_prefix("confed: serving on http://")
        .unwrap_or_else(|| panic!("{line}"))
        .to_string()
}

fn get(address: &str, path: &str) -> String {
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

#[test]
fn the_issuer_generates_its_key_refuses_a_readable_one_serves_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("token-key.pem");
    let made = issuer().arg("generate-key").arg(&key).output().unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&made.stdout).unwrap();
    assert_eq!(printed["token-type"], 2);
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // A second generate-key into the same file refuses to overwrite it.
    assert!(
        !issuer()
            .arg("generate-key")
            .arg(&key)
            .output()
            .unwrap()
            .status
            .success()
    );

    let args_on = |state: &str, listen: &str| {
        let mut command = issuer();
        command
            .args([
                "--name",
                "issuer.test",
                "--attester",
                "dev",
                "--listen",
                listen,
            ])
            .arg("--signing-key")
            .arg(&key)
            .arg("--state")
            .arg(dir.path().join(state));
        command
    };
    let args = |state: &str| args_on(state, "127.0.0.1:0");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let refused = args("state").output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("chmod 600"));
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();

    // The dev attester lets anyone obtain tokens: never on a network address.
    let networked = args_on("state", "0.0.0.0:0")
        .args(["--tls-cert", "cert.pem", "--tls-key", "key.pem"])
        .output()
        .unwrap();
    assert!(!networked.status.success());
    assert!(
        String::from_utf8_lossy(&networked.stderr).contains("loopback only"),
        "{}",
        String::from_utf8_lossy(&networked.stderr)
    );

    let mut child = args("state")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let address = serving_address(&mut child);
    let directory = get(&address, "/v1/directory");
    assert!(directory.starts_with("HTTP/1.1 200"), "{directory}");
    assert!(directory.contains("\"issuer_name\":\"issuer.test\""));
    assert!(directory.contains(printed["token-key"].as_str().unwrap()));
    assert!(directory.contains("DEV ATTESTER"));
    // SAFETY: kill only sends a signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(stderr.contains("DEV ATTESTER"), "{stderr}");
}

#[test]
fn the_android_attester_needs_its_allow_list_and_status_list_and_then_serves_without_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("token-key.pem");
    assert!(
        issuer()
            .arg("generate-key")
            .arg(&key)
            .output()
            .unwrap()
            .status
            .success()
    );
    let status = dir.path().join("status.json");
    std::fs::write(
        &status,
        br#"{"entries": {"2c8cdddfd5e03bfc": {"status": "REVOKED"}}}"#,
    )
    .unwrap();
    let app = format!("com.example.fl:{}", "5a".repeat(32));
    let command = |extra: &[&str]| {
        let mut command = issuer();
        command
            .args(["--name", "issuer.test", "--listen", "127.0.0.1:0"])
            .args(["--attester", "android-key-attestation"])
            .arg("--signing-key")
            .arg(&key)
            .arg("--state")
            .arg(dir.path().join("state"))
            .args(extra);
        command
    };
    let stderr_of = |extra: &[&str]| {
        let output = command(extra).output().unwrap();
        assert!(!output.status.success());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let status_arg = status.to_str().unwrap();
    assert!(stderr_of(&["--android-app", &app]).contains("--android-status"));
    assert!(stderr_of(&["--android-status", status_arg]).contains("--android-app"));
    assert!(
        stderr_of(&[
            "--android-status",
            status_arg,
            "--android-app",
            "com.example.fl"
        ])
        .contains("PACKAGE:SHA256HEX")
    );
    assert!(
        stderr_of(&[
            "--android-status",
            status_arg,
            "--android-app",
            &app,
            "--window-seconds",
            "1209600"
        ])
        .contains("longer than 7 days")
    );
    let mut dev = issuer();
    dev.args(["--name", "i", "--attester", "dev", "--android-app", &app])
        .arg("--signing-key")
        .arg(&key)
        .arg("--state")
        .arg(dir.path().join("state"));
    let output = dev.output().unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("--attester android-key-attestation"));

    let mut child = command(&["--android-status", status_arg, "--android-app", &app])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let address = serving_address(&mut child);
    let directory = get(&address, "/v1/directory");
    assert!(
        directory.contains("\"attester\":\"android-key-attestation\""),
        "{directory}"
    );
    assert!(!directory.contains("DEV ATTESTER"));
    // SAFETY: kill only sends a signal to the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}
