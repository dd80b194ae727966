//! The device client's checks: sealing once per round, separation under DP-FTRL, the policy's
//! limits and evaluation rounds, trust files.

use super::*;

/// A key entry (its signatures are not checked by what these tests call).
fn key() -> DeviceKey {
    DeviceKey {
        key_id: "k1".into(),
        suite: String::new(),
        public_key: String::new(),
        not_before: 0,
        not_after: 1,
        threshold: 1,
        shares: 1,
        signatures: vec![],
    }
}

fn assignment(policy: &TaskPolicy, key: &DeviceKey) -> AssignmentResponse {
    AssignmentResponse {
        assignment_id: "a1".into(),
        task_id: policy.task_id.clone(),
        round: 1,
        expires_at: 0,
        plan: serde_json::json!({}),
        policy: policy.encode(),
        model_version: 0,
        model_url: "/m".into(),
        encryption: key.clone(),
        upload_url: "/u".into(),
        upload_headers: Default::default(),
        report_url: "/r".into(),
        max_contribution_bytes: 1 << 20,
        evaluate: false,
    }
}

/// A zero update of a one-tensor model (what is sealed does not matter to these tests).
fn update() -> crate::schedule::DueUpdate {
    use safetensors::{Dtype, tensor::TensorView};
    let data = [0u8; 8];
    let model = safetensors::serialize(
        [("w", TensorView::new(Dtype::F32, vec![2], &data).unwrap())],
        None,
    )
    .unwrap();
    // Every assignment of these tests has the id "a1".
    crate::schedule::DueUpdate::now(
        crate::update::UpdateShape::of_model(&model)
            .unwrap()
            .well_formed(Ok(model), None),
        confed_protocol::ids::Capability::from("a1")
            .reference()
            .into_string(),
    )
}

/// A trust file with no key services and the enclave's own limits (sealing needs no key check).
fn open_trust() -> TrustConfig {
    TrustConfig {
        threshold: 1,
        keyservices: vec![],
        shares: None,
        limits: DeviceLimits::ENCLAVE,
        tenant_id: None,
        token_issuers: Vec::new(),
        require_masking: false,
        require_distributed_noise: false,
    }
}

/// A server that stored an upload but answered an error must not get a second update from
/// the device for the same round.
#[test]
fn a_device_seals_at_most_one_update_per_round() {
    let trust = open_trust();
    let client = DeviceClient::new("http://127.0.0.1:1", &trust).unwrap();
    let policy = TaskPolicy::sample("t1", 3);
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let key = key();
    let a = assignment(&policy, &key);
    let accepted = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy,
    };
    let model = Model {
        bytes: std::sync::Arc::new(vec![]),
        sha256: "0".repeat(64),
    };
    assert!(
        client
            .seal(&a, &public, &accepted, &model, &update())
            .is_ok()
    );
    let again = client.seal(&a, &public, &accepted, &model, &update());
    assert!(matches!(
        again,
        Err(DeviceError::AlreadySealed { round: 1, .. })
    ));
    assert!(matches!(
        client.declines(&a),
        Some(DeviceError::AlreadySealed { .. })
    ));
}

