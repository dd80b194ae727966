//! The task page's evaluation section: the devices' noised metrics per evaluated model version
//! (from the signed manifests), the best version, and the early-stopping rule and its verdict.

use axum::extract::State;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};

use super::error::{ConsoleError, ConsoleForm, ConsolePath};
use super::layout::csrf_field;
use super::session::Session;
use super::task_page::CsrfOnly;
use crate::app::AppState;
use crate::db::EvaluationPoint;
use crate::db::TaskRecord;
use crate::evaluation::EvaluationSummary;
use crate::states::TaskState;

/// `None` for a task without evaluation.
pub(super) fn section(
    task: &TaskRecord,
    summary: &EvaluationSummary,
    session: &Session,
) -> Option<Markup> {
    let spec = task.spec.evaluation?;
    let (points, best, stopped) = (&summary.points, summary.best, &summary.stopped_early);
    let policy = spec.policy();
    let shown = |value: Option<f64>| value.map_or("—".to_string(), super::charts::significant);
    let series = |value: fn(&EvaluationPoint) -> Option<f64>| {
        points
            .iter()
            .filter_map(|p| {
                value(p).map(|value| super::charts::VersionPoint {
                    version: i64::try_from(p.model_version).unwrap_or(i64::MAX),
                    value,
                })
            })
            .collect::<Vec<_>>()
    };
    let accuracy = series(|p| p.accuracy.map(|a| a * 100.0));
    let loss = series(|p| p.loss);
    Some(html! {
        section aria-labelledby="evaluation-heading" {
            h2 #evaluation-heading { "Evaluation" }
            p.note {
                @if policy.every > 0 { "Every " (policy.every) " rounds" } @else { "In rounds asked for on demand" }
                @if policy.every > 0 && policy.on_demand > 0 { " (and in up to " (policy.on_demand) " rounds asked for on demand)" }
                " the round's devices measure the model version it trains from on their own held-out examples (at most " (policy.max_examples) " each, mean loss at most " (policy.max_loss) "); the enclave releases the sums with noise of standard deviation " (policy.stddev) " examples on each (" (policy.stddev * policy.max_loss) " on the loss sum), charged to the privacy budget. Values are noised: compare versions by more than a few standard deviations over the examples."
                @if let Some(rule) = spec.early_stopping {
                    " Training stops when " (rule.metric.as_str()) " has not improved by more than " (rule.min_delta.unwrap_or(0.0)) " for " (rule.patience) " evaluations."
                }
            }
            @if let Some(reason) = &stopped {
                p #stopped-early { strong { "Stopped early: " } (reason) }
            }
            // Before anything is released: the scale the plan evaluates at.
            @let planned = f64::from(task.spec.report_goal) * f64::from(policy.max_examples);
            @let best_point = points.iter().find(|p| Some(p.model_version) == best);
            @if best_point.map_or(points.is_empty() && confed_dp::evaluation_too_noisy(policy.stddev, planned), |p| p.too_noisy) {
                p.problem #evaluation-too-noisy role="status" {
                    strong { "Too noisy to choose a version by. " }
                    "The noise (" (format!("{:.0}", policy.stddev)) " examples) is 5 % or more of the examples a round evaluates ("
                    @if let Some(p) = best_point { "about " (format!("{:.0}", p.examples.max(0.0))) } @else { "at most " (format!("{:.0}", planned)) }
                    "), so the noised accuracy moves by 5 points or more on its own: the \"best\" version, and early stopping, follow the noise. Evaluate with more devices a round, rarely (the noise the budget allows then shrinks), or with a larger budget (docs/privacy.md, \"Evaluation\")."
                }
            }
            @if policy.on_demand > 0
                && matches!(task.state, TaskState::Created | TaskState::Open)
                && task.current_round < i64::from(task.spec.rounds)
            {
                form.card method="post" action={"/console/tasks/" (task.id) "/evaluations"} {
                    (csrf_field(session))
                    p { "Ask the next round that opens to evaluate the model it trains from (this task allows " (policy.on_demand) " such evaluations; each device takes part in at most that many)." }
                    button type="submit" { "Evaluate the next round" }
                }
            }
            @if points.is_empty() {
                p { "No evaluation released yet." }
            } @else {
                div.charts {
                    (super::charts::version_chart("accuracy-chart", "Accuracy per model version", "accuracy (%)", (0.0, 100.0), &accuracy))
                    (super::charts::version_chart("loss-chart", "Loss per model version", "mean loss", (0.0, 0.0), &loss))
                }
                div.scroll tabindex="0" role="region" aria-label="Evaluations (scrolls sideways)" {
                    table #evaluations {
                        caption { "Per evaluated model version" }
                        thead { tr {
                            th scope="col" { "Model version" } th scope="col" { "Round" }
                            th scope="col" { "Accuracy" } th scope="col" { "Loss" }
                            th scope="col" { "Examples" } th scope="col" { "Noise (examples)" }
                        } }
                        tbody {
                            @for point in points {
                                tr data-version=(point.model_version) {
                                    th scope="row" {
                                        (point.model_version)
                                        @if point.on_demand { " " small { "on demand" } }
                                        @if best == Some(point.model_version) { " " small.ok { "best" } }
                                        @if point.too_noisy { " " small.problem data-field="too_noisy" { "too noisy" } }
                                    }
                                    td.num { (point.round) }
                                    td.num data-field="accuracy" { (shown(point.accuracy.map(|a| a * 100.0))) @if point.accuracy.is_some() { " %" } }
                                    td.num data-field="loss" { (shown(point.loss)) }
                                    td.num data-field="examples" { (format!("{:.0}", point.examples)) }
                                    td.num { (format!("{:.1}", point.stddev)) }
                                }
                            }
                        }
                    }
                }
            }
        }
    })
}

/// Asks for an on-demand evaluation (`Evaluations::request`, as `POST
/// /v1/tasks/{id}/evaluations`); a refusal shows as the console's error page.
pub(super) async fn request(
    State(state): State<AppState>,
    session: Session,
    ConsolePath(id): ConsolePath<String>,
    ConsoleForm(form): ConsoleForm<CsrfOnly>,
) -> Result<Response, ConsoleError> {
    session.check_csrf(&form.csrf)?;
    state.evaluations().request(&session.tenant.id, &id).await?;
    tracing::info!(tenant = %session.tenant.name, task = %id, "on-demand evaluation asked for (console)");
    Ok(Redirect::to(&format!("/console/tasks/{id}")).into_response())
}
