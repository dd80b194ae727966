//! A release forged by whoever holds the worker token: an average of its choice, a manifest that
//! names the right policy and model, an enclave signature and key-service receipts made with keys
//! of its own (the attack the front end's proof check exists for).

use confed::embedded::EmbeddedSystem;
use confed_attestation::release::ReleaseProof;
use confed_worker_api::manifest::Manifest;
use confed_worker_api::store::JobSpec;

use super::system::GOAL;

/// (average, manifest, proof) for round 1 of `job`'s task, none of it from an enclave.
pub(crate) async fn forged_release(
    system: &EmbeddedSystem,
    job: &JobSpec,
) -> (Vec<u8>, Manifest, ReleaseProof) {
    let context = system.db.round_context(&job.task_id, 1).await.unwrap();
    let schema = confed_worker_api::model::validate_model(&job.model).unwrap();
    let average =
        confed_enclave::aggregate::encode(&schema, &vec![0.5; schema.parameter_count()]).unwrap();
    let manifest_json = serde_json::json!({
        "format": "confed-release/v2", "task_id": job.task_id, "round": 1, "key_id": job.key_id,
        "policy_sha256": context.policy_sha256, "model_sha256": context.model_sha256,
        "included": GOAL, "included_digest": "0".repeat(64), "inputs_digest": "1".repeat(64),
        "excluded": {}, "excluded_refs": [], "clip_norm": 1.0,
        "noise": {"mechanism": "discrete_gaussian_on_grid", "grid_units_per_clip": 65536,
                  "variance_grid": 1, "stddev_sum": 0.0, "stddev_average": 0.0},
        "privacy": {"epsilon_budget": 8.0, "delta": 1e-6, "rounds_planned": 3,
                    "noise_multiplier": 0.0, "rho_round": 0.0, "rho_spent": 0.0, "epsilon_spent": 0.0},
        "average_sha256": confed_protocol::policy::sha256_hex(&average),
    });
    let manifest: Manifest = serde_json::from_value(manifest_json).unwrap();
    let commitment = confed::release_check::commitment_of(&manifest);
    let enclave = confed_attestation::exchange::generate_signing_key();
    let enclave_key = confed_attestation::exchange::encode_verifying_key(enclave.verifying_key());
    let receipts = system
        .keyservices
        .iter()
        .map(|service| {
            let mut receipt = confed_attestation::release::Receipt {
                keyservice_id: service.id.clone(),
                key_id: job.key_id.clone(),
                task_id: job.task_id.clone(),
                round: 1,
                commitment_sha256: commitment.digest(),
                enclave_signing_key: enclave_key.clone(),
                image_digest: "none".into(),
                policy: "dev".into(),
                threshold: 2,
                shares: 3,
                at: 0,
                signature: String::new(),
            };
            receipt.sign(&confed_attestation::exchange::generate_signing_key());
            receipt
        })
        .collect();
    let proof = confed_attestation::release::ReleaseProof {
        enclave: confed_attestation::release::ReleaseSignature {
            enclave_signing_key: enclave_key,
            signature: confed_attestation::release::sign_text(
                &enclave,
                &confed_attestation::release::release_text(
                    &commitment,
                    &confed_protocol::policy::sha256_hex(&manifest.to_json()),
                    &manifest.average_sha256,
                ),
            ),
        },
        commitment,
        receipts,
    };
    (average, manifest, proof)
}
