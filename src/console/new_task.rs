//! The new-task form. Creating a task goes through the same service and validation as
//! `POST /v1/tasks`: each refusal is shown next to its field, and one that names no field of the
//! form (the privacy plan, the compute budget) in the banner, in the API's words.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::html;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::{ConsoleError, ConsoleForm};
use super::layout::{self, csrf_field};
use super::session::Session;
use crate::api::error::ApiError;
use crate::app::AppState;
use crate::task_spec::{CreateTaskRequest, InvalidParam};
use crate::tasks::TaskError;

/// The form's fields, as typed (empty: the API's default).
#[derive(Debug, Default, Deserialize)]
pub(super) struct NewTaskForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    population: String,
    #[serde(default)]
    rounds: String,
    #[serde(default)]
    report_goal: String,
    #[serde(default)]
    min_reports: String,
    #[serde(default)]
    over_selection: String,
    #[serde(default)]
    round_deadline_seconds: String,
    #[serde(default)]
    assignment_timeout_seconds: String,
    #[serde(default)]
    upload_window_start_ms: String,
    #[serde(default)]
    upload_window_end_ms: String,
    #[serde(default)]
    epsilon: String,
    #[serde(default)]
    delta: String,
    #[serde(default)]
    clip_norm: String,
    #[serde(default)]
    mechanism: String,
    #[serde(default)]
    min_separation: String,
    /// "on" when the box is ticked (an unticked box sends nothing).
    #[serde(default)]
    adaptive_clipping: String,
    #[serde(default)]
    target_quantile: String,
    /// "on" when the health signal's box is ticked (the API's default noise).
    #[serde(default)]
    health: String,
    #[serde(default)]
    server_optimizer: String,
    #[serde(default)]
    server_learning_rate: String,
    #[serde(default)]
    evaluation_every: String,
    #[serde(default)]
    evaluation_stddev: String,
    #[serde(default)]
    plan: String,
}

/// What a number field accepts, for its input element and its parse.
#[derive(Clone, Copy)]
enum Number {
    /// Whole numbers within [min, max].
    Integer { min: i64, max: i64 },
    /// Any decimal (step="any") within [min, max].
    Decimal { min: f64, max: f64 },
}

/// One number field: its name in the form, its path in the API body, its label and hint.
struct NumberField {
    name: &'static str,
    path: &'static [&'static str],
    label: &'static str,
    hint: &'static str,
    kind: Number,
    required: bool,
}

const TRAINING: &[NumberField] = &[
    NumberField {
        name: "rounds",
        path: &["rounds"],
        label: "Rounds",
        hint: "Planned rounds, 1-10000",
        kind: Number::Integer {
            min: 1,
            max: 10_000,
        },
        required: true,
    },
    NumberField {
        name: "report_goal",
        path: &["report_goal"],
        label: "Report goal",
        hint: "Reports that close a round",
        kind: Number::Integer {
            min: 1,
            max: 1_000_000,
        },
        required: true,
    },
    NumberField {
        name: "min_reports",
        path: &["min_reports"],
        label: "Minimum reports",
        hint: "Fewest reports a round may close with at its deadline (default: the report goal)",
        kind: Number::Integer {
            min: 1,
            max: 1_000_000,
        },
        required: false,
    },
    NumberField {
        name: "over_selection",
        path: &["over_selection"],
        label: "Over-selection",
        hint: "Extra assignments beyond the report goal, as a fraction: 0-10 (default 0.3; rounds raise it when devices drop out)",
        kind: Number::Decimal {
            min: 0.0,
            max: 10.0,
        },
        required: false,
    },
    NumberField {
        name: "round_deadline_seconds",
        path: &["round_deadline_seconds"],
        label: "Round deadline (s)",
        hint: "10-604800 (default 3600)",
        kind: Number::Integer {
            min: 10,
            max: 604_800,
        },
        required: false,
    },
    NumberField {
        name: "assignment_timeout_seconds",
        path: &["assignment_timeout_seconds"],
        label: "Assignment timeout (s)",
        hint: "10 up to the round deadline (default 600, or the round deadline if shorter)",
        kind: Number::Integer {
            min: 10,
            max: 604_800,
        },
        required: false,
    },
    NumberField {
        name: "upload_window_start_ms",
        path: &["upload_window", "start_ms"],
        label: "Upload window start (ms)",
        hint: "Devices send at an instant drawn between start and end after their assignment, whatever their training did; give both (default: one to two minutes)",
        kind: Number::Integer {
            min: 0,
            max: 604_800_000,
        },
        required: false,
    },
    NumberField {
        name: "upload_window_end_ms",
        path: &["upload_window", "end_ms"],
        label: "Upload window end (ms)",
        hint: "At most the assignment timeout less 5 s",
        kind: Number::Integer {
            min: 0,
            max: 604_800_000,
        },
        required: false,
    },
];

