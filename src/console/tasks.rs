//! The task list and the new-task form. Creating a task goes through the same validation as
//! `POST /v1/tasks`; its messages are shown next to the form.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::error::{ConsoleError, ConsoleForm, ConsoleQuery};
use super::layout::{self, csrf_field};
use super::session::Session;
use crate::api::AppState;
use crate::api::error::ApiError;
use crate::db::TaskRecord;
use crate::states::TaskState;
use crate::task_spec::{CreateTaskRequest, InvalidParam};
use crate::tasks::TaskError;

const PAGE_SIZE: u32 = 50;

#[derive(Deserialize)]
pub struct ListQuery {
    page: Option<String>,
}

/// Rounds finished: each completed round made one model version after version 0.
fn rounds_done(task: &TaskRecord) -> i64 {
    task.model_version.unwrap_or(0)
}

pub async fn list(
    State(state): State<AppState>,
    session: Session,
    ConsoleQuery(query): ConsoleQuery<ListQuery>,
) -> Result<Response, ConsoleError> {
    let tenant = &session.tenant;
    let page = state
        .tasks()
        .page(&tenant.id, PAGE_SIZE, query.page.as_deref())
        .await
        .map_err(ApiError::from)?;
    let (tasks, next) = (page.tasks, page.next_page_token);
    let spent = state.db.privacy_spent_by_task(&tenant.id).await?;
    let body = html! {
        h1 { "Tasks" }
        @if tasks.is_empty() {
            p { "No tasks yet. " a href="/console/tasks/new" { "Create one" } "." }
        } @else {
            div.scroll tabindex="0" role="region" aria-label="Your tasks (scrolls sideways)" {
                table #tasks {
                    caption { "Your tasks, newest first" }
                    thead { tr {
                        th scope="col" { "Task" } th scope="col" { "Population" } th scope="col" { "State" }
                        th scope="col" { "Rounds done" } th scope="col" { "Privacy spent" } th scope="col" { "Created" }
                    } }
                    tbody {
                        @for task in &tasks {
                            @let used = spent.get(&task.id).copied().unwrap_or(0.0);
                            tr data-task=(task.id) {
                                th scope="row" { a href={"/console/tasks/" (task.id)} { code { (task.id) } } }
                                td { (task.spec.population) }
                                td { (state_badge(task.state)) }
                                td.num data-field="rounds" { (rounds_done(task)) " of " (task.spec.rounds) }
                                td.num data-field="privacy" {
                                    "ε " (format!("{used:.3}")) " of " (task.spec.privacy.epsilon)
                                    meter min="0" max=(task.spec.privacy.epsilon) value=(used)
                                        aria-label={"privacy spent of task " (task.id)} {}
                                }
                                td { (crate::clock::rfc3339(crate::clock::Millis(task.created_at))) }
                            }
                        }
                    }
                }
            }
            @if let Some(token) = &next {
                p { a href={"/console/tasks?page=" (token)} rel="next" { "Older tasks" } }
            }
        }
    };
    Ok(Html(layout::page("Tasks", Some(&session), None, body).into_string()).into_response())
}

/// A task state in words, styled by class (text, so colour is never the only signal).
pub fn state_badge(state: TaskState) -> Markup {
    html! { span class={"state state-" (state.as_str().to_ascii_lowercase())} { (state.as_str()) } }
}

/// The new-task form's fields, as typed (empty = the API's default).
#[derive(Debug, Default, Deserialize)]
pub struct NewTaskForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    population: String,
    #[serde(default)]
    rounds: String,
    #[serde(default)]
    report_goal: String,
    #[serde(default)]
    min_reports: String,
    #[serde(default)]
    epsilon: String,
    #[serde(default)]
    delta: String,
    #[serde(default)]
    clip_norm: String,
    #[serde(default)]
    round_deadline_seconds: String,
    #[serde(default)]
    assignment_timeout_seconds: String,
    #[serde(default)]
    server_learning_rate: String,
    #[serde(default)]
    plan: String,
}

