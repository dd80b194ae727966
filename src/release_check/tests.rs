//! The key set a release is checked against is the verifier's own (the front end's key entry and
//! configured key services, a partner's trust file), never the receipts': t colluding key
//! services whose share files say n = t must not lower the quorum to t.

use super::*;
use confed_attestation::exchange::{
    KeySet, SignedPublicKey, encode_verifying_key, generate_signing_key, sign_key,
};
use confed_attestation::release::{
    Receipt, ReleaseProof, ReleaseSignature, release_text, sign_text,
};
use confed_protocol::trust::{TrustConfig, TrustedEntry};
use p256::ecdsa::SigningKey;

const KEY: &str = "k1";

struct Scene {
    keys: KeyDirectory,
    services: Vec<(String, SigningKey)>,
    manifest: Manifest,
    average: Vec<u8>,
}

/// Key service `id`'s signed entry for the key, stating 2 of `shares`.
fn signed_entry(id: &str, signing: &SigningKey, shares: u16) -> SignedPublicKey {
    let mut entry = SignedPublicKey {
        key_id: KEY.into(),
        suite: confed_protocol::hpke::SUITE.into(),
        public_key: "AAAA".into(),
        not_before: 0,
        not_after: i64::MAX,
        threshold: 2,
        shares,
        state: "active".into(),
        signature: String::new(),
    };
    sign_key(signing, id, &mut entry);
    entry
}

/// Three key services vouching for one 2-of-3 key, and a manifest for round 1 of task t1.
fn scene() -> Scene {
    let services: Vec<(String, SigningKey)> = (1..=3)
        .map(|i| (format!("ks{i}"), generate_signing_key()))
        .collect();
    let sets = services
        .iter()
        .map(|(id, signing)| KeySet {
            keyservice_id: id.clone(),
            verifying_key: encode_verifying_key(signing.verifying_key()),
            keys: vec![signed_entry(id, signing, 3)],
            masking_key: None,
        })
        .collect();
    let average = b"the noised average".to_vec();
    let manifest: Manifest = serde_json::from_value(serde_json::json!({
        "format": "confed-release/v2", "task_id": "t1", "round": 1, "key_id": KEY,
        "policy_sha256": "a".repeat(64), "model_sha256": "b".repeat(64),
        "included": 3, "included_digest": "0".repeat(64), "inputs_digest": "c".repeat(64),
        "excluded": {}, "excluded_refs": [], "clip_norm": 1.0,
        "noise": {"mechanism": "discrete_gaussian_on_grid", "grid_units_per_clip": 65536,
                  "variance_grid": 1, "stddev_sum": 0.0, "stddev_average": 0.0},
        "privacy": {"epsilon_budget": 8.0, "delta": 1e-6, "rounds_planned": 3,
                    "noise_multiplier": 0.0, "rho_round": 0.0, "rho_spent": 0.0,
                    "epsilon_spent": 0.0},
        "average_sha256": sha256_hex(&average),
    }))
    .unwrap();
    Scene {
        keys: KeyDirectory::fixed(sets),
        services,
        manifest,
        average,
    }
}

/// A proof signed by a real enclave key, with receipts of the services `from` (their real
/// signing keys) stating `threshold` of `shares`.
fn proof(scene: &Scene, from: &[usize], threshold: u16, shares: u16) -> ReleaseProof {
    let commitment = commitment_of(&scene.manifest);
    let enclave = generate_signing_key();
    let enclave_key = encode_verifying_key(enclave.verifying_key());
    let receipts = from
        .iter()
        .map(|&i| {
            let (id, signing) = &scene.services[i];
            let mut receipt = Receipt {
                keyservice_id: id.clone(),
                key_id: KEY.into(),
                task_id: "t1".into(),
                round: 1,
                commitment_sha256: commitment.digest(),
                enclave_signing_key: enclave_key.clone(),
                image_digest: "none".into(),
                policy: "dev".into(),
                threshold,
                shares,
                at: 0,
                signature: String::new(),
            };
            receipt.sign(signing);
            receipt
        })
        .collect();
    ReleaseProof {
        enclave: ReleaseSignature {
            enclave_signing_key: enclave_key,
            signature: sign_text(
                &enclave,
                &release_text(
                    &commitment,
                    &sha256_hex(&scene.manifest.to_json()),
                    &scene.manifest.average_sha256,
                ),
            ),
        },
        commitment,
        receipts,
    }
}

fn front_end_check(scene: &Scene, proof: &ReleaseProof) -> Vec<String> {
    let key_set = key_set_of(&scene.keys, KEY).unwrap();
    check_proof(
        &scene.keys,
        proof,
        &scene.manifest,
        &sha256_hex(&scene.manifest.to_json()),
        &scene.manifest.average_sha256,
        key_set,
    )
    .failures
}