const PRIVACY: &[NumberField] = &[
    NumberField {
        name: "epsilon",
        path: &["privacy", "epsilon"],
        label: "Epsilon (whole task)",
        hint: "Total over all rounds, (0, 100]",
        kind: Number::Decimal {
            min: 0.0,
            max: 100.0,
        },
        required: true,
    },
    NumberField {
        name: "delta",
        path: &["privacy", "delta"],
        label: "Delta",
        hint: "(0, 0.01]",
        kind: Number::Decimal {
            min: 0.0,
            max: 0.01,
        },
        required: true,
    },
    NumberField {
        name: "clip_norm",
        path: &["privacy", "clip_norm"],
        label: "Clip norm",
        hint: "L2 bound of one device's update (with adaptive clipping: the first round's)",
        kind: Number::Decimal {
            min: 1e-6,
            max: 1e6,
        },
        required: true,
    },
    NumberField {
        name: "min_separation",
        path: &["privacy", "min_separation"],
        label: "Minimum separation (DP-FTRL)",
        hint: "Fewest rounds between two a device serves: 1-1024 for tree aggregation, 1-10,000 for BLT (default: the rounds, at most that)",
        kind: Number::Integer {
            min: 1,
            max: 10_000,
        },
        required: false,
    },
    NumberField {
        name: "target_quantile",
        path: &["privacy", "adaptive_clipping", "target_quantile"],
        label: "Target quantile (adaptive clipping)",
        hint: "The share of updates the clip norm should cover, (0, 0.99] (default 0.5)",
        kind: Number::Decimal {
            min: 0.0,
            max: 0.99,
        },
        required: false,
    },
];

const MODEL: &[NumberField] = &[
    NumberField {
        name: "server_learning_rate",
        path: &["server_learning_rate"],
        label: "Server learning rate",
        hint: "(0, 100] (default 1)",
        kind: Number::Decimal {
            min: 0.0,
            max: 100.0,
        },
        required: false,
    },
    NumberField {
        name: "evaluation_every",
        path: &["evaluation", "every"],
        label: "Evaluate every (rounds)",
        hint: "Federated evaluation of the model every this many rounds, charged to the privacy budget; empty for none",
        kind: Number::Integer {
            min: 1,
            max: 10_000,
        },
        required: false,
    },
    NumberField {
        name: "evaluation_stddev",
        path: &["evaluation", "stddev"],
        label: "Evaluation noise (examples)",
        hint: "Standard deviation of the noise on each evaluation sum, [1, 1e6]; empty: the least noise that costs at most 10 % of the budget (the task page shows it, and says when it is too noisy to choose a version by)",
        kind: Number::Decimal { min: 1.0, max: 1e6 },
        required: false,
    },
];

