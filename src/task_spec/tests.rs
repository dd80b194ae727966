//! Validation of task requests: ranges, defaults, the policy text each choice gives.

use super::*;
use confed_protocol::policy::Mechanism;

#[test]
fn capacity_adapts_to_the_drop_out_rate_within_the_cap() {
    let spec: TaskSpec = serde_json::from_value::<CreateTaskRequest>(serde_json::json!({
        "population": "p", "rounds": 1, "report_goal": 10, "over_selection": 0.3,
        "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
    }))
    .unwrap()
    .validate()
    .unwrap();
    assert_eq!(spec.capacity_for(None), 13, "no evidence: the task's own");
    assert_eq!(
        spec.capacity_for(Some(0.1)),
        13,
        "never below the task's own"
    );
    // 40 % dropped: 1 / 0.6 - 1 = 0.667 over-selection.
    assert_eq!(spec.capacity_for(Some(0.4)), 17);
    assert_eq!(spec.capacity_for(Some(0.9)), 20, "at most doubled");
    assert_eq!(spec.capacity_for(Some(1.0)), 20);
}
use serde_json::json;

fn request(overrides: serde_json::Value) -> CreateTaskRequest {
    let mut base = json!({
        "population": "keyboards.en",
        "rounds": 5,
        "report_goal": 100,
        "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0},
    });
    base.as_object_mut()
        .unwrap()
        .extend(overrides.as_object().unwrap().clone());
    serde_json::from_value(base).unwrap()
}

fn invalid_names(overrides: serde_json::Value) -> Vec<String> {
    request(overrides)
        .validate()
        .unwrap_err()
        .into_iter()
        .map(|p| p.name)
        .collect()
}

/// DP-FTRL is chosen in `privacy`: its policy names the tree and the separation (the task's
/// rounds when not given); a separation without the tree, or outside 1..=1024, is refused.
#[test]
fn a_tree_aggregation_task_names_its_separation_in_the_policy() {
    let tree = |privacy: serde_json::Value| request(json!({ "privacy": privacy }));
    let spec = tree(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                           "mechanism": "tree_aggregation"}))
    .validate()
    .unwrap();
    assert_eq!(spec.privacy.min_separation, Some(5));
    assert_eq!(
        spec.policy("t", "x").mechanism,
        "tree_aggregation_on_grid;min_separation=5"
    );
    let spec = tree(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                           "mechanism": "tree_aggregation", "min_separation": 2}))
    .validate()
    .unwrap();
    assert_eq!(
        spec.privacy.mechanism(),
        Mechanism::Tree { min_separation: 2 }
    );
    let gaussian = request(json!({})).validate().unwrap();
    assert_eq!(
        gaussian.policy("t", "x").mechanism,
        "discrete_gaussian_on_grid"
    );
    assert!(
        !serde_json::to_string(&gaussian)
            .unwrap()
            .contains("mechanism"),
        "stored Gaussian tasks keep their old form"
    );
    for privacy in [
        json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0, "min_separation": 2}),
        json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
               "mechanism": "tree_aggregation", "min_separation": 0}),
        json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
               "mechanism": "tree_aggregation", "min_separation": 1025}),
    ] {
        assert_eq!(
            invalid_names(json!({ "privacy": privacy })),
            ["privacy.min_separation"]
        );
    }
}