/// A training update is never sealed under an analytics policy, nor an answer under a training
/// one: each kind of task gets what its policy asks for.
#[test]
fn an_analytics_task_seals_answers_and_a_training_task_updates() {
    let client = DeviceClient::new("http://127.0.0.1:1", &open_trust()).unwrap();
    let query = confed_protocol::analytics::AnalyticsQuery::OpenHistogram {
        max_key_bytes: 8,
        keys_per_device: 2,
    };
    let policy = TaskPolicy {
        analytics: Some(query.clone()),
        ..TaskPolicy::sample("t1", 3)
    };
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let a = assignment(&policy, &key());
    let accepted = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy,
    };
    let model = Model {
        bytes: std::sync::Arc::new(vec![]),
        sha256: "0".repeat(64),
    };
    let refused = client
        .seal(&a, &public, &accepted, &model, &update())
        .unwrap_err();
    assert!(refused.to_string().contains("answer_until"), "{refused}");
    let answer = crate::schedule::DueUpdate::now(
        crate::update::WellFormedUpdate::answer(
            crate::analytics::answer(&query, &crate::Records::Strings(vec!["w".into()])).unwrap(),
            Vec::new(),
        ),
        confed_protocol::ids::Capability::from("a1")
            .reference()
            .into_string(),
    );
    assert!(client.seal(&a, &public, &accepted, &model, &answer).is_ok());
    // The same answer under a training policy is refused.
    let training = TaskPolicy::sample("t2", 3);
    let b = assignment(&training, &key());
    let accepted = AcceptedPolicy {
        sha256: training.sha256_hex(),
        policy: training,
    };
    let refused = client
        .seal(&b, &public, &accepted, &model, &answer)
        .unwrap_err();
    assert!(refused.to_string().contains("train_until"), "{refused}");
}

/// A due update seals only for its own assignment, and not before its send instant: no caller
/// of the crate can send before the instant drawn for the assignment (issue 45).
#[tokio::test(start_paused = true)]
async fn a_due_update_seals_only_for_its_assignment_and_from_its_instant() {
    let client = DeviceClient::new("http://127.0.0.1:1", &open_trust()).unwrap();
    let policy = TaskPolicy::sample("t1", 3);
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let a = assignment(&policy, &key());
    let accepted = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy,
    };
    let model = Model {
        bytes: std::sync::Arc::new(vec![]),
        sha256: "0".repeat(64),
    };
    let mut early = update();
    early.send_at = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let refused = client.seal(&a, &public, &accepted, &model, &early);
    assert!(
        matches!(&refused, Err(DeviceError::Training(why)) if why.contains("not due yet")),
        "{refused:?}"
    );
    let mut foreign = update();
    foreign.assignment_ref = "0".repeat(64);
    let refused = client.seal(&a, &public, &accepted, &model, &foreign);
    assert!(
        matches!(&refused, Err(DeviceError::Training(why)) if why.contains("another assignment")),
        "{refused:?}"
    );
    // Neither refusal recorded the round as served: the due update still seals.
    tokio::time::advance(std::time::Duration::from_secs(30)).await;
    assert!(client.seal(&a, &public, &accepted, &model, &early).is_ok());
}

/// The accepted policy names the evaluation rounds: 1, 1 + every, ...; none without one.
#[test]
fn the_accepted_policy_names_its_evaluation_rounds() {
    let mut policy = TaskPolicy::sample("t1", 10);
    let plain = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy: policy.clone(),
    };
    let sample = plain.policy.clone();
    let in_round = |round: i64| AssignmentResponse {
        round,
        ..assignment(&sample, &key())
    };
    assert_eq!(plain.evaluation_in(&in_round(1)), None);
    policy.mechanism = "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,1".into();
    let evaluated = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy: policy.clone(),
    };
    let rounds: Vec<i64> = (1..=10)
        .filter(|&r| evaluated.evaluation_in(&in_round(r)).is_some())
        .collect();
    assert_eq!(rounds, [1, 4, 7, 10]);
    assert_eq!(
        evaluated.evaluation_in(&in_round(4)).unwrap().max_examples,
        50
    );
    // On demand (the server's `evaluate`): the device grants the policy's one, then no more,
    // whatever the server asks; a restarted device keeps its count.
    let client = DeviceClient::new("http://127.0.0.1:1", &open_trust()).unwrap();
    let asked = |round: i64| AssignmentResponse {
        evaluate: true,
        ..in_round(round)
    };
    assert!(client.evaluation_for(&in_round(2), &evaluated).is_none());
    assert!(client.evaluation_for(&asked(2), &evaluated).is_some());
    assert!(
        client.evaluation_for(&asked(2), &evaluated).is_some(),
        "the same round again"
    );
    assert!(client.evaluation_for(&asked(3), &evaluated).is_none());
    assert!(
        client.evaluation_for(&in_round(4), &evaluated).is_some(),
        "scheduled rounds do not count"
    );
    assert!(
        client.evaluation_for(&asked(5), &plain).is_none(),
        "none allowed"
    );
    let restarted = DeviceClient::new("http://127.0.0.1:1", &open_trust())
        .unwrap()
        .with_on_demand_evaluated(client.on_demand_evaluated());
    assert!(restarted.evaluation_for(&asked(6), &evaluated).is_none());
}