fn trust(scene: &Scene, listed: usize, shares: Option<usize>) -> TrustConfig {
    TrustConfig {
        threshold: 2,
        keyservices: scene
            .services
            .iter()
            .take(listed)
            .map(|(id, signing)| TrustedEntry {
                id: id.clone(),
                verifying_key: encode_verifying_key(signing.verifying_key()),
            })
            .collect(),
        shares,
        limits: confed_protocol::policy::DeviceLimits::ENCLAVE,
        tenant_id: None,
        token_issuers: Vec::new(),
        require_masking: false,
        require_distributed_noise: false,
    }
}

fn verify(
    scene: &Scene,
    proof: &ReleaseProof,
    trust: &TrustConfig,
) -> Result<crate::verify::Verified, crate::verify::VerifyError> {
    crate::verify::check(
        proof,
        &scene.manifest.to_json(),
        &scene.average,
        "t1",
        1,
        trust,
    )
}

fn partner_check(scene: &Scene, proof: &ReleaseProof, shares: Option<usize>) -> Vec<String> {
    verify(scene, proof, &trust(scene, 3, shares))
        .unwrap()
        .failures
}

/// One key service publishing another entry for the key (2 of 2), or the same entry twice,
/// does not move what the front end pins: that takes t distinct valid signatures.
#[test]
fn one_key_service_cannot_change_the_pinned_key_set() {
    let scene = scene();
    let mut sets = Vec::new();
    for (i, (id, signing)) in scene.services.iter().enumerate() {
        let entry = signed_entry(id, signing, if i == 0 { 2 } else { 3 });
        let keys = if i == 0 {
            vec![entry.clone(), entry.clone(), entry]
        } else {
            vec![entry]
        };
        sets.push(KeySet {
            keyservice_id: id.clone(),
            verifying_key: encode_verifying_key(signing.verifying_key()),
            keys,
            masking_key: None,
        });
    }
    let keys = KeyDirectory::fixed(sets.clone());
    assert_eq!(key_set_of(&keys, KEY), Some(KeySetShape::new(2, 3)));
    // An entry whose signature does not verify counts for nothing.
    sets[1].keys[0].signature = sets[2].keys[0].signature.clone();
    assert_eq!(key_set_of(&KeyDirectory::fixed(sets), KEY), None);
}

#[test]
fn the_front_end_pins_the_key_entrys_threshold_and_shares() {
    let scene = scene();
    assert_eq!(key_set_of(&scene.keys, KEY), Some(KeySetShape::new(2, 3)));
    assert!(front_end_check(&scene, &proof(&scene, &[0, 1, 2], 2, 3)).is_empty());
    // Two colluding key services whose share files say 2 of 2: a quorum of 2 if believed.
    let colluding = proof(&scene, &[0, 1], 2, 2);
    let failures = front_end_check(&scene, &colluding);
    assert!(
        failures
            .iter()
            .any(|f| f.contains("states threshold 2 of 2 shares; the trust file pins 2 of 3")),
        "{failures:?}"
    );
    assert!(
        failures.iter().any(|f| f.contains("0 of the 3")),
        "{failures:?}"
    );
    // Honest receipts, but too few for 2 of 3.
    let two = front_end_check(&scene, &proof(&scene, &[0, 1], 2, 3));
    assert!(two.iter().any(|f| f.contains("2 of the 3")), "{two:?}");
}

/// Issue 45: t lying key services sign an entry saying 2 of 2 (the honest one's 2 of 3 has one
/// signature, below its threshold, so theirs is the only entry that counts) and return receipts
/// that say the same. The front end takes n = 3 from the honest holder's signed entry (and the
/// three holders) and refuses.
#[test]
fn the_front_end_pins_n_from_every_holder_when_the_key_entries_lie() {
    let mut scene = scene();
    let sets: Vec<KeySet> = scene
        .services
        .iter()
        .enumerate()
        .map(|(i, (id, signing))| KeySet {
            keyservice_id: id.clone(),
            verifying_key: encode_verifying_key(signing.verifying_key()),
            keys: vec![signed_entry(id, signing, if i < 2 { 2 } else { 3 })],
            masking_key: None,
        })
        .collect();
    scene.keys = KeyDirectory::fixed(sets.clone());
    assert_eq!(key_set_of(&scene.keys, KEY), Some(KeySetShape::new(2, 3)));
    // Even with the honest holder's entry gone, three holders list the key: n stays 3.
    let mut two_say_two = sets;
    two_say_two[2].keys[0] = signed_entry(&scene.services[2].0, &scene.services[2].1, 2);
    assert_eq!(
        key_set_of(&KeyDirectory::fixed(two_say_two), KEY),
        Some(KeySetShape::new(2, 3))
    );
    let failures = front_end_check(&scene, &proof(&scene, &[0, 1], 2, 2));
    assert!(
        failures.iter().any(|f| f.contains("pins 2 of 3")),
        "{failures:?}"
    );
}

