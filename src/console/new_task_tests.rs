//! The new-task form's own parsing: the API body it makes, the fields it names.

use super::*;

#[test]
fn form_becomes_the_api_body_with_empty_fields_left_to_defaults() {
    let form = NewTaskForm {
        name: " keyboard ".into(),
        population: " phones ".into(),
        rounds: "3".into(),
        report_goal: "10".into(),
        epsilon: "4".into(),
        delta: "1e-6".into(),
        clip_norm: "1".into(),
        mechanism: "tree_aggregation".into(),
        min_separation: "2".into(),
        adaptive_clipping: "on".into(),
        target_quantile: "0.7".into(),
        health: "on".into(),
        server_optimizer: "fedadam".into(),
        evaluation_every: "2".into(),
        plan: r#"{"lr": 0.1}"#.into(),
        ..Default::default()
    };
    assert_eq!(
        request_body(&form).unwrap(),
        serde_json::json!({
            "name": "keyboard", "population": "phones", "rounds": 3, "report_goal": 10,
            "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                "mechanism": "tree_aggregation", "min_separation": 2,
                "adaptive_clipping": {"target_quantile": 0.7}, "health": {}},
            "server_optimizer": {"name": "fedadam"},
            "evaluation": {"every": 2},
            "plan": {"lr": 0.1},
        })
    );
}

#[test]
fn every_field_that_is_not_a_number_is_named_at_once() {
    let form = NewTaskForm {
        population: "phones".into(),
        rounds: "abc".into(),
        report_goal: "1.5".into(),
        epsilon: "".into(),
        delta: "1e-6".into(),
        clip_norm: "inf".into(),
        plan: "{".into(),
        ..Default::default()
    };
    let (_, problems) = request_body(&form).unwrap_err();
    let named: Vec<(&str, &str)> = problems
        .iter()
        .map(|p| (p.name.as_str(), p.reason.as_str()))
        .collect();
    assert_eq!(
        named[..4],
        [
            ("rounds", "must be a whole number (got \"abc\")"),
            ("report_goal", "must be a whole number (got \"1.5\")"),
            ("epsilon", "is required"),
            ("clip_norm", "must be a number (got \"inf\")"),
        ]
    );
    assert_eq!(problems[4].name, "plan");
}

#[test]
fn refusals_no_field_shows_go_in_the_banner_in_the_apis_words() {
    let plan = InvalidParam {
        name: "privacy".into(),
        reason: "Raise report_goal to at least 868".into(),
    };
    let epsilon = InvalidParam {
        name: "privacy.epsilon".into(),
        reason: "must be in (0, 100]".into(),
    };
    assert_eq!(
        summary_of(std::slice::from_ref(&plan)),
        "The task was not created: privacy: Raise report_goal to at least 868"
    );
    assert_eq!(
        summary_of(&[plan, epsilon.clone()]),
        "The task was not created: privacy: Raise report_goal to at least 868. Correct also the fields marked below."
    );
    assert_eq!(
        summary_of(&[epsilon]),
        "The task was not created; correct the fields marked below."
    );
    assert!(belongs("evaluation.every", "evaluation_every"));
    assert!(belongs("evaluation_every", "evaluation_every"));
    assert!(belongs(
        "privacy.adaptive_clipping.target_quantile",
        "target_quantile"
    ));
}

/// A form the API accepts: the required fields filled in.
fn valid_form() -> NewTaskForm {
    NewTaskForm {
        population: "phones".into(),
        rounds: "3".into(),
        report_goal: "10".into(),
        epsilon: "4".into(),
        delta: "1e-6".into(),
        clip_norm: "1".into(),
        ..Default::default()
    }
}

/// The fields named after one submit of `form`: the form's own problems and the API's.
fn named_after_one_submit(form: &NewTaskForm) -> Vec<String> {
    let (partial, problems) = request_body(form).unwrap_err();
    with_api_problems(partial, problems)
        .into_iter()
        .map(|p| p.name)
        .collect()
}

/// A number that does not parse and a value out of the API's range are both named after one
/// submit: the form asks the API about the fields that parsed.
#[test]
fn the_apis_range_errors_show_with_the_forms_own() {
    let form = NewTaskForm {
        epsilon: "400".into(),
        over_selection: "lots".into(),
        ..valid_form()
    };
    assert_eq!(
        named_after_one_submit(&form),
        ["over_selection", "privacy.epsilon"]
    );
    // A required field left empty: it is named, and so is the other field out of range.
    let form = NewTaskForm {
        rounds: String::new(),
        over_selection: "0.3".into(),
        ..form
    };
    assert_eq!(named_after_one_submit(&form), ["rounds", "privacy.epsilon"]);
    // A check bounded by the missing field is not made against its stand-in: evaluating every 5
    // rounds is not refused for rounds the partner has not given yet.
    let form = NewTaskForm {
        epsilon: "4".into(),
        evaluation_every: "5".into(),
        ..form
    };
    assert_eq!(named_after_one_submit(&form), ["rounds"]);
}

/// Evaluation's noise goes to `evaluation.stddev`; given without a schedule it is named.
#[test]
fn the_evaluation_noise_field_needs_a_schedule() {
    let base = NewTaskForm {
        evaluation_stddev: "800".into(),
        ..valid_form()
    };
    let (_, problems) = request_body(&base).unwrap_err();
    assert_eq!(problems[0].name, "evaluation_stddev");
    let scheduled = NewTaskForm {
        evaluation_every: "1".into(),
        ..base
    };
    let body = request_body(&scheduled).unwrap();
    assert_eq!(
        body["evaluation"],
        serde_json::json!({"every": 1, "stddev": 800.0})
    );
}
