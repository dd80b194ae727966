//! The task list (the new-task form is `new_task.rs`).

use axum::extract::State;
use axum::response::{Html, IntoResponse, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::error::{ConsoleError, ConsoleQuery};
use super::layout;
use super::session::Session;
use crate::api::error::ApiError;
use crate::app::AppState;
use crate::db::TaskRecord;
use crate::states::TaskState;

const PAGE_SIZE: u32 = 50;

#[derive(Deserialize)]
pub(super) struct ListQuery {
    page: Option<String>,
}

/// Rounds finished: each completed round made one model version after version 0.
fn rounds_done(task: &TaskRecord) -> i64 {
    task.model_version.unwrap_or(0)
}

pub(super) async fn list(
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
                                th scope="row" { (task_link(task)) }
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
pub(super) fn state_badge(state: TaskState) -> Markup {
    html! { span class={"state state-" (state.as_str().to_ascii_lowercase())} { (state.as_str()) } }
}

/// A task as a link: its name (if it has one) over its id, shortened so that a phone's column
/// stays narrow; the full id is the link's title and the task page's heading.
pub(super) fn task_link(task: &TaskRecord) -> Markup {
    let short = task.id.split('-').next().unwrap_or(&task.id);
    html! {
        a href={"/console/tasks/" (task.id)} title=(task.id) {
            @if let Some(name) = &task.spec.name { (name) br; }
            code.id { (short) "…" }
        }
    }
}
