//! The tenant's populations and what their devices did in the last minutes: how many checked in,
//! how many were assigned, and why the others were sent away (the retry reasons devices were
//! given). This is the "why does my round fill slowly" view. The counts are the registry's soft
//! state: this server's check-ins only, lost on restart.

use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use maud::{Markup, html};

use super::error::ConsoleError;
use super::layout::{self, count};
use super::session::Session;
use crate::app::AppState;
use crate::checkin::RetryReason;
use crate::states::TaskState;

/// What each outcome means to a partner, and what to do about it; `has_open_task`: whether the
/// population has an open task of this tenant (then `no_task` means "between two rounds").
fn explain(outcome: &str, has_open_task: bool) -> &'static str {
    match outcome {
        "assigned" => "got an assignment",
        "no_task" if has_open_task => {
            "no round was collecting: between two rounds, while the last one aggregates and the next model version is written (normal); or another tenant's task"
        }
        "no_task" => "no open task runs in this population: open one (upload model version 0)",
        "tenant_mismatch" => "the device is pinned to another tenant",
        "constraints_not_met" => {
            "the device's attributes fit no task's constraints: loosen the constraints"
        }
        "version_mismatch" => "the device's client version fits no task: widen client_version",
        "no_encryption_key" => {
            "no key signed by enough key services: ask the operator to check the key services"
        }
        "round_full" => {
            "every fitting round had all its assignments out: raise over_selection or wait"
        }
        "min_separation" => {
            "the device served this round, or one closer than the task's min_separation: a larger population fills rounds faster"
        }
        _ => "",
    }
}

/// The outcomes in the order the page lists them.
fn outcomes() -> impl Iterator<Item = &'static str> {
    std::iter::once("assigned").chain(
        [
            RetryReason::RoundFull,
            RetryReason::NoTask,
            RetryReason::ConstraintsNotMet,
            RetryReason::VersionMismatch,
            RetryReason::TenantMismatch,
            RetryReason::NoEncryptionKey,
            RetryReason::MinSeparation,
        ]
        .into_iter()
        .map(RetryReason::as_str),
    )
}

fn sparkline(per_minute: &[u64]) -> Markup {
    let width = 240.0;
    let height = 40.0;
    let top = per_minute.iter().copied().max().unwrap_or(0).max(1) as f64;
    let step = width / per_minute.len().max(1) as f64;
    html! {
        svg.spark viewBox={"0 0 " (width) " " (height)} role="img" aria-label="check-ins per minute, oldest first" {
            @for (i, n) in per_minute.iter().enumerate() {
                @let h = (height - 2.0) * *n as f64 / top;
                rect x=(i as f64 * step + 1.0) y=(height - h) width=((step - 2.0).max(1.0)) height=(h) data-count=(n) {
                    title { (n) " check-ins " (per_minute.len() - i - 1) " min ago" }
                }
            }
        }
    }
}

/// How far an open task's live round has filled.
struct OpenTask {
    id: String,
    round: i64,
    reports: i64,
    goal: i64,
    eligible: u64,
}

/// The tenant's open tasks on each population (the newest `TASKS_SCANNED` tasks).
async fn open_tasks(
    state: &AppState,
    tenant_id: &str,
    now: crate::clock::Millis,
) -> Result<Vec<(String, OpenTask)>, ConsoleError> {
    let tasks = state.db.list_tasks(tenant_id, TASKS_SCANNED, None).await?;
    let mut out = Vec::new();
    for task in tasks.into_iter().filter(|t| t.state == TaskState::Open) {
        let rounds = state.db.rounds(tenant_id, &task.id).await?;
        let Some(live) = rounds.iter().max_by_key(|r| (r.round_number, r.attempt)) else {
            continue;
        };
        out.push((
            task.spec.population.clone(),
            OpenTask {
                eligible: state.registry.eligible(&task.spec, now),
                round: live.round_number,
                reports: live.reports_received,
                goal: live.report_goal,
                id: task.id,
            },
        ));
    }
    Ok(out)
}

/// Open tasks looked at for the fill view: the newest, by creation.
const TASKS_SCANNED: u32 = 100;
/// Populations shown (in name order); a tenant may register any number.
const POPULATIONS_SHOWN: usize = 50;

pub(super) async fn show(
    State(state): State<AppState>,
    session: Session,
) -> Result<Response, ConsoleError> {
    let mut populations = state.db.populations(&session.tenant.id).await?;
    let hidden = populations.len().saturating_sub(POPULATIONS_SHOWN);
    populations.truncate(POPULATIONS_SHOWN);
    let now = state.now();
    let open = open_tasks(&state, &session.tenant.id, now).await?;
    let names: Vec<&str> = populations.iter().map(|p| p.name.as_str()).collect();
    let activities = state.registry.activities(&names, now);
    let body = html! {
        h1 { "Populations" }
        p { "Check-ins this server saw in the last 15 minutes, and what each came to: an assignment, or the reason the device was told to come back later. Devices check in anonymously: one that checked in twice counts twice." }
        @if populations.is_empty() {
            p { "No populations yet: your first task on a population registers it." }
        }
        @if hidden > 0 {
            p { "The first " (POPULATIONS_SHOWN) " populations by name; " (hidden) " more are not shown." }
        }
        @for population in &populations {
            @let Some(activity) = activities.get(&population.name) else { continue };
            section.card data-population=(population.name) {
                h2 { (population.name) }
                p {
                    strong data-field="checkins" { (count(activity.checkins as i64)) } " check-ins "
                    (sparkline(&activity.per_minute))
                    small { "per minute, oldest first" }
                }
                @let tasks: Vec<&OpenTask> = open.iter().filter(|(p, _)| *p == population.name).map(|(_, t)| t).collect();
                @if !tasks.is_empty() {
                    h3 { "Open tasks" }
                    ul {
                        @for task in &tasks {
                            li data-task=(task.id) {
                                a href={"/console/tasks/" (task.id)} { code { (task.id) } }
                                ": round " (task.round) ", " (count(task.reports)) " of " (count(task.goal)) " reports; "
                                (task.eligible) " eligible check-ins in the last 15 minutes"
                            }
                        }
                    }
                }
                @if activity.checkins == 0 {
                    p { "No check-ins in the last 15 minutes. Devices may be waiting out a retry window, or none run a client for this population." }
                } @else {
                    table {
                        caption { "What the check-ins of " (population.name) " came to" }
                        thead { tr { th scope="col" { "Outcome" } th scope="col" { "Check-ins" } th scope="col" { "Meaning" } } }
                        tbody {
                            @for outcome in outcomes() {
                                @let n = activity.outcomes.get(outcome).copied().unwrap_or(0);
                                @if n > 0 {
                                    tr data-outcome=(outcome) {
                                        th scope="row" { code { (outcome) } }
                                        td.num { (count(n as i64)) }
                                        td { (explain(outcome, !tasks.is_empty())) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    };
    Ok(Html(layout::page("Populations", Some(&session), None, body).into_string()).into_response())
}