/// Under DP-FTRL the accounting assumes a device serves at most one round of any
/// `min_separation` consecutive rounds of a task: the device declines and refuses to seal
/// closer rounds, whatever the server assigns, and serves again once far enough.
#[test]
fn a_device_keeps_its_rounds_of_a_tree_task_min_separation_apart() {
    let trust = open_trust();
    let client = DeviceClient::new("http://127.0.0.1:1", &trust).unwrap();
    let mut policy = TaskPolicy::sample("t1", 20);
    policy.mechanism = confed_protocol::policy::Mechanism::Tree { min_separation: 4 }.encode();
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let key = key();
    let accepted = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy: policy.clone(),
    };
    let model = Model {
        bytes: std::sync::Arc::new(vec![]),
        sha256: "0".repeat(64),
    };
    let in_round = |round| AssignmentResponse {
        round,
        ..assignment(&policy, &key)
    };
    assert!(client.declines(&in_round(5)).is_none());
    client
        .seal(&in_round(5), &public, &accepted, &model, &update())
        .unwrap();
    for round in [2, 6, 8] {
        assert!(
            matches!(
                client.declines(&in_round(round)),
                Some(DeviceError::TooSoon {
                    served: 5,
                    min_separation: 4,
                    ..
                })
            ),
            "round {round}"
        );
        let sealed = client.seal(&in_round(round), &public, &accepted, &model, &update());
        assert!(
            matches!(sealed, Err(DeviceError::TooSoon { .. })),
            "{round}"
        );
    }
    assert!(client.declines(&in_round(1)).is_none());
    assert!(client.declines(&in_round(9)).is_none());
    assert!(
        client.declines(&in_round(i64::MIN)).is_none(),
        "no overflow"
    );
    // A restarted device given its record declines as before.
    let restarted = DeviceClient::new("http://127.0.0.1:1", &trust)
        .unwrap()
        .with_served(client.served());
    assert!(restarted.declines(&in_round(6)).is_some());
    // Check-ins into the task's population say the latest round served of this tree task;
    // into another population, or with hints off, nothing.
    let hints = client.latest_served("sample");
    assert_eq!(
        hints
            .iter()
            .map(|h| (h.task_id.as_str(), h.round))
            .collect::<Vec<_>>(),
        [("t1", 5)]
    );
    assert!(client.latest_served("other").is_empty());
    let private = DeviceClient::new("http://127.0.0.1:1", &trust)
        .unwrap()
        .without_served_hints();
    private
        .seal(&in_round(1), &public, &accepted, &model, &update())
        .unwrap();
    assert!(private.latest_served("sample").is_empty());
    client
        .seal(&in_round(9), &public, &accepted, &model, &update())
        .unwrap();
}

/// A policy looser than the trust file's limits, or another task's, is refused before
/// anything is sealed.
#[test]
fn a_policy_outside_the_devices_limits_is_refused() {
    let trust = TrustConfig {
        threshold: 1,
        keyservices: vec![],
        shares: None,
        limits: DeviceLimits {
            max_epsilon: 4.0,
            max_delta: 1e-5,
            min_reports: 1,
        },
        tenant_id: None,
        token_issuers: Vec::new(),
        require_masking: false,
        require_distributed_noise: false,
    };
    let client = DeviceClient::new("http://127.0.0.1:1", &trust).unwrap();
    let key = key();
    let fine = TaskPolicy {
        population: "p".into(),
        ..TaskPolicy::sample("t1", 3)
    };
    assert!(
        client
            .accepted_policy(&assignment(&fine, &key), "p")
            .is_ok()
    );
    let looser = TaskPolicy {
        epsilon: 8.0,
        ..fine.clone()
    };
    let refused = client
        .accepted_policy(&assignment(&looser, &key), "p")
        .unwrap_err();
    assert!(refused.to_string().contains("epsilon 8"), "{refused}");
    let mut foreign = assignment(&fine, &key);
    foreign.task_id = "t2".into();
    assert!(client.accepted_policy(&foreign, "p").is_err());
    assert!(
        client
            .accepted_policy(&assignment(&fine, &key), "other")
            .is_err()
    );
}

