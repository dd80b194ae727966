//! An analytics task's part of the request (docs/analytics.md): its kind, its declared query with
//! the caps of `confed_protocol::analytics`, and the training fields it has no use for (refused,
//! saying so, rather than ignored: a partner who sets a clip norm on a query expects it to mean
//! something).

use confed_protocol::analytics::AnalyticsQuery;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::CreateTaskRequest;
use super::privacy::MechanismName;
use super::problems::Problems;

/// What a task does with its rounds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// Devices train the model; each round releases a noised average and a new model version.
    #[default]
    Training,
    /// Devices answer the task's `analytics` query from their records; each round releases the
    /// noised histogram or quantiles (docs/analytics.md).
    Analytics,
}

/// The task's query, or `None` for a training task; every problem recorded.
pub(super) fn validate(
    p: &mut Problems,
    kind: Option<TaskKind>,
    query: Option<&AnalyticsQuery>,
) -> Option<AnalyticsQuery> {
    match (kind, query) {
        (Some(TaskKind::Analytics), None) => {
            p.add(
                "analytics",
                "an analytics task declares its query, e.g. {\"query\": \"open_histogram\", \"max_key_bytes\": 32, \"keys_per_device\": 16} (docs/analytics.md)",
            );
            None
        }
        (Some(TaskKind::Training), Some(_)) => {
            p.add(
                "analytics",
                "only an analytics task (\"kind\": \"analytics\") declares a query; leave it out or change the kind",
            );
            None
        }
        (_, None) => None,
        (_, Some(query)) => {
            let problems = query.problems();
            for problem in &problems {
                p.add(
                    &format!("analytics.{}", problem.field),
                    problem.reason.clone(),
                );
            }
            problems.is_empty().then(|| query.clone())
        }
    }
}

/// Records every training field an analytics request sets: none of them applies to a query.
pub(super) fn refuse_training_fields(p: &mut Problems, request: &CreateTaskRequest) {
    let privacy = &request.privacy;
    let why = "applies to training tasks only; an analytics task's noise and bounds follow from its query and budget: leave it out";
    let set = [
        ("privacy.clip_norm", !privacy.clip_norm.is_nan()),
        (
            "privacy.mechanism",
            privacy
                .mechanism
                .is_some_and(|m| m != MechanismName::Gaussian),
        ),
        ("privacy.min_separation", privacy.min_separation.is_some()),
        ("privacy.blt", privacy.blt.is_some()),
        (
            "privacy.adaptive_clipping",
            privacy.adaptive_clipping.is_some(),
        ),
        ("privacy.health", privacy.health.is_some()),
        ("privacy.weighting", privacy.weighting.is_some()),
        ("evaluation", request.evaluation.is_some()),
        ("server_optimizer", request.server_optimizer.is_some()),
        (
            "server_learning_rate",
            request.server_learning_rate.is_some(),
        ),
        (
            "plan",
            request
                .plan
                .as_ref()
                .is_some_and(|plan| plan.as_object().is_none_or(|o| !o.is_empty())),
        ),
    ];
    for (field, given) in set {
        if given {
            p.add(field, why);
        }
    }
}
