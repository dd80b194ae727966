//! One task: its progress, privacy spent per round against the budget, the per-round funnel and
//! durations, model versions to download, each release's proof check; cancel and upload model
//! version 0.

use std::collections::BTreeMap;

use axum::extract::{Multipart, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::charts::{self, RoundTimes, SpentPoint};
use super::error::{ConsoleError, ConsoleForm, ConsolePath};
use super::layout::{self, count, csrf_field, duration};
use super::session::Session;
use super::tasks::state_badge;
use crate::api::error::ApiError;
use crate::app::AppState;
use crate::db::jobs::ReleaseRecord;
use crate::db::progress::FunnelCount;
use crate::db::{RoundRecord, TaskRecord};
use crate::release_check::{StoredCheck, check_stored};
use crate::states::{AssignmentState, RoundState, TaskState};
use confed_worker_api::manifest::Manifest;

/// Rounds shown in the tables and the durations chart (the newest); the privacy plot shows all.
const ROUNDS_SHOWN: usize = 30;
/// Model versions listed (the newest).
const MODELS_SHOWN: i64 = 20;
/// How often a page of a task with a live round reloads itself.
const REFRESH_SECONDS: u32 = 15;

/// Everything the page says about one round: its attempts, the latest attempt's assignments,
/// and its release with the re-check that also parsed the signed manifest.
struct RoundView<'a> {
    number: i64,
    attempts: Vec<&'a RoundRecord>,
    /// Assignments of the latest attempt, by state (earlier attempts failed and released
    /// nothing; counting them beside the release's inclusions would not add up).
    by_state: BTreeMap<&'static str, i64>,
    assigned: i64,
    uploaded: i64,
    /// Devices that tried to deliver after the round closed.
    late: i64,
    release: Option<&'a ReleaseRecord>,
    check: Option<&'a StoredCheck>,
    /// When the latest attempt stopped collecting (None while it collects, or if it never did).
    aggregating_since: Option<i64>,
}

impl RoundView<'_> {
    fn latest(&self) -> &RoundRecord {
        self.attempts.last().expect("a round view has an attempt")
    }

    fn count(&self, state: AssignmentState) -> i64 {
        self.by_state.get(state.as_str()).copied().unwrap_or(0)
    }

    /// The release's manifest, as the enclave signed it (None without a release, or when the
    /// stored manifest does not parse: the proof column then says so).
    fn manifest(&self) -> Option<&Manifest> {
        self.check.and_then(|c| c.manifest.as_ref())
    }

    fn verified(&self) -> Option<bool> {
        self.check.map(|c| c.failures.is_empty())
    }

    /// Collection: from opening until the round stopped collecting (its move to AGGREGATING),
    /// or until it closed or now. Aggregation: from then until the round completed (the release
    /// and the new model version), or until now.
    fn times(&self, now: i64) -> RoundTimes {
        let latest = self.latest();
        let end = latest.closed_at.unwrap_or(now);
        let collected_until = self.aggregating_since.unwrap_or(end);
        RoundTimes {
            round: self.number,
            collection_millis: (collected_until - latest.opened_at).max(0),
            aggregation_millis: self.aggregating_since.map(|since| (end - since).max(0)),
        }
    }
}

fn round_views<'a>(
    rounds: &'a [RoundRecord],
    funnel: &[FunnelCount],
    releases: &'a [ReleaseRecord],
    checks: &'a [StoredCheck],
    aggregating: &std::collections::HashMap<String, i64>,
    first_shown: i64,
) -> Vec<RoundView<'a>> {
    let mut views: BTreeMap<i64, RoundView<'a>> = BTreeMap::new();
    for round in rounds.iter().filter(|r| r.round_number >= first_shown) {
        views
            .entry(round.round_number)
            .or_insert_with(|| RoundView {
                number: round.round_number,
                attempts: Vec::new(),
                by_state: BTreeMap::new(),
                assigned: 0,
                uploaded: 0,
                late: 0,
                release: None,
                check: None,
                aggregating_since: None,
            })
            .attempts
            .push(round);
    }
    for view in views.values_mut() {
        view.attempts.sort_by_key(|r| r.attempt);
        view.aggregating_since = aggregating.get(&view.latest().id).copied();
    }
    for row in funnel {
        if let Some(view) = views.get_mut(&row.round_number)
            && row.attempt == view.latest().attempt
        {
            *view.by_state.entry(row.state.as_str()).or_default() += row.assignments;
            view.assigned += row.assignments;
            view.uploaded += row.with_contribution;
            view.late += row.late;
        }
    }
    for (release, check) in releases.iter().zip(checks) {
        if let Some(view) = views.get_mut(&release.round_number) {
            view.release = Some(release);
            view.check = Some(check);
        }
    }
    views.into_values().collect()
}