#[test]
fn confed_verify_takes_t_and_n_from_the_trust_file_only() {
    let scene = scene();
    assert!(partner_check(&scene, &proof(&scene, &[0, 1, 2], 2, 3), None).is_empty());
    let colluding = proof(&scene, &[0, 1], 2, 2);
    for shares in [None, Some(3)] {
        let failures = partner_check(&scene, &colluding, shares);
        assert!(
            failures
                .iter()
                .any(|f| f.contains("the trust file pins 2 of 3")),
            "{shares:?}: {failures:?}"
        );
    }
    // A trust file of two key services that says 2 of 2 accepts 2-of-2 receipts, and refuses
    // 2-of-3 ones.
    let two_of_two = trust(&scene, 2, Some(2));
    assert!(
        verify(&scene, &colluding, &two_of_two)
            .unwrap()
            .failures
            .is_empty()
    );
    let honest = proof(&scene, &[0, 1, 2], 2, 3);
    assert!(
        !verify(&scene, &honest, &two_of_two)
            .unwrap()
            .failures
            .is_empty()
    );
    // A trust file whose n is below the key services it lists would lower the quorum: refused.
    assert!(matches!(
        verify(&scene, &honest, &trust(&scene, 3, Some(2))),
        Err(crate::verify::VerifyError::Trust(_))
    ));
}

/// `confed verify release` states a DP-FTRL release's guarantee (the accounted noise), not only
/// the noise the release itself carries.
#[test]
fn confed_verify_states_a_tree_releases_accounted_noise() {
    let mut scene = scene();
    scene.manifest.noise.stddev_sum = 1.175;
    scene.manifest.noise.tree = Some(confed_worker_api::manifest::TreeRecord {
        length: 8,
        tree: 0,
        position: 4,
        nodes: 7,
        prefix_stddev_sum: 0.9,
        accounted_stddev_sum: Some(0.5),
        accounted_depth: Some(4),
    });
    let proof = proof(&scene, &[0, 1, 2], 2, 3);
    let verified = verify(&scene, &proof, &trust(&scene, 3, None)).unwrap();
    assert!(verified.failures.is_empty(), "{:?}", verified.failures);
    let line = &verified.lines[0];
    assert!(
        line.starts_with("noise: the accounting guarantees 0.500000")
            && line.contains("carries 1.175000"),
        "the guarantee comes first: {line}"
    );
}

/// The same for a BLT release (issue 45): its round 1 states the fresh noise as its own, and
/// the guarantee over the task's planned rounds is printed first.
#[test]
fn confed_verify_states_a_blt_releases_accounted_noise_first() {
    let mut scene = scene();
    scene.manifest.noise.stddev_sum = 1.29;
    scene.manifest.noise.blt = Some(confed_worker_api::manifest::BltRecord {
        buffers: 2,
        lattice_bits: 3,
        max_values: 1000,
        state_in_blake3: None,
        state_out_blake3: "0".repeat(64),
        prefix_stddev_sum: 1.29,
        sensitivity: 1.2,
        accounted_stddev_sum: Some(0.8),
        accounted_sensitivity: Some(1.6125),
    });
    let proof = proof(&scene, &[0, 1, 2], 2, 3);
    let verified = verify(&scene, &proof, &trust(&scene, 3, None)).unwrap();
    assert!(verified.failures.is_empty(), "{:?}", verified.failures);
    let line = &verified.lines[0];
    assert!(
        line.starts_with("noise: the accounting guarantees 0.800000")
            && line.contains("3 planned rounds")
            && line.contains("carries 1.290000"),
        "{line}"
    );
}

/// A masked release with distributed noise: the guarantee (one group's draw, which the enclave
/// and `q - 1` key services miss) goes first, then what the release carries.
#[test]
fn confed_verify_states_a_distributed_noise_releases_guarantee_first() {
    let mut scene = scene();
    let clip = scene.manifest.clip_norm;
    scene.manifest.noise.mechanism = confed_worker_api::manifest::DISTRIBUTED_MECHANISM.into();
    scene.manifest.noise.variance_grid = 1 << 32;
    scene.manifest.noise.stddev_sum = 3f64.sqrt() * clip;
    scene.manifest.masking = Some(confed_worker_api::manifest::MaskingRecord {
        scheme: "confed-masking/v1".into(),
        services: 3,
        threshold: 2,
        quorum: 3,
        groups: 3,
        answered: vec![1, 2, 3],
        noise_variance_grid: Some(1 << 32),
    });
    let proof = proof(&scene, &[0, 1, 2], 2, 3);
    let verified = verify(&scene, &proof, &trust(&scene, 3, None)).unwrap();
    assert!(verified.failures.is_empty(), "{:?}", verified.failures);
    let line = &verified.lines[0];
    assert!(
        line.starts_with("noise: distributed: each of the 3 groups")
            && line.contains(&format!("guarantees {clip:.6}"))
            && line.contains("the enclave and 2 key services")
            && line.contains(&format!("carries {:.6}", 3f64.sqrt() * clip)),
        "{line}"
    );
}
