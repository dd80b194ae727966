//! The process-wide Prometheus recorder. Every process installs it once, at start, with its build
//! info; `render` adds the process metrics of the moment and renders the text format.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};

/// Which process this is, for `confed_build_info{process, version}`.
#[derive(Debug, Clone, Copy)]
pub struct BuildInfo {
    /// The binary or role: `confed`, `confed-keyservice`, `confed-issuer`, `confed-enclave`.
    pub process: &'static str,
    /// The crate version it was built from (`env!("CARGO_PKG_VERSION")`).
    pub version: &'static str,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// An aggregation job takes from milliseconds (a small round) to minutes (10 GB).
const JOB_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// How often histogram samples are folded into buckets.
const UPKEEP: Duration = Duration::from_secs(5);

struct Installed {
    handle: PrometheusHandle,
    process: metrics_process::Collector,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

/// confed's recorder (its histogram buckets), neither installed nor kept up: what `install`
/// installs globally, and what a test can use alone.
pub fn recorder() -> PrometheusRecorder {
    PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full("http_request_duration_seconds".into()),
            LATENCY_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("confed_enclave_job_seconds".into()),
                JOB_BUCKETS,
            )
        })
        .expect("the bucket lists are non-empty")
        .build_recorder()
}

/// Installs the recorder for the whole process (once: later calls, e.g. an in-process key
/// service of `confed demo`, share the first), records `confed_build_info` and describes the
/// process metrics. Returns the handle that renders.
pub fn install(info: BuildInfo) -> &'static PrometheusHandle {
    &INSTALLED
        .get_or_init(|| {
            let recorder = recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            // Histograms keep every sample until they are folded into their buckets, on a scrape
            // or on upkeep: unscraped, they grew by ~2 MB a minute under load (found by the
            // soak). Fold them every few seconds whether or not anyone scrapes.
            let upkeep = handle.clone();
            let spawned = std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(UPKEEP);
                        upkeep.run_upkeep();
                    }
                });
            if let Err(error) = spawned {
                tracing::warn!(%error, "no metrics upkeep thread; histograms drain only on scrapes");
            }
            metrics::describe_gauge!(
                "confed_build_info",
                "Always 1; the labels say which confed process and version this is"
            );
            metrics::gauge!("confed_build_info", "process" => info.process, "version" => info.version)
                .set(1.0);
            let process = metrics_process::Collector::default();
            process.describe();
            Installed { handle, process }
        })
        .handle
}

/// Sets `confed_ready{role}` (1 or 0) from a readiness check, so that an alert sees what
/// `/readyz` answers (each `/metrics` scrape checks it). The role label keeps apart the services
/// one process may hold (the embedded system's API, key services and issuer).
pub fn record_readiness(role: &'static str, ready: &Result<(), String>) {
    metrics::gauge!("confed_ready", "role" => role).set(if ready.is_ok() { 1.0 } else { 0.0 });
}

/// The Prometheus text of everything recorded, with the process metrics measured now; empty
/// before `install`.
pub fn render() -> String {
    match INSTALLED.get() {
        Some(installed) => {
            installed.process.collect();
            installed.handle.render()
        }
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rendered_text_names_the_process_and_its_resources() {
        install(BuildInfo {
            process: "confed-test",
            version: "9.9.9",
        });
        let text = render();
        assert!(
            text.contains(r#"confed_build_info{process="confed-test",version="9.9.9"} 1"#),
            "{text}"
        );
        for metric in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            assert!(text.contains(&format!("\n{metric} ")), "{metric} in {text}");
        }
    }
}
