//! An analytics task's newest result on its console page (docs/analytics.md): the top keys as
//! bars with their noise (±2 standard deviations) as whiskers, and the quantiles at their ranks.
//! Drawn from the release's bytes as the enclave signed them (the page's "Release proofs"
//! section checks them).

use maud::{Markup, html};
use serde::Deserialize;

use super::error::ConsoleError;
use crate::app::AppState;
use crate::blob::BlobKey;
use crate::db::jobs::ReleaseRecord;

/// Keys drawn, at most.
const TOP_KEYS: usize = 20;
const WIDTH: f64 = 640.0;

#[derive(Deserialize)]
struct Quantile {
    rank: f64,
    value: f64,
}

/// The parts of a `confed-analytics-release/v1` result the page draws.
#[derive(Deserialize)]
struct AnalyticsResult {
    noise_stddev: f64,
    #[serde(default)]
    threshold: Option<u64>,
    #[serde(default)]
    histogram: Option<Vec<i64>>,
    #[serde(default)]
    keys: Option<Vec<(String, i64)>>,
    #[serde(default)]
    quantiles: Option<Vec<Quantile>>,
}

/// The section for the newest release of an analytics task (`None`: not an analytics task).
pub(super) async fn section(
    state: &AppState,
    task: &crate::db::TaskRecord,
    newest: Option<&ReleaseRecord>,
) -> Result<Option<Markup>, ConsoleError> {
    let Some(query) = &task.spec.analytics else {
        return Ok(None);
    };
    let Some(release) = newest else {
        return Ok(Some(html! {
            section aria-labelledby="result-heading" {
                h2 #result-heading { "Result" }
                p { "Query: " code { (query.encode()) } ". No round has released yet." }
            }
        }));
    };
    let key =
        BlobKey::new(release.average_key.clone()).map_err(crate::api::error::ApiError::from)?;
    let bytes = state
        .blobs
        .get(&key)
        .await
        .map_err(crate::api::error::ApiError::from)?;
    let result: Option<AnalyticsResult> = serde_json::from_slice(&bytes).ok();
    Ok(Some(html! {
        section aria-labelledby="result-heading" {
            h2 #result-heading { "Result of round " (release.round_number) }
            p.note {
                "Query: " code { (query.encode()) } ". Every value is noised (discrete Gaussian); the whiskers span ±2 standard deviations."
            }
            @match &result {
                None => p.bad { "The release's result does not parse." },
                Some(result) => (draw(result)),
            }
        }
    }))
}

fn draw(result: &AnalyticsResult) -> Markup {
    let mut top: Vec<(String, i64)> = match (&result.keys, &result.histogram) {
        (Some(keys), _) => keys.clone(),
        (None, Some(values)) => values
            .iter()
            .enumerate()
            .map(|(i, v)| (format!("key {i}"), *v))
            .collect(),
        (None, None) => Vec::new(),
    };
    top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top.truncate(TOP_KEYS);
    html! {
        @if let Some(tau) = result.threshold {
            p #threshold {
                "Keys are released when their noised count of devices is at least " (tau)
                "; the others are not named, nor counted. Released: "
                (result.keys.as_ref().map_or(0, Vec::len)) "."
            }
        }
        @if !top.is_empty() {
            (bars(&top, result.noise_stddev))
        }
        @if let Some(quantiles) = &result.quantiles {
            table #quantiles {
                thead { tr { th { "rank" } th { "value" } } }
                tbody {
                    @for q in quantiles {
                        tr { td { (q.rank) } td { (super::charts::significant(q.value)) } }
                    }
                }
            }
        }
    }
}

/// Horizontal bars of `top` (key, noised value) with ±2 `stddev` whiskers.
fn bars(top: &[(String, i64)], stddev: f64) -> Markup {
    let (bar, gap, left, right) = (16.0, 6.0, 170.0, 80.0);
    let height = top.len() as f64 * (bar + gap) + 12.0;
    let plot_w = WIDTH - left - right;
    let widest = top
        .iter()
        .map(|(_, v)| *v as f64 + 2.0 * stddev)
        .fold(1.0, f64::max);
    let x = |v: f64| left + plot_w * v.clamp(0.0, widest) / widest;
    html! {
        svg.chart #result-chart viewBox={"0 0 " (WIDTH) " " (height)} role="img"
            aria-labelledby="result-title" {
            title #result-title { "The top keys of the newest release, noised" }
            @for (i, (key, value)) in top.iter().enumerate() {
                @let y = 6.0 + i as f64 * (bar + gap);
                @let v = *value as f64;
                text.tick x=(left - 8.0) y=(y + bar - 4.0) text-anchor="end" { (key) }
                rect.stage x=(left) y=(y) width=(x(v) - left) height=(bar)
                    data-key=(key) data-value=(value) {}
                line.whisker x1=(x(v - 2.0 * stddev)) x2=(x(v + 2.0 * stddev))
                    y1=(y + bar / 2.0) y2=(y + bar / 2.0) stroke="currentColor" {}
                text.tick x=(x(v + 2.0 * stddev) + 6.0) y=(y + bar - 4.0) { (value) }
            }
        }
    }
}