/// The select fields: name, API path, label and options (value, words).
const MECHANISMS: &[(&str, &str)] = &[
    ("gaussian", "Gaussian noise every round"),
    (
        "tree_aggregation",
        "DP-FTRL tree aggregation (devices serve rounds apart)",
    ),
    (
        "blt",
        "DP-FTRL with BLT noise (devices serve rounds apart; the server optimizes the matrix)",
    ),
];
const OPTIMIZERS: &[(&str, &str)] = &[
    ("fedavg", "FedAvg"),
    ("fedavgm", "FedAvgM (server momentum 0.9)"),
    ("fedadam", "FedAdam"),
    ("fedyogi", "FedYogi"),
];

/// Every name a refusal may be matched to a field by (the API's `invalid_params` name, or its
/// last dotted part).
fn form_fields() -> impl Iterator<Item = &'static str> {
    TRAINING
        .iter()
        .chain(PRIVACY)
        .chain(MODEL)
        .map(|f| f.name)
        .chain([
            "name",
            "population",
            "mechanism",
            "adaptive_clipping",
            "health",
            "server_optimizer",
            "plan",
            "every",
        ])
}

/// Whether a refusal named `param` belongs to the form field `field`.
fn belongs(param: &str, field: &str) -> bool {
    // The form's own name (a local parse error) or the API's path.
    let api = match field {
        "evaluation_every" => "evaluation.every",
        "evaluation_stddev" => "evaluation.stddev",
        "upload_window_start_ms" => "upload_window.start_ms",
        "upload_window_end_ms" => "upload_window.end_ms",
        "health" => "health.stddev",
        _ => field,
    };
    param == field || param == api || param.ends_with(&format!(".{api}"))
}

fn value(form: &NewTaskForm, name: &str) -> String {
    match name {
        "rounds" => &form.rounds,
        "report_goal" => &form.report_goal,
        "min_reports" => &form.min_reports,
        "over_selection" => &form.over_selection,
        "round_deadline_seconds" => &form.round_deadline_seconds,
        "assignment_timeout_seconds" => &form.assignment_timeout_seconds,
        "upload_window_start_ms" => &form.upload_window_start_ms,
        "upload_window_end_ms" => &form.upload_window_end_ms,
        "epsilon" => &form.epsilon,
        "delta" => &form.delta,
        "clip_norm" => &form.clip_norm,
        "min_separation" => &form.min_separation,
        "target_quantile" => &form.target_quantile,
        "server_learning_rate" => &form.server_learning_rate,
        "evaluation_every" => &form.evaluation_every,
        "evaluation_stddev" => &form.evaluation_stddev,
        _ => return String::new(),
    }
    .clone()
}