pub async fn new_form(session: Session) -> Response {
    let form = NewTaskForm {
        rounds: "10".into(),
        report_goal: "100".into(),
        epsilon: "4".into(),
        delta: "1e-6".into(),
        clip_norm: "1".into(),
        ..Default::default()
    };
    form_page(&session, &form, &[], None)
}

fn form_page(
    session: &Session,
    form: &NewTaskForm,
    problems: &[InvalidParam],
    summary: Option<&str>,
) -> Response {
    let problem_of = |name: &str| {
        problems
            .iter()
            .filter(|p| p.name == name || p.name.ends_with(&format!(".{name}")))
            .map(|p| p.reason.clone())
            .collect::<Vec<_>>()
            .join("; ")
    };
    let field = |name: &'static str, label: &str, value: &str, hint: &str, required: bool| {
        let problem = problem_of(name);
        let hint_id = format!("{name}-hint");
        let problem_id = format!("{name}-problem");
        let described = if problem.is_empty() {
            hint_id.clone()
        } else {
            format!("{hint_id} {problem_id}")
        };
        html! {
            div.field {
                label for=(name) { (label) @if required { " (required)" } }
                input id=(name) name=(name) value=(value) required[required]
                    aria-invalid=[(!problem.is_empty()).then_some("true")] aria-describedby=(described);
                small id=(hint_id) { (hint) }
                @if !problem.is_empty() { p.problem id=(problem_id) { (problem) } }
            }
        }
    };
    let body = html! {
        h1 { "New task" }
        p { "The task starts in state CREATED; upload model version 0 on its page to open round 1. Device constraints and client versions are set through the API (" code { "POST /v1/tasks" } ")." }
        @if let Some(summary) = summary {
            div.problem role="alert" { p { (summary) } }
        }
        form method="post" action="/console/tasks" {
            (csrf_field(session))
            fieldset {
                legend { "Training" }
                (field("population", "Population", &form.population, "Device population: 1-128 of A-Z a-z 0-9 . _ -", true))
                (field("rounds", "Rounds", &form.rounds, "Planned rounds, 1-10000", true))
                (field("report_goal", "Report goal", &form.report_goal, "Reports that close a round", true))
                (field("min_reports", "Minimum reports", &form.min_reports, "Fewest reports a round may close with at its deadline (default: the report goal)", false))
                (field("round_deadline_seconds", "Round deadline (s)", &form.round_deadline_seconds, "10-604800 (default 3600)", false))
                (field("assignment_timeout_seconds", "Assignment timeout (s)", &form.assignment_timeout_seconds, "10 up to the round deadline (default 600)", false))
                (field("server_learning_rate", "Server learning rate", &form.server_learning_rate, "(0, 100] (default 1)", false))
            }
            fieldset {
                legend { "Privacy" }
                (field("epsilon", "Epsilon (whole task)", &form.epsilon, "Total over all rounds, (0, 100]", true))
                (field("delta", "Delta", &form.delta, "(0, 0.01]", true))
                (field("clip_norm", "Clip norm", &form.clip_norm, "L2 bound of one device's update", true))
            }
            div.field {
                label for="plan" { "Plan (JSON object, optional)" }
                textarea #plan name="plan" rows="4" aria-describedby="plan-hint" { (form.plan) }
                small #plan-hint { "Handed to devices unchanged, at most 64 KiB." }
                @let plan_problem = problem_of("plan");
                @if !plan_problem.is_empty() { p.problem { (plan_problem) } }
            }
            button type="submit" { "Create task" }
        }
    };
    let status = if problems.is_empty() && summary.is_none() {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    };
    (
        status,
        Html(layout::page("New task", Some(session), None, body).into_string()),
    )
        .into_response()
}

