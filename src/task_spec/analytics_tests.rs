//! Validation of analytics task requests: the kind and query, the caps, the training fields an
//! analytics task refuses, its plan check, and the policy text it gives.

use serde_json::json;

use super::*;

fn analytics(extra: serde_json::Value) -> Result<TaskSpec, Vec<InvalidParam>> {
    let mut base = json!({
        "kind": "analytics",
        "analytics": {"query": "open_histogram", "max_key_bytes": 32, "keys_per_device": 8},
        "population": "phones", "rounds": 2, "report_goal": 5000,
        "privacy": {"epsilon": 4.0, "delta": 1e-6},
    });
    base.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    serde_json::from_value::<CreateTaskRequest>(base)
        .unwrap()
        .validate()
}

fn names(problems: Vec<InvalidParam>) -> Vec<String> {
    problems.into_iter().map(|p| p.name).collect()
}

#[test]
fn an_analytics_task_binds_its_query_after_the_fixed_training_lines() {
    let spec = analytics(json!({})).unwrap();
    assert_eq!(spec.kind, TaskKind::Analytics);
    assert_eq!(spec.base_model_version(2), 0);
    let policy = spec.policy("t", "n");
    assert!(policy.check_enclave_limits().is_ok());
    let text = policy.encode();
    assert!(text.contains("\nclip_norm=1e0\nmechanism=discrete_gaussian_on_grid\nserver_learning_rate=1e0\nplan={}\n"), "{text}");
    assert!(text.ends_with("\nanalytics=open_histogram;max_key_bytes=32;keys_per_device=8\n"));
    // The kind follows from the query when it is left out.
    let mut request = json!({
        "analytics": {"query": "histogram", "domain_size": 1000, "keys_per_device": 2},
        "population": "phones", "rounds": 1, "report_goal": 5000,
        "privacy": {"epsilon": 4.0, "delta": 1e-6},
    });
    let spec: TaskSpec = serde_json::from_value::<CreateTaskRequest>(request.take())
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(spec.kind, TaskKind::Analytics);
}

#[test]
fn a_query_past_the_caps_is_refused_naming_its_field() {
    let refused = analytics(
        json!({"analytics": {"query": "open_histogram", "max_key_bytes": 65,
                                                 "keys_per_device": 100}}),
    )
    .unwrap_err();
    assert_eq!(
        names(refused),
        vec!["analytics.max_key_bytes", "analytics.keys_per_device"]
    );
    let refused = analytics(
        json!({"analytics": {"query": "quantiles", "min": 5.0, "max": 1.0,
                                                 "ranks": [0.9, 0.5], "values_per_device": 1}}),
    )
    .unwrap_err();
    assert_eq!(names(refused), vec!["analytics.min", "analytics.ranks"]);
}

#[test]
fn training_fields_on_an_analytics_task_are_refused_each_by_name() {
    let refused = analytics(json!({
        "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0, "mechanism": "blt",
                    "health": {}},
        "server_learning_rate": 0.5,
        "plan": {"epochs": 1},
        "evaluation": {"every": 1, "max_examples": 10, "max_loss": 1.0},
    }))
    .unwrap_err();
    let names = names(refused);
    for field in [
        "privacy.clip_norm",
        "privacy.mechanism",
        "privacy.health",
        "server_learning_rate",
        "plan",
        "evaluation",
    ] {
        assert!(names.iter().any(|n| n == field), "{field}: {names:?}");
    }
    // An empty plan is no plan.
    assert!(analytics(json!({"plan": {}})).is_ok());
}

#[test]
fn the_kind_and_the_query_must_agree() {
    let missing = analytics(json!({"analytics": null})).unwrap_err();
    assert_eq!(names(missing), vec!["analytics"]);
    let training = analytics(json!({"kind": "training"})).unwrap_err();
    assert!(names(training).contains(&"analytics".to_string()));
}

#[test]
fn a_threshold_no_round_can_reach_is_refused_under_privacy() {
    let refused = analytics(json!({"report_goal": 20, "privacy": {"epsilon": 0.5, "delta": 1e-8}}))
        .unwrap_err();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].name, "privacy");
    assert!(
        refused[0].reason.contains("Raise report_goal to at least"),
        "{refused:?}"
    );
}

#[test]
fn a_training_task_still_needs_its_clip_norm() {
    let refused = serde_json::from_value::<CreateTaskRequest>(json!({
        "population": "phones", "rounds": 2, "report_goal": 100,
        "privacy": {"epsilon": 4.0, "delta": 1e-6},
    }))
    .unwrap()
    .validate()
    .unwrap_err();
    assert_eq!(names(refused.clone()), vec!["privacy.clip_norm"]);
    assert!(
        refused[0].reason.contains("a training task needs"),
        "{refused:?}"
    );
}
