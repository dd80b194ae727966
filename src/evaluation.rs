//! A task's evaluations as the server reads them from the enclave's release manifests, and the
//! early-stopping rule over them. The rule is post-processing of noised, released metrics: it
//! spends no privacy, and an operator who ignores it only trains longer (docs/privacy.md,
//! "Evaluation").

use crate::db::evaluations::EvaluationRequest;
use crate::db::{Db, DbError, EvaluationPoint, TaskRecord};
use crate::states::TaskState;
use crate::task_spec::{EarlyStopping, Metric};

/// The evaluation service over the task database: what the partner API and the console show of
/// a task's evaluations, and a partner's request for one (`AppState::evaluations()`).
pub struct Evaluations<'a> {
    pub db: &'a Db,
}

/// One task's evaluations with what follows from them.
#[derive(Debug, Clone)]
pub struct EvaluationSummary {
    pub points: Vec<EvaluationPoint>,
    /// The version with the best noised value of the ranking metric, if any has one.
    pub best: Option<u64>,
    /// The best version's evaluation is too noisy to choose a version by.
    pub best_too_noisy: bool,
    /// Why the task completed early, if its early-stopping rule stopped it.
    pub stopped_early: Option<String>,
}

impl Evaluations<'_> {
    /// The evaluations of `task` (one of the tenant's, already read), ranked.
    pub async fn summary(&self, task: &TaskRecord) -> Result<EvaluationSummary, DbError> {
        let points = self.db.evaluations(&task.tenant_id, &task.id).await?;
        let best = best(ranking_metric(task), &points);
        Ok(EvaluationSummary {
            best_too_noisy: points
                .iter()
                .any(|point| Some(point.model_version) == best && point.too_noisy),
            stopped_early: stopped_early(task, &points),
            best,
            points,
        })
    }

    /// Asks for an evaluation of the next round of the tenant's task to open (idempotent while
    /// it waits); refused (`DbError::Conflict`, 409) when the task allows none, has used them
    /// all, is in its last round or is finished.
    pub async fn request(
        &self,
        tenant_id: &str,
        task_id: &str,
    ) -> Result<EvaluationRequest, DbError> {
        self.db.request_evaluation(tenant_id, task_id).await
    }
}

impl Metric {
    fn of(self, point: &EvaluationPoint) -> Option<f64> {
        match self {
            Metric::Loss => point.loss,
            Metric::Accuracy => point.accuracy,
        }
    }

    /// How much better `value` is than `best` (positive: better).
    fn gain(self, value: f64, best: f64) -> f64 {
        match self {
            Metric::Loss => best - value,
            Metric::Accuracy => value - best,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::Accuracy => "accuracy",
        }
    }
}

/// The metric a task's evaluations are ranked by: its early-stopping rule's, else accuracy.
pub fn ranking_metric(task: &TaskRecord) -> Metric {
    task.spec
        .evaluation
        .and_then(|e| e.early_stopping)
        .map_or(Metric::Accuracy, |rule| rule.metric)
}

/// Why the task completed before its planned rounds, if its early-stopping rule stopped it.
pub fn stopped_early(task: &TaskRecord, points: &[EvaluationPoint]) -> Option<String> {
    let rule = task.spec.evaluation?.early_stopping?;
    let short = task
        .model_version
        .is_some_and(|v| v < i64::from(task.spec.rounds));
    if task.state == TaskState::Completed && short {
        early_stop(&rule, points)
    } else {
        None
    }
}

/// The model version with the best value of `metric` (the first of equals), if any has one.
pub fn best(metric: Metric, points: &[EvaluationPoint]) -> Option<u64> {
    let mut best: Option<(f64, u64)> = None;
    for point in points {
        if let Some(value) = metric.of(point)
            && best.is_none_or(|(b, _)| metric.gain(value, b) > 0.0)
        {
            best = Some((value, point.model_version));
        }
    }
    best.map(|(_, version)| version)
}

/// The early-stopping rule's verdict on `task`'s evaluations so far (`None`: go on), for the
/// model commit of round `round_number`, which would open the next one (`Db::commit_model`
/// takes it).
pub async fn early_stop_verdict(
    db: &Db,
    task: &TaskRecord,
    round_number: i64,
) -> Result<Option<String>, DbError> {
    // The last planned round opens nothing: no verdict to read the evaluations for.
    if round_number >= i64::from(task.spec.rounds) {
        return Ok(None);
    }
    let Some(evaluation) = task.spec.evaluation else {
        return Ok(None);
    };
    let Some(rule) = evaluation.early_stopping else {
        return Ok(None);
    };
    let points = db.evaluations_of_task(&task.id, &evaluation).await?;
    Ok(early_stop(&rule, &points))
}