/// The form as the API's request body: numbers where they parse, text otherwise (so the
/// validation message names the field), absent when left empty.
fn request_body(form: &NewTaskForm) -> Result<serde_json::Value, InvalidParam> {
    fn number(text: &str) -> Option<serde_json::Value> {
        let text = text.trim();
        if text.is_empty() {
            return None;
        }
        Some(
            text.parse::<i64>()
                .map(serde_json::Value::from)
                .or_else(|_| text.parse::<f64>().map(serde_json::Value::from))
                .unwrap_or_else(|_| serde_json::Value::from(text)),
        )
    }
    let mut body = serde_json::Map::new();
    body.insert("population".into(), form.population.trim().into());
    let mut privacy = serde_json::Map::new();
    for (name, text) in [
        ("epsilon", &form.epsilon),
        ("delta", &form.delta),
        ("clip_norm", &form.clip_norm),
    ] {
        if let Some(value) = number(text) {
            privacy.insert(name.into(), value);
        }
    }
    body.insert("privacy".into(), privacy.into());
    for (name, text) in [
        ("rounds", &form.rounds),
        ("report_goal", &form.report_goal),
        ("min_reports", &form.min_reports),
        ("round_deadline_seconds", &form.round_deadline_seconds),
        (
            "assignment_timeout_seconds",
            &form.assignment_timeout_seconds,
        ),
        ("server_learning_rate", &form.server_learning_rate),
    ] {
        if let Some(value) = number(text) {
            body.insert(name.into(), value);
        }
    }
    if !form.plan.trim().is_empty() {
        let plan = serde_json::from_str(&form.plan).map_err(|e| InvalidParam {
            name: "plan".into(),
            reason: format!("is not JSON: {e}"),
        })?;
        body.insert("plan".into(), plan);
    }
    Ok(body.into())
}

pub async fn create(
    State(state): State<AppState>,
    session: Session,
    ConsoleForm(form): ConsoleForm<NewTaskForm>,
) -> Result<Response, ConsoleError> {
    session.check_csrf(&form.csrf)?;
    let body = match request_body(&form) {
        Ok(body) => body,
        Err(problem) => return Ok(form_page(&session, &form, &[problem], None)),
    };
    let request: CreateTaskRequest = match serde_json::from_value(body) {
        Ok(request) => request,
        Err(e) => {
            let summary = format!(
                "The task was not created: {e}. Fill in every required field with a number."
            );
            return Ok(form_page(&session, &form, &[], Some(&summary)));
        }
    };
    let task = match state
        .tasks()
        .create(&session.tenant.id, request, state.now())
        .await
    {
        Ok(task) => task,
        Err(TaskError::InvalidFields(problems)) => {
            return Ok(form_page(
                &session,
                &form,
                &problems,
                Some("The task was not created; correct the fields marked below."),
            ));
        }
        Err(e) => {
            let error = ApiError::from(e);
            if matches!(
                error,
                ApiError::Internal(_) | ApiError::InsufficientStorage(_)
            ) {
                return Err(error.into());
            }
            let summary = match &error {
                ApiError::InvalidFields(problems) => format!(
                    "The task was not created: {}",
                    problems
                        .iter()
                        .map(|p| p.reason.as_str())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
                other => format!("The task was not created: {other}"),
            };
            return Ok(form_page(&session, &form, &[], Some(&summary)));
        }
    };
    tracing::info!(tenant = %session.tenant.name, task = %task.id, "task created (console)");
    Ok(Redirect::to(&format!("/console/tasks/{}", task.id)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_becomes_the_api_body_with_empty_fields_left_to_defaults() {
        let form = NewTaskForm {
            population: " phones ".into(),
            rounds: "3".into(),
            report_goal: "10".into(),
            epsilon: "4".into(),
            delta: "1e-6".into(),
            clip_norm: "x".into(),
            plan: r#"{"lr": 0.1}"#.into(),
            ..Default::default()
        };
        let body = request_body(&form).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "population": "phones", "rounds": 3, "report_goal": 10,
                "privacy": {"epsilon": 4, "delta": 1e-6, "clip_norm": "x"},
                "plan": {"lr": 0.1},
            })
        );
        let bad_plan = NewTaskForm {
            plan: "{".into(),
            ..Default::default()
        };
        assert_eq!(request_body(&bad_plan).unwrap_err().name, "plan");
    }
}