/// Evaluation goes into the policy with its defaults filled in (the noise from the report goal);
/// its fields are checked and named; its cost counts against the budget.
#[test]
fn an_evaluation_is_named_in_the_policy_with_its_defaults_and_checked() {
    let spec = request(json!({"evaluation": {"every": 2,
        "early_stopping": {"metric": "accuracy", "patience": 3}}}))
    .validate()
    .unwrap();
    // The default noise costs at most 10 % of the budget over the 3 evaluations of 5 rounds
    // (and no less than report_goal x max_examples / 100 = 100), rounded up to 3 digits.
    let expected =
        confed_dp::default_evaluation_stddev(&confed_dp::ClosedForm, 4.0, 1e-6, 3, 100, 100)
            .unwrap();
    assert_eq!(expected, 1210.0);
    assert_eq!(
        spec.policy("t", "x").mechanism,
        "discrete_gaussian_on_grid;evaluation=2,1e1,100,1.21e3,0"
    );
    let rule = spec.evaluation.unwrap().early_stopping.unwrap();
    assert_eq!(
        (rule.metric, rule.patience, rule.min_delta),
        (Metric::Accuracy, 3, Some(0.0))
    );
    assert!(
        !serde_json::to_string(&request(json!({})).validate().unwrap())
            .unwrap()
            .contains("evaluation"),
        "tasks without evaluation keep their stored form"
    );
    for (evaluation, field) in [
        (json!({"every": 0}), "evaluation.every"),
        (json!({"every": 6}), "evaluation.every"),
        (json!({"every": 1, "max_loss": 0.0}), "evaluation.max_loss"),
        (
            json!({"every": 1, "max_examples": 0}),
            "evaluation.max_examples",
        ),
        (json!({"every": 1, "stddev": 0.5}), "evaluation.stddev"),
        (
            json!({"every": 1, "early_stopping": {"metric": "loss", "patience": 0}}),
            "evaluation.early_stopping.patience",
        ),
        (
            json!({"every": 1, "early_stopping": {"metric": "loss", "patience": 1, "min_delta": -1.0}}),
            "evaluation.early_stopping.min_delta",
        ),
    ] {
        assert_eq!(
            invalid_names(json!({ "evaluation": evaluation })),
            [field],
            "{evaluation}"
        );
    }
    // Evaluating every round at little noise would eat the budget: refused, saying what to do.
    let problems = request(json!({"evaluation": {"every": 1, "stddev": 20.0}}))
        .validate()
        .unwrap_err();
    assert_eq!(problems[0].name, "privacy");
    assert!(
        problems[0].reason.contains("evaluate less often"),
        "{problems:?}"
    );
}

#[test]
fn a_plan_whose_rounds_cannot_fit_the_budget_is_refused_with_what_to_change() {
    let problems = request(json!({"rounds": 1000, "report_goal": 20,
        "privacy": {"epsilon": 0.5, "delta": 1e-6, "clip_norm": 1.0}}))
    .validate()
    .unwrap_err();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].name, "privacy");
    assert!(
        problems[0].reason.contains("Raise report_goal to at least"),
        "{}",
        problems[0].reason
    );
    assert!(problems[0].reason.contains("plan fewer rounds"));
}

#[test]
fn defaults_fill_optional_fields() {
    let spec = request(json!({})).validate().unwrap();
    assert_eq!(spec.min_reports, 100);
    assert_eq!(spec.over_selection, 0.3);
    assert_eq!(spec.round_deadline_seconds, 3600);
    assert_eq!(spec.assignment_timeout_seconds, 600);
    assert_eq!(spec.max_round_attempts, 3);
    assert_eq!(spec.server_learning_rate, 1.0);
    assert_eq!(spec.plan, json!({}));
    assert_eq!(spec.max_live_assignments(), 130);
}

#[test]
fn each_out_of_range_field_is_named() {
    let cases = [
        (json!({"population": ""}), "population"),
        (json!({"population": "has space"}), "population"),
        (json!({"rounds": 0}), "rounds"),
        (json!({"rounds": 10_001}), "rounds"),
        (json!({"report_goal": -1}), "report_goal"),
        (json!({"min_reports": 101}), "min_reports"),
        (json!({"min_reports": 0}), "min_reports"),
        (json!({"over_selection": -0.1}), "over_selection"),
        (
            json!({"round_deadline_seconds": 5}),
            "round_deadline_seconds",
        ),
        (
            json!({"assignment_timeout_seconds": 4000}),
            "assignment_timeout_seconds",
        ),
        (json!({"max_round_attempts": 11}), "max_round_attempts"),
        (
            json!({"client_version": {"min": "1.x"}}),
            "client_version.min",
        ),
        (
            json!({"client_version": {"min": "2.0", "max": "1.9"}}),
            "client_version",
        ),
        (
            json!({"constraints": {"Bad Name": true}}),
            "constraints.Bad Name",
        ),
        (
            json!({"constraints": {"ram_gb": {"min": 8, "max": 4}}}),
            "constraints.ram_gb",
        ),
        (json!({"constraints": {"ram_gb": {}}}), "constraints.ram_gb"),
        (
            json!({"privacy": {"epsilon": 0.0, "delta": 1e-6, "clip_norm": 1.0}}),
            "privacy.epsilon",
        ),
        (
            json!({"privacy": {"epsilon": 1.0, "delta": 0.5, "clip_norm": 1.0}}),
            "privacy.delta",
        ),
        (
            json!({"privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": -1.0}}),
            "privacy.clip_norm",
        ),
        (
            // Subnormal: the grid's unit would underflow and no clip could ever fit.
            json!({"privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": 5e-324}}),
            "privacy.clip_norm",
        ),
        (json!({"server_learning_rate": 0.0}), "server_learning_rate"),
        (json!({"plan": [1, 2]}), "plan"),
    ];
    for (overrides, field) in cases {
        assert_eq!(invalid_names(overrides.clone()), vec![field], "{overrides}");
    }
}