/// Each shown release checked again (signatures: CPU work off the async threads).
async fn check_releases(
    state: &AppState,
    task: &TaskRecord,
    releases: &[ReleaseRecord],
) -> Result<Vec<StoredCheck>, ConsoleError> {
    let mut base_models = Vec::with_capacity(releases.len());
    for release in releases {
        let base = state
            .db
            .model(
                &task.tenant_id,
                &task.id,
                task.spec.base_model_version(release.round_number),
            )
            .await
            .ok()
            .map(|m| m.sha256_hex);
        base_models.push(base);
    }
    let (keys, task, releases) = (state.keys.clone(), task.clone(), releases.to_vec());
    tokio::task::spawn_blocking(move || {
        releases
            .iter()
            .zip(&base_models)
            .map(|(release, base)| check_stored(&keys, &task, base.as_deref(), release))
            .collect()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("release checks: {e}")).into())
}

pub(super) async fn show(
    State(state): State<AppState>,
    session: Session,
    ConsolePath(id): ConsolePath<String>,
) -> Result<Response, ConsoleError> {
    let tenant_id = &session.tenant.id;
    let task = state.db.task(tenant_id, &id).await?;
    let rounds = state.db.rounds(tenant_id, &id).await?;
    let newest = rounds.iter().map(|r| r.round_number).max().unwrap_or(0);
    let first_shown = (newest - ROUNDS_SHOWN as i64 + 1).max(1);
    let series = state.db.release_series(tenant_id, &id).await?;
    let releases = state.db.releases_from(tenant_id, &id, first_shown).await?;
    let funnel = state.db.round_funnel(tenant_id, &id, first_shown).await?;
    let checks = check_releases(&state, &task, &releases).await?;
    let evaluations = state.evaluations().summary(&task).await?;
    let result = super::analytics::section(&state, &task, releases.last()).await?;
    let aggregating = state
        .db
        .aggregating_since(tenant_id, &id, first_shown)
        .await?;
    let mut models = Vec::new();
    if let Some(latest) = task.model_version {
        for version in (0..=latest).rev().take(MODELS_SHOWN as usize) {
            models.push(state.db.model(tenant_id, &id, version).await?);
        }
    }
    let now = state.now();
    let views = round_views(
        &rounds,
        &funnel,
        &releases,
        &checks,
        &aggregating,
        first_shown,
    );
    let shown: Vec<&RoundView> = views.iter().rev().collect();
    let eligible = state.registry.eligible(&task.spec, now);
    let live = task.state == TaskState::Open;
    let spent = series.last().map_or(0.0, |(_, epsilon)| *epsilon);
    // The newest release's noised health count, if the task has the signal.
    let health = views.iter().rev().find_map(|v| {
        v.manifest()
            .and_then(|m| health_text(m).map(|t| (v.number, t)))
    });
    let body = html! {
        (summary(&task, rounds.last(), now, spent, eligible, &session))
        @if task.spec.privacy.health.is_some() {
            p.note #health role="status" {
                "Health (noised, docs/privacy.md \"Health\"): "
                @match &health {
                    Some((round, text)) => { "round " (round) ": " (text) }
                    None => "no release yet.",
                }
            }
        }
        @if let Some(result) = &result {
            (result)
        }
        section aria-labelledby="privacy-heading" {
            h2 #privacy-heading { "Privacy spent per round" }
            (charts::privacy_plot(
                &series.iter().map(|(round, epsilon)| SpentPoint { round: *round, epsilon: *epsilon }).collect::<Vec<_>>(),
                i64::from(task.spec.rounds),
                task.spec.privacy.epsilon,
            ))
        }
        section aria-labelledby="rounds-heading" {
            h2 #rounds-heading { "Rounds" }
            @if let Some(view) = views.iter().rev().find(|v| v.manifest().is_some()) {
                // Declines are a device's own rule (it served the round already), not drop-out:
                // the funnel starts from the assignments devices accepted.
                @let declined = view.count(AssignmentState::Rejected);
                (charts::funnel_bars(view.number, &[
                    ("accepted", view.assigned - declined),
                    ("uploaded", view.uploaded),
                    ("reported", view.count(AssignmentState::Completed)),
                    ("included", view.manifest().map_or(0, |m| m.included as i64)),
                ]))
            }
            // The newest round with declines (rows are newest first), released or live.
            @if let Some(view) = shown.iter().find(|v| v.count(AssignmentState::Rejected) > 0) {
                p.note #declined-note {
                    "Declined in round " (view.number) ": " (count(view.count(AssignmentState::Rejected))) " of its " (count(view.assigned)) " assignments. A device declines a round it has already served (or one too close under the task's minimum separation), and the server cannot tell it from a new device, so it offers the round again: declines are not drop-out, and the funnel above starts from the accepted assignments. When most assignments are declined, the population has too few devices for the task: each round needs " (count(i64::from(task.spec.report_goal))) " different devices."
                }
            }
            @if shown.is_empty() {
                @if task.spec.analytics.is_some() {
                    p { "No round has started." }
                } @else {
                    p { "No round has started: upload model version 0 to open round 1." }
                }
            } @else {
                p.note { "Where the latest attempt of each round sent its assigned devices (declined: devices that had already served the round, or one too close under the task's minimum separation, and said so; not a failure), what its release included (with, for a task requiring device tokens, how many carried a token the enclave verified) and excluded (from the manifest the enclave signed), and how long it collected and aggregated. Rows of rounds older than the retention period may count zero assignments." }
                (funnel_table(&shown, now.0))
            }
        }
        @if let Some(section) = super::evaluations::section(&task, &evaluations, &session) {
            (section)
        }
        @if !shown.is_empty() {
            section aria-labelledby="durations-heading" {
                h2 #durations-heading { "Round durations" }
                (charts::durations_chart(&shown.iter().rev().map(|v| v.times(now.0)).collect::<Vec<_>>()))
            }
        }
        section aria-labelledby="models-heading" {
            h2 #models-heading { "Model versions" }
            @if models.is_empty() {
                p { "None yet." }
            } @else {
                ul #models {
                    @for model in &models {
                        li {
                            a href={"/console/tasks/" (task.id) "/models/" (model.version)} download {
                                "version " (model.version)
                            }
                            " · " (count(model.size_bytes)) " bytes · SHA-256 " code.hash { (model.sha256_hex) }
                        }
                    }
                }
            }
        }
        section aria-labelledby="proof-heading" {
            h2 #proof-heading { "Release proofs" }
            p.note {
                "Each release is checked again here against the key services this server knows: the manifest is this round's, under this task's policy, from the previous model version, and the enclave's signature and a quorum of key-service receipts cover it. "
                "This page comes from the server, so it is the operator's word; check a release independently with your own trust file: "
                code { "confed verify release --task " (task.id) " --round N" } " or the Python package's " code { "verify_release" } "."
            }
            @for view in &shown {
                @if let Some(check) = view.check {
                    details data-round=(view.number) {
                        summary {
                            "round " (view.number) ": "
                            @if check.failures.is_empty() { span.ok { "verified" } } @else { span.bad { "NOT verified" } }
                        }
                        ul { @for line in &check.lines { li { (line) } } }
                    }
                }
            }
        }
    };
    let title = match &task.spec.name {
        Some(name) => format!("{name} (task {})", task.id),
        None => format!("Task {}", task.id),
    };
    let refresh = live.then_some(REFRESH_SECONDS);
    Ok(Html(layout::page(&title, Some(&session), refresh, body).into_string()).into_response())
}