/// A device pinned to a tenant refuses another tenant's policy even if the server assigns it.
#[test]
fn a_pinned_device_refuses_another_tenants_policy() {
    let trust = TrustConfig {
        threshold: 1,
        keyservices: vec![],
        shares: None,
        limits: DeviceLimits::ENCLAVE,
        tenant_id: Some("acme".into()),
        token_issuers: Vec::new(),
        require_masking: false,
        require_distributed_noise: false,
    };
    let client = DeviceClient::new("http://127.0.0.1:1", &trust).unwrap();
    let key = key();
    let ours = TaskPolicy {
        population: "p".into(),
        tenant_id: "acme".into(),
        ..TaskPolicy::sample("t1", 3)
    };
    assert!(
        client
            .accepted_policy(&assignment(&ours, &key), "p")
            .is_ok()
    );
    let theirs = TaskPolicy {
        tenant_id: "mallory".into(),
        ..ours
    };
    let refused = client
        .accepted_policy(&assignment(&theirs, &key), "p")
        .unwrap_err();
    assert!(
        refused.to_string().contains("only for tenant acme"),
        "{refused}"
    );
}

/// With a state file (`DeviceClient::open`), a restarted device remembers the rounds it served
/// (and keeps its DP-FTRL separation) and the on-demand evaluations it granted.
#[test]
fn a_device_with_a_state_file_remembers_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("device.json");
    let mut policy = TaskPolicy::sample("t1", 20);
    policy.mechanism =
        "tree_aggregation_on_grid;min_separation=4;evaluation=3,1e1,50,2.5e1,1".into();
    let accepted = AcceptedPolicy {
        sha256: policy.sha256_hex(),
        policy: policy.clone(),
    };
    let key = key();
    let in_round = |round: i64, evaluate: bool| AssignmentResponse {
        round,
        evaluate,
        ..assignment(&policy, &key)
    };
    let (_, public) = confed_protocol::hpke::generate_keypair();
    let model = Model {
        bytes: std::sync::Arc::new(vec![]),
        sha256: "0".repeat(64),
    };
    {
        let device = DeviceClient::open("http://127.0.0.1:1", &open_trust(), &path).unwrap();
        device
            .seal(&in_round(5, false), &public, &accepted, &model, &update())
            .unwrap();
        assert!(
            device
                .evaluation_for(&in_round(6, true), &accepted)
                .is_some()
        );
    }
    let restarted = DeviceClient::open("http://127.0.0.1:1", &open_trust(), &path).unwrap();
    assert_eq!(restarted.served(), [("t1".to_string(), 5)]);
    assert!(matches!(
        restarted.declines(&in_round(7, false)),
        Some(DeviceError::TooSoon { served: 5, .. })
    ));
    assert!(
        restarted
            .seal(&in_round(8, false), &public, &accepted, &model, &update())
            .is_err(),
        "still within the separation after a restart"
    );
    assert_eq!(restarted.latest_served("sample").len(), 1);
    assert!(
        restarted
            .evaluation_for(&in_round(9, true), &accepted)
            .is_none(),
        "the one on-demand evaluation was granted before the restart"
    );
    // A state file that cannot be read is an error, not a fresh start.
    std::fs::write(&path, "{").unwrap();
    assert!(matches!(
        DeviceClient::open("http://127.0.0.1:1", &open_trust(), &path),
        Err(DeviceError::State(StateError::Parse { .. }))
    ));
}