#[test]
fn all_problems_are_reported_together_with_ranges() {
    let problems = request(json!({"rounds": 0, "report_goal": 0}))
        .validate()
        .unwrap_err();
    assert_eq!(problems.len(), 2);
    assert_eq!(problems[0].reason, "must be between 1 and 10000 (got 0)");
}

#[test]
fn oversized_plan_is_refused() {
    let big = "x".repeat(MAX_PLAN_BYTES);
    assert_eq!(invalid_names(json!({"plan": {"blob": big}})), vec!["plan"]);
}

#[test]
fn constraints_and_versions_round_trip() {
    let spec = request(json!({
        "client_version": {"min": "1.2", "max": "3"},
        "constraints": {"os": "android", "charging": true, "ram_gb": {"min": 4}},
    }))
    .validate()
    .unwrap();
    let text = serde_json::to_string(&spec).unwrap();
    let back: TaskSpec = serde_json::from_str(&text).unwrap();
    assert_eq!(back, spec);
    assert_eq!(back.constraints["charging"], Constraint::Flag(true));
}

#[test]
fn versions_parse_as_numbers() {
    assert!(parse_version("1.10").unwrap() > parse_version("1.9").unwrap());
    assert_eq!(parse_version("1.2.3.4.5"), None);
    assert_eq!(parse_version(""), None);
}

#[test]
fn a_short_deadline_alone_brings_its_own_assignment_timeout() {
    // A 120 s deadline with the old fixed default of 600 s was refused over a field the partner
    // never sent.
    let spec = request(json!({"round_deadline_seconds": 120}))
        .validate()
        .unwrap();
    assert_eq!(spec.assignment_timeout_seconds, 120);
    let spec = request(json!({"round_deadline_seconds": 7200}))
        .validate()
        .unwrap();
    assert_eq!(spec.assignment_timeout_seconds, 600);
    assert_eq!(
        invalid_names(json!({"round_deadline_seconds": 120, "assignment_timeout_seconds": 300})),
        ["assignment_timeout_seconds"],
        "one the partner did send is still checked"
    );
}

#[test]
fn a_task_name_is_kept_trimmed_and_out_of_the_policy() {
    let spec = request(json!({"name": "  keyboard next-word, en-US  "}))
        .validate()
        .unwrap();
    assert_eq!(spec.name.as_deref(), Some("keyboard next-word, en-US"));
    let unnamed = request(json!({})).validate().unwrap();
    assert_eq!(
        spec.policy("t", "tenant").encode(),
        unnamed.policy("t", "tenant").encode(),
        "devices never see it"
    );
    for bad in [
        json!(""),
        json!("   "),
        json!("a\u{7}b"),
        json!("x".repeat(101)),
    ] {
        assert_eq!(invalid_names(json!({ "name": bad })), ["name"], "{bad}");
    }
}

/// A BLT task: the server optimizes the matrix (or rounds the given one to 2^-52), picks the
/// lattice for the budget, and stores them, so the policy text is the same at every check-in and
/// job; the stored spec, read back, gives that same policy.
#[test]
fn a_blt_task_stores_its_resolved_matrix_and_lattice_and_names_them_in_the_policy() {
    let blt = |privacy: serde_json::Value| request(json!({ "privacy": privacy }));
    let spec = blt(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                          "mechanism": "blt", "min_separation": 2}))
    .validate()
    .unwrap();
    let stored = spec.privacy.blt.clone().expect("resolved");
    let buffers = stored.buffers.clone().expect("optimized buffers");
    assert!(!buffers.is_empty() && buffers.len() <= 10, "{buffers:?}");
    assert!(stored.lattice_bits.is_some_and(|bits| bits > 0));
    assert_eq!(stored.max_values, Some(1 << 24));
    let Mechanism::Blt(noise) = spec.privacy.mechanism() else {
        panic!("not BLT: {:?}", spec.privacy.mechanism());
    };
    assert_eq!(noise.min_separation, 2);
    let policy = spec.policy("t", "x").mechanism;
    assert!(
        policy.starts_with("blt_on_grid;min_separation=2;buffers="),
        "{policy}"
    );
    let reread: TaskSpec = serde_json::from_str(&serde_json::to_string(&spec).unwrap()).unwrap();
    assert_eq!(reread.policy("t", "x").mechanism, policy);

    let given = blt(
        json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0, "mechanism": "blt",
                           "blt": {"buffers": [[0.9, 0.3], [0.4, 0.2]], "max_values": 1000}}),
    )
    .validate()
    .unwrap();
    let resolved = given.privacy.blt.unwrap();
    let q = confed_protocol::blt_noise::quantize;
    assert_eq!(
        resolved.buffers,
        Some(vec![[q(0.9), q(0.3)], [q(0.4), q(0.2)]])
    );
    assert_eq!(resolved.max_values, Some(1000));
    assert_eq!(given.privacy.min_separation, Some(5), "the task's rounds");
}

