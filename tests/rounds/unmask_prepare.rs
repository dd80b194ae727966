//! Mask sums prepared while the round collects (docs/secure-aggregation.md, "Prepared sums"):
//! the key services add uploaded inputs' streams ahead, and their sums over the agreed set are
//! what they would have computed from nothing, whatever was prepared: inputs the set leaves out
//! are subtracted, inputs never prepared are added, an input prepared with other bytes than the
//! sums request names is computed from the request's. Once a set is agreed, nothing more is
//! prepared.
//!
//! Not run again on PostgreSQL and GCS (.ci/run): key services only; no task database or blob
//! store.

use confed_attestation::unmask_api::{PrepareAnswer, PrepareRequest};
use confed_protocol::policy::TaskPolicy;

use super::unmask::{
    DEVICES, Input, Masked, TASK, VALUES, calibrated_variance, masked_input, noised, released_with,
};

/// A prepare request for key service `service` (0-based): each input as its sums request
/// names it (this service's item of the seeds, every item's digest).
fn prepare_request(m: &Masked, service: usize, inputs: &[&Input]) -> PrepareRequest {
    PrepareRequest {
        task_id: TASK.into(),
        round: 1,
        policy: m.policy.encode(),
        values: VALUES as u64,
        inputs: m.masked_inputs(service, inputs.iter().copied()),
    }
}

async fn prepare(m: &Masked, service: usize, inputs: &[&Input]) -> reqwest::Response {
    m.post(service, "prepare", &prepare_request(m, service, inputs))
        .await
}

/// With distributed noise on (so the noise keys' seeds, in the set's order, are checked too):
/// every service prepared a superset with one input left out, one prepared under other bytes
/// and one never agreed to; the unmasked sum is exactly the agreed inputs' sum plus the noise
/// the test derives from their own seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_sums_are_the_sums_of_the_agreed_set_whatever_was_prepared() {
    let exact_variance = calibrated_variance(&TaskPolicy::sample(TASK, 3));
    let variance = exact_variance + exact_variance / 10_000 + 1;
    let m = released_with(Some(variance)).await;
    let layout = m.policy.masking.as_ref().unwrap().layout();
    let signer = crate::common::issuer::signer();
    // Device 2's assignment again, with seeds and a token of its own (another envelope for the
    // same ref), and device 7, whom the set never includes.
    let other_bytes = masked_input(&layout, &m.policy, &signer, 2);
    let left_out = masked_input(&layout, &m.policy, &signer, 7);
    let replaced = m
        .inputs
        .iter()
        .position(|i| i.assignment_ref == other_bytes.assignment_ref)
        .unwrap();
    let never_prepared = (replaced + 1) % DEVICES;
    let mut batch: Vec<&Input> = m
        .inputs
        .iter()
        .enumerate()
        .filter(|(at, _)| *at != replaced && *at != never_prepared)
        .map(|(_, i)| i)
        .collect();
    batch.push(&other_bytes);
    batch.push(&left_out);
    // A forged input (seeds no token binds) is refused on its own, not the batch.
    let mut forged = masked_input(&layout, &m.policy, &signer, 8);
    forged.seeds = masked_input(&layout, &m.policy, &signer, 9).seeds;
    batch.push(&forged);
    for service in 0..3 {
        let answer = prepare(&m, service, &batch).await;
        assert_eq!(answer.status(), 200, "{}", answer.text().await.unwrap());
        let counts: PrepareAnswer = answer.json().await.unwrap();
        assert_eq!(
            (counts.prepared, counts.held, counts.refused),
            (DEVICES as u64, 0, 1),
            "service {service}"
        );
        // The same batch again: held already, nothing added twice.
        let again: PrepareAnswer = prepare(&m, service, &batch).await.json().await.unwrap();
        assert_eq!(
            (again.prepared, again.held, again.refused),
            (0, DEVICES as u64, 1)
        );
    }

    let receipts = m.agreed().await;
    // A sums request with one input's seeds swapped for seeds no token binds is refused with
    // the same answer from the prepared round (service 1's first computation) as from nothing
    // (its second: a preparation is used once).
    let mut swapped = m.inputs.clone();
    swapped[1].seeds = forged.seeds.clone();
    let mut refusals = Vec::new();
    for _ in 0..2 {
        let refused = m
            .post(0, "sums", &m.sums_request(0, &receipts, &swapped))
            .await;
        refusals.push((refused.status(), refused.text().await.unwrap()));
    }
    assert_eq!(refusals[0].0, 403);
    assert!(refusals[0].1.contains("device token"), "{}", refusals[0].1);
    assert_eq!(refusals[0], refusals[1]);
    let (unmasked, exact) = m.unmasked_by_all(&receipts, variance).await;
    assert_eq!(unmasked, noised(&m, variance, &exact));

    // The set is agreed: a late batch is refused, and nothing is prepared.
    let late = prepare(&m, 0, &batch).await;
    assert_eq!(late.status(), 409);
    assert!(
        late.text()
            .await
            .unwrap()
            .contains("nothing more to prepare")
    );
}