/// The live round's line: its number, state, reports and deadline (with the time left).
fn live_round(round: &RoundRecord, now: crate::clock::Millis) -> Markup {
    let left = round.deadline_at - now.0;
    html! {
        (round.round_number)
        @if round.attempt > 1 { " (attempt " (round.attempt) ")" }
        ", " (round_state(round.state)) ", " (count(round.reports_received)) " of " (count(round.report_goal)) " reports"
        @if round.state == RoundState::Collecting {
            ", deadline " time datetime=(crate::clock::rfc3339(crate::clock::Millis(round.deadline_at))) {
                (crate::clock::rfc3339(crate::clock::Millis(round.deadline_at)))
            }
            @if left > 0 { " (in " (duration(left)) ")" } @else { " (passed; closing)" }
        }
    }
}

fn summary(
    task: &TaskRecord,
    latest: Option<&RoundRecord>,
    now: crate::clock::Millis,
    spent: f64,
    eligible: u64,
    session: &Session,
) -> Markup {
    let budget = task.spec.privacy.epsilon;
    html! {
        h1 {
            @if let Some(name) = &task.spec.name { (name) } @else { "Task" }
            " " (state_badge(task.state))
        }
        p.task-id { "Task id " code.hash #task-id { (task.id) } }
        @if let Some(reason) = &task.failure_reason {
            p.problem #failure-reason role="status" {
                @if task.state == TaskState::Cancelled { "Cancelled: " } @else { "Failed: " }
                (reason)
            }
        }
        dl.summary {
            dt { "Population" } dd { (task.spec.population) }
            dt { "Rounds done" } dd #rounds-done { (task.model_version.unwrap_or(0)) " of " (task.spec.rounds) }
            @if let Some(round) = latest.filter(|r| task.state == TaskState::Open && r.closed_at.is_none()) {
                dt { "Live round" } dd #live-round { (live_round(round, now)) }
            }
            dt { "Privacy spent" } dd #privacy-spent {
                "ε " (format!("{spent:.4}")) " of " (budget) " (δ " (task.spec.privacy.delta) ")"
                meter min="0" max=(budget) value=(spent) aria-label="privacy spent of the budget" {}
            }
            dt { "Report goal" } dd { (count(i64::from(task.spec.report_goal))) " (at least " (count(i64::from(task.spec.min_reports))) " at the deadline)" }
            dt { "Clip norm" } dd { (task.spec.privacy.clip_norm) }
            dt { "Server optimizer" } dd { (task.spec.server_optimizer.name()) ", learning rate " (task.spec.server_learning_rate) }
            dt { "Eligible check-ins, last 15 min" } dd #eligible { (eligible)
                small { " check-ins, not devices: devices are unlinkable, so one that checks in again (told to wait, or declining a round it served) counts again" } }
            dt { "Created" } dd { (crate::clock::rfc3339(crate::clock::Millis(task.created_at))) }
        }
        @if task.state == TaskState::Created {
            form.card method="post" action={"/console/tasks/" (task.id) "/model"} enctype="multipart/form-data" {
                (csrf_field(session))
                label for="model" { "Model version 0 (safetensors, F32 tensors)" }
                input #model type="file" name="model" required accept=".safetensors,application/octet-stream";
                button type="submit" { "Upload and open round 1" }
            }
        }
        @if matches!(task.state, TaskState::Created | TaskState::Open) {
            form.card method="post" action={"/console/tasks/" (task.id) "/cancel"} {
                (csrf_field(session))
                p { "Cancelling stops assignment at once and fails the live round. It cannot be undone." }
                button.danger type="submit" { "Cancel task" }
            }
        }
    }
}