#[test]
fn a_blt_request_with_server_chosen_or_invalid_parameters_is_refused_by_name() {
    let names = |privacy: serde_json::Value| invalid_names(json!({ "privacy": privacy }));
    let base = |extra: serde_json::Value| {
        let mut privacy = json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                                 "mechanism": "blt"});
        privacy
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        privacy
    };
    assert_eq!(
        names(base(json!({"blt": {"lattice_bits": 3}}))),
        ["privacy.blt.lattice_bits"]
    );
    // Decays must decrease; scales must keep sum(scale / decay) below 1.
    assert_eq!(
        names(base(json!({"blt": {"buffers": [[0.4, 0.1], [0.9, 0.1]]}}))),
        ["privacy.blt.buffers"]
    );
    assert_eq!(
        names(base(json!({"blt": {"buffers": [[0.5, 0.6]]}}))),
        ["privacy.blt.buffers"]
    );
    assert_eq!(
        names(base(json!({"blt": {"max_values": 0}}))),
        ["privacy.blt.max_values"]
    );
    assert_eq!(
        names(base(json!({"min_separation": 10001}))),
        ["privacy.min_separation"]
    );
    assert_eq!(
        names(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0, "blt": {}})),
        ["privacy.blt"]
    );
}

/// The default health noise is sized for the counts a device may really be in: one per round,
/// or one per separation begun under DP-FTRL, with the validated separation (a tree of more
/// than 1,024 rounds has its separation capped, so several counts).
#[test]
fn the_default_health_noise_is_sized_for_the_counts_the_enclave_charges() {
    let with_health = |privacy: serde_json::Value, rounds: u32| {
        request(json!({"rounds": rounds, "report_goal": 20, "privacy": privacy}))
            .validate()
            .unwrap()
    };
    for (mechanism, rounds, counts) in [
        (None, 5, 5),
        (Some("tree_aggregation"), 5, 1),
        (Some("tree_aggregation"), 2048, 2),
    ] {
        let mut privacy = json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0, "health": {}});
        if let Some(name) = mechanism {
            privacy["mechanism"] = json!(name);
        }
        let spec = with_health(privacy, rounds);
        let expected =
            confed_dp::default_health_stddev(&confed_dp::ClosedForm, 8.0, 1e-6, counts, 20)
                .unwrap();
        assert_eq!(
            spec.privacy.health.unwrap().stddev,
            Some(expected),
            "{mechanism:?} over {rounds} rounds"
        );
        assert_eq!(spec.dp_mechanism().health.unwrap().stddev, expected);
    }
}

/// `privacy.weighting` names example-weighted averaging in the policy's mechanism (so devices
/// bind it and send their count); its cap is checked like every field.
#[test]
fn weighting_by_examples_is_named_in_the_policy_and_its_cap_is_checked() {
    let privacy = |weighting: serde_json::Value| json!({"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0, "weighting": weighting});
    let spec = request(json!({"privacy": privacy(json!({"by": "examples", "max_examples": 64}))}))
        .validate()
        .unwrap();
    assert_eq!(
        spec.dp_mechanism().weighting,
        Some(confed_protocol::policy::Weighting { max_examples: 64 })
    );
    assert!(
        spec.dp_mechanism()
            .encode()
            .ends_with(";weighting=examples,64"),
        "{}",
        spec.dp_mechanism().encode()
    );
    for bad in [0, 1_000_001] {
        let names = invalid_names(json!({
            "privacy": privacy(json!({"by": "examples", "max_examples": bad}))
        }));
        assert_eq!(names, ["privacy.weighting.max_examples"], "{bad}");
    }
    let unweighted = request(json!({})).validate().unwrap();
    assert_eq!(unweighted.dp_mechanism().weighting, None);
}
