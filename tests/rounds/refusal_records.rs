//! Refusals that matter are always recorded (issue 47): a release-ledger refusal (a second
//! commitment for a committed round) is written even when the minute's refusal budget is spent,
//! and the cheap refusals the budget left out are summarized in one record a minute.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key services only; no task database or blob
//! store.

use crate::common;

use common::keyservices::*;
use confed::clock::Millis;
use confed::keyservice::audit::{self, Record};
use confed::keyservice::refusals::{PER_MINUTE, SUMMARY_DECISION};
use confed::keyservice::routes;
use confed_enclave::key_collection::KeyServiceEndpoint;
use confed_protocol::policy::TaskPolicy;

use super::release_ledger::{collect, refused_by, request_for, start_one};

fn records_of(world: &World, index: usize) -> Vec<Record> {
    let mut records = Vec::new();
    audit::verify_file_with(
        &world.dir.path().join(format!("audit-ks{index}.jsonl")),
        |record| records.push(record.clone()),
    )
    .unwrap();
    records
}

#[tokio::test]
async fn a_ledger_refusal_after_the_budget_is_spent_is_in_the_log_and_the_rest_are_summarized() {
    let world = World::new(2, 3);
    let policy = TaskPolicy::sample("task-1", 3);
    let ks1 = world.service(1, Behaviour::Honest, &world.share_files[0..1]);
    let endpoints = vec![
        KeyServiceEndpoint {
            id: ks1.id.clone(),
            url: serve(routes::router(ks1.clone())).await,
        },
        start_one(&world, 2).await,
        start_one(&world, 3).await,
    ];
    collect(&endpoints, &world, &request_for(&world, &policy, 1, "a"))
        .await
        .unwrap();
    // This minute's refusal records are spent (an attacker's issuer-signed junk), and five more
    // junk refusals were not written.
    {
        let mut budget = ks1.refusals.lock().unwrap();
        for i in 0..PER_MINUTE + 5 {
            let _ = budget.admit(&format!("junk-{i}"), &["aud".to_string()], START);
        }
    }
    let error = collect(&endpoints, &world, &request_for(&world, &policy, 1, "b"))
        .await
        .unwrap_err();
    assert!(refused_by(&error, "release_ledger") >= 1, "{error}");
    let refused = records_of(&world, 1).into_iter().any(|r| {
        r.decision.decision == "refused"
            && r.decision
                .failed_checks
                .contains(&"release_ledger".to_string())
            && r.decision.round == 1
    });
    assert!(refused, "the second commitment's refusal is in ks1's log");

    // The first decision of a later minute writes one record summarizing the five.
    world.clock.set(Millis((START + 60) * 1000));
    collect(&endpoints, &world, &request_for(&world, &policy, 2, "c"))
        .await
        .unwrap();
    let summaries: Vec<Record> = records_of(&world, 1)
        .into_iter()
        .filter(|r| r.decision.decision == SUMMARY_DECISION)
        .collect();
    assert_eq!(summaries.len(), 1);
    let summary = &summaries[0].decision;
    assert!(summary.reason.contains("5 refusals"), "{}", summary.reason);
    assert_eq!(summary.failed_checks, ["aud:5"]);
    assert!(summaries[0].signature.is_some(), "signed like every record");
}
