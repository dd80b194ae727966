//! Starting a confed process for a test (`confed serve`, `confed keyservice`): spawned with its
//! stdout piped and read until it prints where it serves, remembering the demo tenant's token if
//! a first start prints one. The one copy of this; binaries without the rest of `common` include
//! it alone (`#[path = "common/serving.rs"] mod serving;`).
#![allow(dead_code)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// A started process and the rest of its stdout.
pub(crate) struct Serving {
    pub child: Child,
    pub lines: Lines<BufReader<ChildStdout>>,
    /// What it printed after `confed: serving on `.
    pub url: String,
    /// `CONFED_DEMO_TOKEN=...`, printed by `confed serve` on a new data directory.
    pub demo_token: Option<String>,
}

/// The `confed` binary, quiet (warnings only), killed when its handle drops.
pub(crate) fn confed() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_confed"));
    command.env("RUST_LOG", "warn").kill_on_drop(true);
    command
}

/// Spawns `command` and reads its stdout until it says where it serves, within `bound`.
pub(crate) async fn serving(mut command: Command, bound: Duration) -> Serving {
    let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut demo_token = None;
    let url = tokio::time::timeout(bound, async {
        loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the process exited before serving");
            if let Some(token) = line.strip_prefix("CONFED_DEMO_TOKEN=") {
                demo_token = Some(token.to_string());
            }
            if let Some(url) = line.strip_prefix("confed: serving on ") {
                return url.to_string();
            }
        }
    })
    .await
    .expect("the process did not start serving in time");
    Serving {
        child,
        lines,
        url,
        demo_token,
    }
}