pub(super) async fn new_form(session: Session) -> Response {
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
            .filter(|p| belongs(&p.name, name))
            .map(|p| p.reason.clone())
            .collect::<Vec<_>>()
            .join("; ")
    };
    let described = |name: &str, problem: &str| {
        if problem.is_empty() {
            format!("{name}-hint")
        } else {
            format!("{name}-hint {name}-problem")
        }
    };
    let text_field = |name: &'static str, label: &str, value: &str, hint: &str, required: bool| {
        let problem = problem_of(name);
        html! {
            div.field {
                label for=(name) { (label) @if required { " (required)" } }
                input id=(name) name=(name) type="text" value=(value) required[required]
                    aria-invalid=[(!problem.is_empty()).then_some("true")]
                    aria-describedby=(described(name, &problem));
                small id={(name) "-hint"} { (hint) }
                @if !problem.is_empty() { p.problem id={(name) "-problem"} { (problem) } }
            }
        }
    };
    let number_field = |f: &NumberField| {
        let problem = problem_of(f.name);
        let (step, min, max) = match f.kind {
            Number::Integer { min, max } => ("1".to_string(), min.to_string(), max.to_string()),
            Number::Decimal { min, max } => ("any".to_string(), min.to_string(), max.to_string()),
        };
        html! {
            div.field {
                label for=(f.name) { (f.label) @if f.required { " (required)" } }
                input id=(f.name) name=(f.name) type="number" step=(step) min=(min) max=(max)
                    inputmode=(if step == "1" { "numeric" } else { "decimal" })
                    value=(value(form, f.name)) required[f.required]
                    aria-invalid=[(!problem.is_empty()).then_some("true")]
                    aria-describedby=(described(f.name, &problem));
                small id={(f.name) "-hint"} { (f.hint) }
                @if !problem.is_empty() { p.problem id={(f.name) "-problem"} { (problem) } }
            }
        }
    };
    let select_field =
        |name: &'static str, label: &str, chosen: &str, options: &[(&str, &str)], hint: &str| {
            let problem = problem_of(name);
            html! {
                div.field {
                    label for=(name) { (label) }
                    select id=(name) name=(name) aria-describedby=(described(name, &problem))
                        aria-invalid=[(!problem.is_empty()).then_some("true")] {
                        @for (value, words) in options {
                            option value=(value) selected[*value == chosen] { (words) }
                        }
                    }
                    small id={(name) "-hint"} { (hint) }
                    @if !problem.is_empty() { p.problem id={(name) "-problem"} { (problem) } }
                }
            }
        };
    let adaptive_problem = problem_of("adaptive_clipping");
    let health_problem = problem_of("health");
    let body = html! {
        h1 { "New task" }
        p { "The task starts in state CREATED; upload model version 0 on its page to open round 1. Device constraints, client versions and the optimizers' hyperparameters are set through the API (" code { "POST /v1/tasks" } ", docs/api.md)." }
        @if let Some(summary) = summary {
            div.problem #form-problems role="alert" { p { (summary) } }
        }
        form method="post" action="/console/tasks" novalidate {
            (csrf_field(session))
            fieldset {
                legend { "Task" }
                (text_field("name", "Name", &form.name, "What you call it, shown beside its id: up to 100 characters (optional)", false))
                (text_field("population", "Population", &form.population, "Device population: 1-128 of A-Z a-z 0-9 . _ -", true))
            }
            fieldset {
                legend { "Rounds" }
                @for f in TRAINING { (number_field(f)) }
            }
            fieldset {
                legend { "Privacy" }
                (number_field(&PRIVACY[0])) (number_field(&PRIVACY[1])) (number_field(&PRIVACY[2]))
                (select_field("mechanism", "Mechanism", &form.mechanism, MECHANISMS, "How the noise is drawn across rounds (docs/privacy.md)"))
                (number_field(&PRIVACY[3]))
                div.field {
                    label.check for="adaptive_clipping" {
                        input #adaptive_clipping type="checkbox" name="adaptive_clipping" value="on"
                            checked[form.adaptive_clipping == "on"] aria-describedby="adaptive_clipping-hint";
                        " Adaptive clipping"
                    }
                    small #adaptive_clipping-hint { "Each round's clip norm moves toward the target quantile of the update norms (a little of the budget pays for it)" }
                    @if !adaptive_problem.is_empty() { p.problem #adaptive_clipping-problem { (adaptive_problem) } }
                }
                (number_field(&PRIVACY[4]))
                div.field {
                    label.check for="health" {
                        input #health type="checkbox" name="health" value="on"
                            checked[form.health == "on"] aria-describedby="health-hint";
                        " Health signal"
                    }
                    small #health-hint { "Each release says, noised, about how many devices sent zeros because their training failed or ran late (at most 5 % of the budget pays for it; docs/privacy.md, \"Health\")" }
                    @if !health_problem.is_empty() { p.problem #health-problem { (health_problem) } }
                }
            }
            fieldset {
                legend { "Model" }
                (select_field("server_optimizer", "Server optimizer", &form.server_optimizer, OPTIMIZERS, "How the noised average becomes the next model version"))
                @for f in MODEL { (number_field(f)) }
            }
            div.field {
                label for="plan" { "Plan (JSON object, optional)" }
                @let plan_problem = problem_of("plan");
                textarea #plan name="plan" rows="4" aria-describedby=(described("plan", &plan_problem))
                    aria-invalid=[(!plan_problem.is_empty()).then_some("true")] { (form.plan) }
                small #plan-hint { "Handed to devices unchanged, at most 64 KiB." }
                @if !plan_problem.is_empty() { p.problem #plan-problem { (plan_problem) } }
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

/// Puts `value` at `path` in `body`, making the objects on the way.
fn insert(body: &mut Map<String, Value>, path: &[&str], value: Value) {
    match path {
        [] => {}
        [last] => {
            body.insert((*last).to_string(), value);
        }
        [first, rest @ ..] => {
            let inner = body
                .entry((*first).to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(inner) = inner {
                insert(inner, rest, value);
            }
        }
    }
}

/// The form as the API's request body, or every field that is not what it must be (a number
/// that does not parse, a plan that is not JSON), each named, with the body of the others (to
/// ask the API about them in the same answer). Empty fields are left out (the API's defaults).
fn request_body(form: &NewTaskForm) -> Result<Value, (Value, Vec<InvalidParam>)> {
    let mut body = Map::new();
    let mut problems = Vec::new();
    let name = form.name.trim();
    if !name.is_empty() {
        body.insert("name".into(), name.into());
    }
    body.insert("population".into(), form.population.trim().into());
    body.insert("privacy".into(), Value::Object(Map::new()));
    for field in TRAINING.iter().chain(PRIVACY).chain(MODEL) {
        let text = value(form, field.name);
        let text = text.trim();
        if text.is_empty() {
            if field.required {
                problems.push(InvalidParam {
                    name: field.name.into(),
                    reason: "is required".into(),
                });
            }
            continue;
        }
        let parsed = match field.kind {
            Number::Integer { .. } => text.parse::<i64>().ok().map(Value::from),
            Number::Decimal { .. } => text
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .map(Value::from),
        };
        match parsed {
            Some(number) => insert(&mut body, field.path, number),
            None => problems.push(InvalidParam {
                name: field.name.into(),
                reason: format!(
                    "must be {} (got {text:?})",
                    match field.kind {
                        Number::Integer { .. } => "a whole number",
                        Number::Decimal { .. } => "a number",
                    }
                ),
            }),
        }
    }
    if !form.mechanism.is_empty() {
        insert(
            &mut body,
            &["privacy", "mechanism"],
            form.mechanism.clone().into(),
        );
    }
    if form.adaptive_clipping == "on" {
        let privacy = body
            .entry("privacy")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(privacy) = privacy {
            privacy
                .entry("adaptive_clipping")
                .or_insert_with(|| Value::Object(Map::new()));
        }
    } else if !form.target_quantile.trim().is_empty() {
        problems.push(InvalidParam {
            name: "target_quantile".into(),
            reason: "applies to adaptive clipping only: tick the box, or leave it empty".into(),
        });
    }
    if form.health == "on" {
        insert(&mut body, &["privacy", "health"], Value::Object(Map::new()));
    }
    if form.evaluation_every.trim().is_empty() && !form.evaluation_stddev.trim().is_empty() {
        problems.push(InvalidParam {
            name: "evaluation_stddev".into(),
            reason: "applies to evaluation only: give \"Evaluate every\" too, or leave it empty"
                .into(),
        });
        body.remove("evaluation");
    }
    if !form.server_optimizer.is_empty() {
        insert(
            &mut body,
            &["server_optimizer"],
            serde_json::json!({"name": form.server_optimizer}),
        );
    }
    if !form.plan.trim().is_empty() {
        match serde_json::from_str(&form.plan) {
            Ok(plan) => insert(&mut body, &["plan"], plan),
            Err(e) => problems.push(InvalidParam {
                name: "plan".into(),
                reason: format!("is not JSON: {e}"),
            }),
        }
    }
    if problems.is_empty() {
        Ok(body.into())
    } else {
        Err((body.into(), problems))
    }
}

/// The form's own problems and the API's verdict on the fields that parsed, so that every
/// problem shows after one submit (the API's range errors used to wait for the next one). A
/// required number the form could not read is stood in for by a value just below its range:
/// the API then takes it as invalid, skips the checks bounded by it (as it does for any invalid
/// field: `evaluation.every` by the rounds, `min_reports` by the report goal, the privacy plan),
/// and only its problems with other fields are added.
fn with_api_problems(partial: Value, mut problems: Vec<InvalidParam>) -> Vec<InvalidParam> {
    let Value::Object(mut body) = partial else {
        return problems;
    };
    let local: Vec<String> = problems.iter().map(|p| p.name.clone()).collect();
    let mut stood_in = false;
    for field in TRAINING.iter().chain(PRIVACY).chain(MODEL) {
        if field.required && local.iter().any(|name| name == field.name) {
            let stand_in = match field.kind {
                Number::Integer { min, .. } => Value::from(min - 1),
                Number::Decimal { min, .. } => Value::from(min - 1.0),
            };
            insert(&mut body, field.path, stand_in);
            stood_in = true;
        }
    }
    let Ok(request) = serde_json::from_value::<CreateTaskRequest>(Value::Object(body)) else {
        return problems;
    };
    if let Err(more) = request.validate() {
        problems.extend(more.into_iter().filter(|p| {
            !local.iter().any(|field| belongs(&p.name, field))
                && (!stood_in || form_fields().any(|field| belongs(&p.name, field)))
        }));
    }
    problems
}

/// The banner for refused fields: those no form field shows go in it, in the API's words.
fn summary_of(problems: &[InvalidParam]) -> String {
    let unmatched: Vec<String> = problems
        .iter()
        .filter(|p| !form_fields().any(|field| belongs(&p.name, field)))
        .map(|p| format!("{}: {}", p.name, p.reason))
        .collect();
    let marked = unmatched.len() < problems.len();
    match (unmatched.is_empty(), marked) {
        (true, _) => "The task was not created; correct the fields marked below.".into(),
        (false, false) => format!("The task was not created: {}", unmatched.join("; ")),
        (false, true) => format!(
            "The task was not created: {}. Correct also the fields marked below.",
            unmatched.join("; ")
        ),
    }
}

pub(super) async fn create(
    State(state): State<AppState>,
    session: Session,
    ConsoleForm(form): ConsoleForm<NewTaskForm>,
) -> Result<Response, ConsoleError> {
    session.check_csrf(&form.csrf)?;
    let refused = |problems: Vec<InvalidParam>| {
        let summary = summary_of(&problems);
        form_page(&session, &form, &problems, Some(&summary))
    };
    let body = match request_body(&form) {
        Ok(body) => body,
        Err((partial, problems)) => return Ok(refused(with_api_problems(partial, problems))),
    };
    let request: CreateTaskRequest = match serde_json::from_value(body) {
        Ok(request) => request,
        // Every field's type is checked above; what is left is a select's value edited by hand.
        Err(e) => {
            return Ok(refused(vec![InvalidParam {
                name: "form".into(),
                reason: e.to_string(),
            }]));
        }
    };
    let task = match state.tasks().create(&session.tenant.id, request).await {
        Ok(task) => task,
        Err(TaskError::InvalidFields(problems)) => return Ok(refused(problems)),
        Err(e) => {
            let error = ApiError::from(e);
            if matches!(
                error,
                ApiError::Internal(_) | ApiError::InsufficientStorage(_)
            ) {
                return Err(error.into());
            }
            let summary = match &error {
                ApiError::InvalidFields(problems) => return Ok(refused(problems.clone())),
                other => format!("The task was not created: {other}"),
            };
            return Ok(form_page(&session, &form, &[], Some(&summary)));
        }
    };
    tracing::info!(tenant = %session.tenant.name, task = %task.id, "task created (console)");
    Ok(Redirect::to(&format!("/console/tasks/{}", task.id)).into_response())
}

#[cfg(test)]
#[path = "new_task_tests.rs"]
mod tests;