fn funnel_table(shown: &[&RoundView<'_>], now: i64) -> Markup {
    html! {
        div.scroll tabindex="0" role="region" aria-label="Rounds (scrolls sideways)" {
            table #funnel {
                caption { "Per round, newest first" }
                thead { tr {
                    th scope="col" { "Round" } th scope="col" { "State" } th scope="col" { "Assigned" }
                    th scope="col" { "Uploaded" } th scope="col" { "Reported" } th scope="col" { "Declined" } th scope="col" { "Failed" }
                    th scope="col" { "Timed out" } th scope="col" { "Late" } th scope="col" { "Included" } th scope="col" { "Excluded" }
                    th scope="col" { "ε spent" } th scope="col" { "Time" small { "collect + aggregate" } }
                    th scope="col" { "Proof" }
                } }
                tbody {
                    @for view in shown {
                        @let latest = view.latest();
                        @let times = view.times(now);
                        tr data-round=(view.number) {
                            th scope="row" { (view.number)
                                @if view.attempts.len() > 1 { small { " (" (view.attempts.len()) " attempts)" } } }
                            td {
                                (round_state(latest.state))
                                @if let Some(reason) = &latest.failure_reason {
                                    details.reason data-field="failure_reason" { summary { "why" } (reason) }
                                }
                            }
                            td.num data-field="assigned" { (count(view.assigned)) }
                            td.num data-field="uploaded" { (count(view.uploaded)) }
                            td.num data-field="reported" { (count(view.count(AssignmentState::Completed))) }
                            td.num data-field="declined" { (count(view.count(AssignmentState::Rejected))) }
                            td.num data-field="failed" { (count(view.count(AssignmentState::Failed))) }
                            td.num data-field="timed_out" { (count(view.count(AssignmentState::TimedOut))) }
                            td.num data-field="late" { (count(view.late)) }
                            td.num data-field="included" {
                                @if let Some(m) = view.manifest() {
                                    (count(m.included as i64))
                                    // A task requiring device tokens: how many the enclave verified.
                                    @if let Some(n) = m.authenticated { br; small data-field="authenticated" { (count(n as i64)) " with a device token" } }
                                    @if let Some(h) = &m.health { br; small data-field="zeroed" { "≈ " (h.zeroed) " sent zeros (±" (format!("{:.0}", 2.0 * h.stddev)) ")" } }
                                } @else { "—" }
                            }
                            td data-field="excluded" {
                                @if let Some(m) = view.manifest() {
                                    (count(m.excluded.values().sum::<u64>() as i64))
                                    @for (reason, n) in &m.excluded { br; small { (reason) ": " (n) } }
                                } @else { "—" }
                            }
                            td.num data-field="epsilon" { @if let Some(m) = view.manifest() { (format!("{:.4}", m.privacy.epsilon_spent)) } @else { "—" } }
                            td.num data-field="time" {
                                (duration(times.collection_millis)) @if latest.closed_at.is_none() { " so far" }
                                @if let Some(a) = times.aggregation_millis { br; "+ " (duration(a)) }
                            }
                            td {
                                @match view.verified() {
                                    Some(true) => span.ok { "verified" },
                                    Some(false) => span.bad { "NOT verified" },
                                    None => "—",
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A release's health count as a partner reads it: noised, so it is stated with its 95 % band,
/// and may lie outside 0..=included.
fn health_text(manifest: &Manifest) -> Option<String> {
    let h = manifest.health.as_ref()?;
    Some(format!(
        "{} of {} included devices sent zeros in place of a trained update, noised (±{:.0} at 95 %; a noised count may fall below 0 or above the devices included)",
        h.zeroed,
        manifest.included,
        2.0 * h.stddev
    ))
}

fn round_state(state: RoundState) -> Markup {
    html! { span class={"state state-" (state.as_str().to_ascii_lowercase())} { (state.as_str()) } }
}

#[derive(Deserialize)]
pub(super) struct CsrfOnly {
    #[serde(default)]
    pub(super) csrf: String,
}

pub(super) async fn cancel(
    State(state): State<AppState>,
    session: Session,
    ConsolePath(id): ConsolePath<String>,
    ConsoleForm(form): ConsoleForm<CsrfOnly>,
) -> Result<Response, ConsoleError> {
    session.check_csrf(&form.csrf)?;
    let task = state.db.cancel_task(&session.tenant.id, &id).await?;
    tracing::info!(tenant = %session.tenant.name, task = %task.id, "task cancelled (console)");
    Ok(Redirect::to(&format!("/console/tasks/{id}")).into_response())
}

/// Model version 0 from a multipart form: the CSRF field must come first (the form puts it
/// there), so a forged post is refused before its file is read.
pub(super) async fn upload_model(
    State(state): State<AppState>,
    session: Session,
    ConsolePath(id): ConsolePath<String>,
    multipart: Result<Multipart, axum::extract::multipart::MultipartRejection>,
) -> Result<Response, ConsoleError> {
    let mut multipart = multipart?;
    let bad = |e: axum::extract::multipart::MultipartError| {
        ConsoleError::Api(if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge(format!(
                "the model is larger than this server's limit ({} bytes)",
                state.limits.model_bytes
            ))
        } else {
            ApiError::BadRequest(format!("the upload form is malformed: {e}"))
        })
    };
    let first = multipart.next_field().await.map_err(bad)?;
    match first {
        Some(field) if field.name() == Some("csrf") => {
            session.check_csrf(&field.text().await.map_err(bad)?)?;
        }
        _ => session.check_csrf("")?,
    }
    let mut model = None;
    while let Some(field) = multipart.next_field().await.map_err(bad)? {
        if field.name() == Some("model") {
            if model.is_some() {
                return Err(ApiError::BadRequest("the form sends one model file".into()).into());
            }
            // Spooled to a temporary file like the API's upload, never whole in memory.
            let limit = state.limits.model_bytes as u64;
            model = Some(crate::spool::spool_chunks(field, limit, "model").await?);
        }
    }
    let model = model.filter(|m| m.len > 0).ok_or_else(|| {
        ApiError::BadRequest("choose a safetensors file for model version 0".into())
    })?;
    state
        .tasks()
        .store_version_zero(&session.tenant.id, &id, model)
        .await
        .map_err(ApiError::from)?;
    tracing::info!(tenant = %session.tenant.name, task = %id, "model version 0 stored (console)");
    Ok(Redirect::to(&format!("/console/tasks/{id}")).into_response())
}

pub(super) async fn download_model(
    State(state): State<AppState>,
    session: Session,
    ConsolePath((id, version)): ConsolePath<(String, i64)>,
    headers: HeaderMap,
) -> Result<Response, ConsoleError> {
    let model = state.db.model(&session.tenant.id, &id, version).await?;
    let mut response =
        crate::api::model_body::model_response(&state, &model, &headers, "private, no-store")
            .await?;
    let name = format!("attachment; filename=\"{id}-v{version}.safetensors\"");
    if let Ok(value) = HeaderValue::from_str(&name) {
        response
            .headers_mut()
            .insert(header::CONTENT_DISPOSITION, value);
    }
    Ok(response)
}
