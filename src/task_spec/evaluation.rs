//! `evaluation`: federated evaluation every few rounds (docs/privacy.md, "Evaluation"), its noise
//! and the optional early-stopping rule, with their validation. The schedule, the bounds and the
//! noise go into the task policy (so devices bind them and the enclave charges them); the
//! early-stopping rule is post-processing of released metrics and stays with the server.

use confed_protocol::policy::{
    Evaluation, MAX_EVALUATION_EVERY, MAX_EVALUATION_EXAMPLES, MAX_EVALUATION_LOSS,
    MAX_EVALUATION_STDDEV, MAX_ON_DEMAND_EVALUATIONS, MIN_EVALUATION_STDDEV,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::problems::Problems;

/// Most evaluations without improvement the early-stopping rule may wait for.
pub const MAX_PATIENCE: i64 = 1000;

/// `evaluation` of a task.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluationSpec {
    /// Rounds between evaluations, 0..=rounds: rounds 1, 1 + every, 1 + 2 every, ... evaluate
    /// the model version they train from (version 0, every, 2 every, ...); 0: none scheduled
    /// (then `on_demand` must be at least 1).
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 0, maximum = 10000)]
    pub every: i64,
    /// Bound on one example's loss, (0, 1e6] (default 10): devices clip each loss at it, and the
    /// enclave each device's mean loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 1000000.0)]
    pub max_loss: Option<f64>,
    /// Most held-out examples one device's metrics count, 1-1000000 (default 100): a device
    /// with more is scaled down to this many.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::task_spec::integers::option_i64"
    )]
    #[schema(minimum = 1, maximum = 1000000)]
    pub max_examples: Option<i64>,
    /// Standard deviation of the noise on each metric sum, in examples, [1, 1e6] (default: the
    /// least noise whose evaluations cost at most 10 % of the budget, and at least report_goal x
    /// max_examples / 100; the created task shows it). Each evaluation costs rho
    /// `3 max_examples^2 / (2 stddev^2)` of the task's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1.0, maximum = 1000000.0)]
    pub stddev: Option<f64>,
    /// Evaluations the partner may ask for outside the schedule (`POST
    /// /v1/tasks/{id}/evaluations`), 0-1000 (default 0): each device takes part in at most this
    /// many, and the budget is charged for them from the start.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::task_spec::integers::option_i64"
    )]
    #[schema(minimum = 0, maximum = 1000)]
    pub on_demand: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

/// Stop training (the task completes) when the evaluated `metric` has not improved by more than
/// `min_delta` on its best for `patience` evaluations in a row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    pub metric: Metric,
    /// Evaluations without improvement before stopping, 1-1000.
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 1, maximum = 1000)]
    pub patience: i64,
    /// Smallest change that counts as an improvement, [0, 1e6] (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1000000.0)]
    pub min_delta: Option<f64>,
}

/// An evaluated metric: the mean `loss` (lower is better) or `accuracy` (higher is better).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Loss,
    Accuracy,
}

impl EvaluationSpec {
    /// The policy's evaluation. A validated spec has every field filled in; a stored one missing
    /// a field (edited by hand) gets the cheapest choice, the most noise.
    pub fn policy(&self) -> Evaluation {
        Evaluation {
            every: self.every as u32,
            max_loss: self.max_loss.unwrap_or(10.0),
            max_examples: self.max_examples.unwrap_or(100) as u32,
            stddev: self.stddev.unwrap_or(MAX_EVALUATION_STDDEV),
            on_demand: self.on_demand.unwrap_or(0) as u32,
        }
    }
}

/// Checks `evaluation`: every field in range, defaults filled in, every problem recorded.
/// `default_stddev(every, on_demand, max_examples)` is the noise when none is given (it depends
/// on the budget: `confed_dp::default_evaluation_stddev`).
pub(super) fn validate(
    p: &mut Problems,
    given: &EvaluationSpec,
    rounds: Option<u32>,
    default_stddev: impl FnOnce(u32, u32, u32) -> f64,
) -> EvaluationSpec {
    // Bounded by `rounds` only when that is valid itself, so one mistake is reported once.
    let most = rounds.map_or(i64::from(MAX_EVALUATION_EVERY), i64::from);
    let every = p.checked_int("evaluation.every", given.every, 0, most);
    let on_demand = p.int(
        "evaluation.on_demand",
        given.on_demand.unwrap_or(0),
        0,
        i64::from(MAX_ON_DEMAND_EVALUATIONS),
    );
    if every == Some(0) && on_demand == 0 {
        p.add(
            "evaluation.every",
            "0 schedules no evaluation: give every >= 1, or on_demand >= 1",
        );
    }
    let max_loss = p.float(
        "evaluation.max_loss",
        given.max_loss.unwrap_or(10.0),
        0.0,
        true,
        MAX_EVALUATION_LOSS,
    );
    let max_examples = p.int(
        "evaluation.max_examples",
        given.max_examples.unwrap_or(100),
        1,
        i64::from(MAX_EVALUATION_EXAMPLES),
    );
    let stddev = p.float(
        "evaluation.stddev",
        given.stddev.unwrap_or_else(|| {
            default_stddev(every.unwrap_or(0), on_demand, max_examples)
                .clamp(MIN_EVALUATION_STDDEV, MAX_EVALUATION_STDDEV)
        }),
        MIN_EVALUATION_STDDEV,
        false,
        MAX_EVALUATION_STDDEV,
    );
    let early_stopping = given.early_stopping.map(|rule| EarlyStopping {
        metric: rule.metric,
        patience: i64::from(p.int(
            "evaluation.early_stopping.patience",
            rule.patience,
            1,
            MAX_PATIENCE,
        )),
        min_delta: Some(p.float(
            "evaluation.early_stopping.min_delta",
            rule.min_delta.unwrap_or(0.0),
            0.0,
            false,
            1e6,
        )),
    });
    EvaluationSpec {
        every: i64::from(every.unwrap_or(0)),
        max_loss: Some(max_loss),
        max_examples: Some(i64::from(max_examples)),
        stddev: Some(stddev),
        on_demand: Some(i64::from(on_demand)),
        early_stopping,
    }
}