/// Why the task should stop now, if it should: the rule's metric has not improved on its best by
/// more than `min_delta` for `patience` evaluations in a row (an evaluation without a metric
/// counts as no improvement). `points` are in model-version order.
pub fn early_stop(rule: &EarlyStopping, points: &[EvaluationPoint]) -> Option<String> {
    let min_delta = rule.min_delta.unwrap_or(0.0);
    let mut best: Option<(f64, u64)> = None;
    let mut waited = 0i64;
    for point in points {
        match (rule.metric.of(point), best) {
            (Some(value), None) => best = Some((value, point.model_version)),
            (Some(value), Some((best_value, _)))
                if rule.metric.gain(value, best_value) > min_delta =>
            {
                best = Some((value, point.model_version));
                waited = 0;
            }
            _ => waited += 1,
        }
    }
    if waited < rule.patience {
        return None;
    }
    let reference = best.map_or("no evaluation had a metric".to_string(), |(value, version)| {
        format!("the last improvement by more than {min_delta}: {value:.4} at model version {version}")
    });
    Some(format!(
        "early stopping: the evaluated {} has not improved by more than {min_delta} for {waited} evaluations ({reference})",
        rule.metric.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(values: &[Option<f64>]) -> Vec<EvaluationPoint> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| EvaluationPoint {
                model_version: 2 * i as u64,
                round: 2 * i as u64 + 1,
                on_demand: false,
                stddev: 1.0,
                examples: 100.0,
                correct: 0.0,
                loss_sum: 0.0,
                accuracy: *v,
                loss: v.map(|a| 1.0 - a),
                too_noisy: false,
            })
            .collect()
    }

    fn rule(metric: Metric, patience: i64, min_delta: f64) -> EarlyStopping {
        EarlyStopping {
            metric,
            patience,
            min_delta: Some(min_delta),
        }
    }

    #[test]
    fn training_stops_after_patience_evaluations_without_improvement() {
        let accuracy = rule(Metric::Accuracy, 2, 0.0);
        let rising = points(&[Some(0.1), Some(0.3), Some(0.5)]);
        assert_eq!(early_stop(&accuracy, &rising), None);
        let flat = points(&[Some(0.1), Some(0.5), Some(0.4), Some(0.5)]);
        let reason = early_stop(&accuracy, &flat).expect("stops");
        assert!(
            reason.contains("accuracy") && reason.contains("0.5000 at model version 2"),
            "{reason}"
        );
        // Loss: lower is better, so the same series read as loss keeps improving... until not.
        assert_eq!(best(Metric::Accuracy, &flat), Some(2));
        assert_eq!(best(Metric::Loss, &flat), Some(2));
        let loss = rule(Metric::Loss, 2, 0.0);
        assert!(early_stop(&loss, &rising).is_none());
        assert!(early_stop(&loss, &points(&[Some(0.9), Some(0.5), Some(0.1)])).is_some());
    }

    #[test]
    fn one_evaluation_fewer_than_patience_without_improvement_goes_on() {
        let rule = rule(Metric::Accuracy, 3, 0.0);
        let two_flat = points(&[Some(0.5), Some(0.4), Some(0.45)]);
        assert_eq!(early_stop(&rule, &two_flat), None);
        let three_flat = points(&[Some(0.5), Some(0.4), Some(0.45), Some(0.5)]);
        assert!(early_stop(&rule, &three_flat).is_some());
    }

    #[test]
    fn an_improvement_within_min_delta_or_a_missing_metric_counts_as_none() {
        let rule = rule(Metric::Accuracy, 2, 0.05);
        assert!(early_stop(&rule, &points(&[Some(0.5), Some(0.52), Some(0.54)])).is_some());
        assert!(early_stop(&rule, &points(&[Some(0.5), Some(0.52), Some(0.56)])).is_none());
        assert!(early_stop(&rule, &points(&[Some(0.5), None, None])).is_some());
        assert!(early_stop(&rule, &points(&[])).is_none());
    }
}