/// A prepare request is checked as the sums are, but for the commitment: a policy of another
/// task, or no inputs, or a length out of range is refused with what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepare_request_that_does_not_fit_the_round_is_refused() {
    let m = released_with(None).await;
    let all: Vec<&Input> = m.inputs.iter().collect();
    let mut other_task = prepare_request(&m, 0, &all);
    other_task.task_id = "task-2".into();
    let answer = m.post(0, "prepare", &other_task).await;
    assert_eq!(answer.status(), 400);
    assert!(
        answer
            .text()
            .await
            .unwrap()
            .contains("the request names task task-2")
    );

    let empty = prepare_request(&m, 0, &[]);
    let answer = m.post(0, "prepare", &empty).await;
    assert_eq!(answer.status(), 400);
    assert!(answer.text().await.unwrap().contains("1 to 4096"));

    let mut no_values = prepare_request(&m, 0, &all);
    no_values.values = 0;
    let answer = m.post(0, "prepare", &no_values).await;
    assert_eq!(answer.status(), 400);
    assert!(answer.text().await.unwrap().contains("`values` must be"));

    // Prepared under another length: not used, and the sums are still right.
    let mut longer = prepare_request(&m, 0, &all);
    longer.values = VALUES as u64 + 1;
    let answer = m.post(0, "prepare", &longer).await;
    assert_eq!(answer.status(), 200);
    let counts: PrepareAnswer = answer.json().await.unwrap();
    // The seeds' context names the length: they do not open under another.
    assert_eq!(counts.refused, DEVICES as u64);
    // One input twice in a request, and a ref that is not a digest: each refused on its own.
    let mut doubled = prepare_request(&m, 0, &all);
    doubled.inputs.push(doubled.inputs[0].clone());
    let mut not_a_ref = doubled.inputs[1].clone();
    not_a_ref.assignment_ref = "device-1".into();
    doubled.inputs.push(not_a_ref);
    let counts: PrepareAnswer = m.post(0, "prepare", &doubled).await.json().await.unwrap();
    assert_eq!(
        (counts.prepared, counts.held, counts.refused),
        (DEVICES as u64, 0, 2)
    );
    // Service 2's own items sent to service 1: its seeds' digest is not the one listed.
    let mut foreign = prepare_request(&m, 1, &all);
    foreign.values = VALUES as u64;
    let counts: PrepareAnswer = m.post(1, "prepare", &foreign).await.json().await.unwrap();
    assert_eq!(
        counts.prepared, DEVICES as u64,
        "service 2's own items are its to add"
    );
    let foreign = prepare_request(&m, 1, &all);
    let counts: PrepareAnswer = m.post(2, "prepare", &foreign).await.json().await.unwrap();
    assert_eq!((counts.prepared, counts.refused), (0, DEVICES as u64));
    let receipts = m.agreed().await;
    let (unmasked, exact) = m.unmasked_by_all(&receipts, 0).await;
    assert_eq!(unmasked, exact);
}
