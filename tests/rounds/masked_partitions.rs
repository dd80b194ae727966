//! A masked round (`secure_aggregation`) cut into partitions, end to end in one process
//! (docs/secure-aggregation.md, "Partitioned masked rounds"): devices with tokens mask and seal
//! their seeds, the store cuts the round in two, a worker of its own seals each partition's
//! wrapping sum and its inputs' slots, and the root merges them and runs the one unmask; the
//! release is byte for byte the one a single worker makes over the whole round, and the key
//! services see one agreed set.

use crate::common;

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::issuer::{ISSUER, issuer, signer};
use common::system::{collect_trusting, create_task_with, now_clock, start_partitioned};
use confed::aggregation::partitions::PartitionPolicy;
use confed_enclave::worker::{Phases, round_context};
use confed_worker_api::model::validate_model;
use confed_worker_api::store::{JobSpec, JobStore, Partitioning};
use serde_json::json;

const LEASE: Duration = Duration::from_secs(60);
const DEVICES: usize = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_masked_round_in_two_partitions_releases_the_bytes_one_worker_would() {
    let clock = now_clock();
    let partitioning = PartitionPolicy {
        workers: 4,
        min_contributions: 50,
    };
    let (system, _dir) = start_partitioned(clock.clone(), None, None, partitioning).await;
    let issuer_state = tempfile::tempdir().unwrap();
    let issuer_url = issuer(issuer_state.path(), clock.clone()).await;
    let spki = URL_SAFE_NO_PAD.encode(signer().spki());
    let token = system.tenant("tenant-masked-parts").await.unwrap();
    let task = create_task_with(
        &system.url,
        &token,
        "masked-parts",
        50.0,
        DEVICES,
        json!({
            "device_auth": {"issuer": ISSUER, "token_keys": [spki]},
            "secure_aggregation": true,
        }),
    )
    .await;
    let mut trust = system.trust.clone();
    trust.token_issuers.push(
        confed::tools::issuer::trusted_issuer(&issuer_url)
            .await
            .unwrap(),
    );
    collect_trusting(&system, "masked-parts", 3, false, DEVICES, trust).await;

    // A worker per partition: each seals its range, and says nothing of its outcomes.
    for worker in 0..2 {
        let outcome = system
            .worker(&format!("w{worker}"))
            .run_once()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(outcome.partition.map(|(_, count)| count), Some(2));
        assert_eq!((outcome.included, outcome.excluded), (0, 0));
    }
    let root = system.store.lease("probe", LEASE).await.unwrap().unwrap();
    assert!(
        matches!(
            &root.partitioning,
            Some(Partitioning::Root { count: 2, .. })
        ),
        "{:?}",
        root.partitioning
    );
    // The root merges what the store lists: a list naming one partition twice (and the other
    // not) fails, so the root cannot have opened the contributions itself.
    let Some(Partitioning::Root { sealed_keys, .. }) = &root.partitioning else {
        unreachable!()
    };
    let doubled = JobSpec {
        partitioning: Some(Partitioning::Root {
            count: 2,
            sealed_keys: vec![sealed_keys[0].clone(), sealed_keys[0].clone()],
        }),
        ..root.clone()
    };
    let (policy, context) = round_context(&root).unwrap();
    let schema = validate_model(&root.model).unwrap();
    let probe = system.worker("probe");
    let refused = probe
        .aggregate(
            &doubled,
            &schema,
            &policy,
            context.clone(),
            &mut Phases::default(),
        )
        .await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("sealed twice")),
        "{:?}",
        refused.map(|_| ())
    );
    // One worker over the whole round, and the root over the partitions: the same bytes. Both
    // unmask the same included set, so the key services agree once and answer the repeat.
    let whole_job = JobSpec {
        partitioning: None,
        ..root.clone()
    };
    let (whole, _) = probe
        .aggregate(
            &whole_job,
            &schema,
            &policy,
            context.clone(),
            &mut Phases::default(),
        )
        .await
        .unwrap();
    let (merged, _) = probe
        .aggregate(&root, &schema, &policy, context, &mut Phases::default())
        .await
        .unwrap();
    assert_eq!(merged.average, whole.average);
    assert_eq!(merged.manifest.to_json(), whole.manifest.to_json());
    assert_eq!(merged.manifest.included, DEVICES as u64);
    // Partitions, root and one worker commit to the inputs and the sampler alike.
    assert_eq!(
        merged.manifest.inputs_digest,
        common::system::gaussian_inputs_digest(&root)
    );
    let masking = merged.manifest.masking.as_ref().expect("a masked release");
    assert_eq!(masking.answered, vec![1, 2, 3]);
    // The probe's lease lapses; a worker takes the root and commits those bytes.
    clock.advance(LEASE + Duration::from_secs(1));
    let outcome = system.worker("w1").run_once().await.unwrap().unwrap();
    assert_eq!(
        (outcome.partition, outcome.included),
        (None, DEVICES as u64)
    );
    let releases = system.db.releases_of_task(&task).await.unwrap();
    assert_eq!(
        releases[0].manifest_json.as_bytes(),
        &whole.manifest.to_json()[..]
    );
    let average = system.store.blob(&releases[0].average_key).await.unwrap();
    assert_eq!(average.as_deref(), Some(&whole.average[..]));
}
