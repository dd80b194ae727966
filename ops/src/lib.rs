//! What every confed process shows its operator, the same way in each (`confed serve`, the key
//! services, the token issuer, `confed-enclave`):
//!
//! - `metrics`: the Prometheus recorder, `confed_build_info` and the standard process metrics;
//! - `listener`: `/metrics`, `/healthz` and `/readyz` on a listener of its own, for a process
//!   that serves no HTTP otherwise (an enclave worker);
//! - `logs`: text on a terminal (colours only there), or JSON lines (`CONFED_LOG_FORMAT=json`).
//!
//! It links no role's code and no web framework: the enclave image carries it.

#![forbid(unsafe_code)]

pub mod listener;
pub mod logs;
pub mod metrics;

pub use listener::{ListenerError, Readiness, bind_ops, serve_ops};
pub use logs::{LogFormat, LogsError, init_logs};
pub use metrics::{BuildInfo, install, record_readiness, render};
