//! Small hand-written SVG charts, drawn on the server (no script, no plotting dependency for three
//! simple shapes). Each chart has a title and a description for screen readers, and the page shows
//! the same numbers in a table next to it. Points carry `data-*` attributes with their exact
//! values, so tests (and curious partners) read the numbers the chart was drawn from.

use maud::{Markup, html};

const WIDTH: f64 = 640.0;
const LEFT: f64 = 88.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 44.0;

/// A round and the privacy spent through it.
pub(super) struct SpentPoint {
    pub round: i64,
    pub epsilon: f64,
}

/// Ticks at 1, 2 or 5 times a power of ten, about `wanted` of them from 0 to at least `max`.
fn ticks(max: f64, wanted: usize) -> Vec<f64> {
    if !(max.is_finite() && max > 0.0) {
        return vec![0.0, 1.0];
    }
    let raw = max / wanted.max(1) as f64;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * power);
    let count = (max / step).ceil() as usize;
    (0..=count).map(|i| i as f64 * step).collect()
}

fn label(value: f64) -> String {
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The plot area of a line chart: whole-number x from 0 to `x_max`, y over `y_ticks`.
struct Frame {
    height: f64,
    x_max: f64,
    y_ticks: Vec<f64>,
}

impl Frame {
    fn new(height: f64, x_max: f64, y_ticks: Vec<f64>) -> Self {
        Self {
            height,
            x_max: x_max.max(1.0),
            y_ticks,
        }
    }

    fn plot_w(&self) -> f64 {
        WIDTH - LEFT - RIGHT
    }

    fn plot_h(&self) -> f64 {
        self.height - TOP - BOTTOM
    }

    fn x(&self, value: f64) -> f64 {
        LEFT + self.plot_w() * value / self.x_max
    }

    fn y(&self, value: f64) -> f64 {
        let lo = *self.y_ticks.first().unwrap_or(&0.0);
        let hi = *self.y_ticks.last().unwrap_or(&1.0);
        TOP + self.plot_h() * (1.0 - (value - lo) / (hi - lo).max(f64::MIN_POSITIVE))
    }

    /// The points as an SVG polyline's `points`.
    fn line(&self, points: impl Iterator<Item = (f64, f64)>) -> String {
        points
            .map(|(a, b)| format!("{:.1},{:.1}", self.x(a), self.y(b)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Grid lines and y ticks, whole-number x ticks (rounds and versions: none between two),
    /// and both axes' labels.
    fn axes(&self, x_label: &str, y_label: &str) -> Markup {
        let x_ticks: Vec<f64> = ticks(self.x_max, 10)
            .into_iter()
            .filter(|t| *t <= self.x_max && t.fract() == 0.0)
            .collect();
        let middle = TOP + self.plot_h() / 2.0;
        html! {
            @for t in &self.y_ticks {
                line.grid x1=(LEFT) x2=(WIDTH - RIGHT) y1=(self.y(*t)) y2=(self.y(*t)) {}
                text.tick x=(LEFT - 8.0) y=(self.y(*t) + 4.0) text-anchor="end" { (label(*t)) }
            }
            @for t in &x_ticks {
                text.tick x=(self.x(*t)) y=(self.height - BOTTOM + 18.0) text-anchor="middle" { (label(*t)) }
            }
            text.axis x=(LEFT + self.plot_w() / 2.0) y=(self.height - 6.0) text-anchor="middle" { (x_label) }
            // The rotated title's glyphs reach one ascent left of its baseline: at the phone's
            // type (22 units) a baseline at 14 cut them off.
            text.axis x="22" y=(middle) text-anchor="middle"
                transform={"rotate(-90 22 " (middle) ")"} { (y_label) }
        }
    }
}

/// Privacy spent per round (a line through the releases) against the task's budget (dashed).
pub(super) fn privacy_plot(points: &[SpentPoint], rounds_planned: i64, budget: f64) -> Markup {
    let top_value = points
        .iter()
        .map(|p| p.epsilon)
        .fold(budget, f64::max)
        .max(f64::MIN_POSITIVE);
    let x_max = rounds_planned.max(points.last().map_or(1, |p| p.round)) as f64;
    let frame = Frame::new(280.0, x_max, ticks(top_value * 1.05, 5));
    let line = frame.line(
        std::iter::once((0.0, 0.0)).chain(points.iter().map(|p| (p.round as f64, p.epsilon))),
    );
    let summary = match points.last() {
        Some(last) => format!(
            "After round {} of {rounds_planned}, epsilon spent is {} of the budget {}.",
            last.round,
            label(last.epsilon),
            label(budget)
        ),
        None => format!(
            "No round has been released yet; the budget is epsilon {}.",
            label(budget)
        ),
    };
    html! {
        svg.chart #privacy-plot viewBox={"0 0 " (WIDTH) " " (frame.height)} role="img"
            aria-labelledby="privacy-plot-title privacy-plot-desc" data-budget=(budget) {
            title #privacy-plot-title { "Privacy spent per round" }
            desc #privacy-plot-desc { (summary) }
            (frame.axes("round", "epsilon spent"))
            line.budget x1=(LEFT) x2=(WIDTH - RIGHT) y1=(frame.y(budget)) y2=(frame.y(budget)) {}
            text.budget-label x=(WIDTH - RIGHT) y=(frame.y(budget) - 6.0) text-anchor="end" {
                "budget " (label(budget))
            }
            polyline.spent points=(line) {}
            @for p in points {
                circle.spent cx=(frame.x(p.round as f64)) cy=(frame.y(p.epsilon)) r="3.5"
                    data-round=(p.round) data-epsilon=(p.epsilon) {
                    title { "round " (p.round) ": epsilon " (label(p.epsilon)) }
                }
            }
        }
    }
}

/// One round's collection and aggregation time.
pub(super) struct RoundTimes {
    pub round: i64,
    pub collection_millis: i64,
    pub aggregation_millis: Option<i64>,
}

/// Horizontal stacked bars: how long each round collected, then aggregated.
pub(super) fn durations_chart(rows: &[RoundTimes]) -> Markup {
    let bar = 16.0;
    let gap = 6.0;
    // A header row above the bars names the label column: each label is the round's number
    // alone, which fits the column even at the phone's larger type (22 units: "round 1" did
    // not, and a phone showed "und 1").
    let top = TOP + 22.0;
    let left = 80.0;
    let height = top + rows.len() as f64 * (bar + gap) + BOTTOM;
    // Room right of the longest bar for its time ("1 min 23 s") in the phone's type.
    let plot_w = WIDTH - left - RIGHT - 130.0;
    let longest = rows
        .iter()
        .map(|r| r.collection_millis + r.aggregation_millis.unwrap_or(0))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let w = |millis: i64| plot_w * millis as f64 / longest;
    html! {
        svg.chart #durations-chart viewBox={"0 0 " (WIDTH) " " (height)} role="img"
            aria-labelledby="durations-title durations-desc" {
            title #durations-title { "Round durations" }
            desc #durations-desc {
                "Collection (until the round closed) and aggregation (until its release) per round; the table below lists the same times."
            }
            text.tick x=(left - 8.0) y=(top - 8.0) text-anchor="end" { "round" }
            @for (i, row) in rows.iter().enumerate() {
                @let top = top + i as f64 * (bar + gap);
                text.tick x=(left - 8.0) y=(top + bar - 4.0) text-anchor="end" { (row.round) }
                rect.collection x=(left) y=(top) width=(w(row.collection_millis)) height=(bar)
                    data-round=(row.round) data-millis=(row.collection_millis) {
                    title { "round " (row.round) " collected for " (super::layout::duration(row.collection_millis)) }
                }
                @if let Some(aggregation) = row.aggregation_millis {
                    rect.aggregation x=(left + w(row.collection_millis)) y=(top) width=(w(aggregation).max(1.0)) height=(bar)
                        data-round=(row.round) data-millis=(aggregation) {
                        title { "round " (row.round) " aggregated in " (super::layout::duration(aggregation)) }
                    }
                }
                text.tick x=(left + w(row.collection_millis + row.aggregation_millis.unwrap_or(0)) + 6.0) y=(top + bar - 4.0) {
                    (super::layout::duration(row.collection_millis + row.aggregation_millis.unwrap_or(0)))
                }
            }
            @let legend = height - BOTTOM + 22.0;
            rect.collection x=(left) y=(legend - 10.0) width="12" height="12" {}
            text.tick x=(left + 18.0) y=(legend) { "collection" }
            rect.aggregation x=(left + 150.0) y=(legend - 10.0) width="12" height="12" {}
            text.tick x=(left + 168.0) y=(legend) { "aggregation" }
        }
    }
}

/// Horizontal bars for one round's funnel stages (assigned, uploaded, ...).
pub(super) fn funnel_bars(round: i64, stages: &[(&str, i64)]) -> Markup {
    let bar = 20.0;
    let gap = 8.0;
    let height = TOP + stages.len() as f64 * (bar + gap) + 8.0;
    let left = 110.0;
    let plot_w = WIDTH - left - RIGHT - 70.0;
    let widest = stages.iter().map(|(_, n)| *n).max().unwrap_or(1).max(1) as f64;
    html! {
        svg.chart #funnel-chart viewBox={"0 0 " (WIDTH) " " (height)} role="img"
            aria-labelledby="funnel-title" {
            title #funnel-title { "Funnel of round " (round) }
            @for (i, (stage, n)) in stages.iter().enumerate() {
                @let top = TOP + i as f64 * (bar + gap);
                text.tick x=(left - 8.0) y=(top + bar - 6.0) text-anchor="end" { (stage) }
                rect.stage x=(left) y=(top) width=(plot_w * *n as f64 / widest) height=(bar)
                    data-stage=(stage) data-count=(n) {}
                text.tick x=(left + plot_w * *n as f64 / widest + 6.0) y=(top + bar - 6.0) {
                    (super::layout::count(*n))
                }
            }
        }
    }
}

/// Ticks at round numbers from at most `lo` to at least `hi` (either may be negative).
fn ticks_between(lo: f64, hi: f64, wanted: usize) -> Vec<f64> {
    let span = ticks((hi - lo).max(f64::MIN_POSITIVE), wanted);
    let step = span.get(1).copied().unwrap_or(1.0);
    let first = (lo / step).floor() as i64;
    let last = (hi / step).ceil() as i64;
    (first..=last.max(first + 1))
        .map(|i| i as f64 * step)
        .collect()
}

/// One measured value of a model version.
pub(super) struct VersionPoint {
    pub version: i64,
    pub value: f64,
}

/// A line through a metric per model version: the model's quality as training goes on (noised
/// values: the chart shows them as released, below 0 or above 100 % included). The axis covers
/// at least `at_least` (e.g. 0-100 for a percentage) and every value.
pub(super) fn version_chart(
    id: &str,
    title: &str,
    axis: &str,
    at_least: (f64, f64),
    points: &[VersionPoint],
) -> Markup {
    let lo = points.iter().map(|p| p.value).fold(at_least.0, f64::min);
    let hi = points.iter().map(|p| p.value).fold(at_least.1, f64::max);
    // All values equal (and no range asked for): one unit around them.
    let hi = if hi - lo < 1e-12 { lo + 1.0 } else { hi };
    let x_max = points.iter().map(|p| p.version).max().unwrap_or(1) as f64;
    let frame = Frame::new(240.0, x_max, ticks_between(lo, hi, 5));
    let line = frame.line(points.iter().map(|p| (p.version as f64, p.value)));
    let summary = match (points.first(), points.last()) {
        (Some(first), Some(last)) => format!(
            "{title}: {} at model version {}, {} at version {} ({} evaluations).",
            significant(first.value),
            first.version,
            significant(last.value),
            last.version,
            points.len()
        ),
        _ => format!("{title}: no evaluation released yet."),
    };
    let (title_id, desc_id) = (format!("{id}-title"), format!("{id}-desc"));
    html! {
        svg.chart id=(id) viewBox={"0 0 " (WIDTH) " " (frame.height)} role="img"
            aria-labelledby={(title_id) " " (desc_id)} {
            title id=(title_id) { (title) }
            desc id=(desc_id) { (summary) }
            (frame.axes("model version", axis))
            polyline.spent points=(line) {}
            @for p in points {
                circle.spent cx=(frame.x(p.version as f64)) cy=(frame.y(p.value)) r="3.5"
                    data-version=(p.version) data-value=(p.value) {
                    title { "version " (p.version) ": " (significant(p.value)) }
                }
            }
        }
    }
}

/// A value to 3 significant digits (0.000123, 1.23, 1230), without an exponent.
pub(super) fn significant(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let digits = (2 - value.abs().log10().floor() as i32).clamp(0, 12) as usize;
    format!("{value:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers_covering_the_range() {
        let close = |got: Vec<f64>, want: &[f64]| {
            got.len() == want.len() && got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-9)
        };
        assert!(close(ticks(4.2, 5), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]));
        assert!(close(ticks(0.9, 5), &[0.0, 0.2, 0.4, 0.6, 0.8, 1.0]));
        assert!(close(
            ticks(30.0, 10),
            &[0.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
        ));
        assert!(close(ticks(0.0, 5), &[0.0, 1.0]));
    }

    #[test]
    fn privacy_plot_carries_every_point_and_the_budget() {
        let points = [
            SpentPoint {
                round: 1,
                epsilon: 0.5,
            },
            SpentPoint {
                round: 2,
                epsilon: 0.75,
            },
        ];
        let svg = privacy_plot(&points, 4, 2.0).into_string();
        assert!(svg.contains(r#"data-budget="2""#), "{svg}");
        assert!(
            svg.contains(r#"data-round="1" data-epsilon="0.5""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"data-round="2" data-epsilon="0.75""#),
            "{svg}"
        );
        assert!(svg.contains("After round 2 of 4, epsilon spent is 0.75 of the budget 2."));
    }

    #[test]
    fn a_version_chart_keeps_noised_values_outside_the_usual_range() {
        let points = [
            VersionPoint {
                version: 0,
                value: -0.02,
            },
            VersionPoint {
                version: 2,
                value: 1.37,
            },
        ];
        let svg =
            version_chart("loss-chart", "Loss", "mean loss", (0.0, 0.0), &points).into_string();
        assert!(
            svg.contains(r#"data-version="0" data-value="-0.02""#),
            "{svg}"
        );
        assert!(
            svg.contains(r#"data-version="2" data-value="1.37""#),
            "{svg}"
        );
        assert!(
            svg.contains("Loss: -0.0200 at model version 0, 1.37 at version 2 (2 evaluations)."),
            "{svg}"
        );
        assert_eq!(ticks_between(-0.02, 1.37, 5).first(), Some(&-0.5));
        let flat = [VersionPoint {
            version: 0,
            value: 0.0,
        }];
        let svg = version_chart("a", "Accuracy", "%", (0.0, 100.0), &flat).into_string();
        assert!(
            svg.contains(">100</text>"),
            "a percentage's axis reaches 100: {svg}"
        );
    }

    #[test]
    fn values_show_three_significant_digits() {
        assert_eq!(significant(0.000_123_4), "0.000123");
        assert_eq!(significant(1.2345), "1.23");
        assert_eq!(significant(98.76), "98.8");
        assert_eq!(significant(1234.6), "1235");
        assert_eq!(significant(0.0), "0");
    }
}
