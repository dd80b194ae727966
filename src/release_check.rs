//! What the front end checks before it commits a release an enclave worker hands it: that the
//! release came from an attested enclave that t key services agreed to, for this round, under
//! this task's policy and base model. A worker token is enough to call the worker API; it is not
//! enough to publish a release the enclave did not make.
//!
//! The same check, offline and against the partner's own trust file rather than the front end's
//! view of the key services, is `confed verify release` (`src/verify.rs`).

use confed_attestation::exchange::decode_verifying_key;
use confed_attestation::release::{ReleaseCommitment, TrustedSigner};
use confed_enclave::aggregate::Manifest;
use confed_enclave::policy::sha256_hex;
use confed_enclave::worker::StagedRelease;

use crate::db::jobs::JobContext;
use crate::keys::directory::KeyDirectory;

/// The commitment a manifest states.
pub fn commitment_of(manifest: &Manifest) -> ReleaseCommitment {
    ReleaseCommitment {
        task_id: manifest.task_id.clone(),
        round: manifest.round,
        key_id: manifest.key_id.clone(),
        policy_sha256: manifest.policy_sha256.clone(),
        model_sha256: manifest.model_sha256.clone(),
        inputs_digest: manifest.inputs_digest.clone(),
    }
}

/// Checks a staged release against the job it claims to be for; returns its proof as JSON to
/// store, or why it is refused.
pub fn verify_staged(
    keys: &KeyDirectory,
    context: &JobContext,
    release: &StagedRelease<'_>,
) -> Result<String, String> {
    let manifest = release.manifest;
    let task = &context.task;
    if manifest.task_id != task.id
        || Some(manifest.round) != confed_protocol::ids::wire_round(context.round.round_number)
    {
        return Err(format!(
            "the manifest is for task {} round {}, the job for task {} round {}",
            manifest.task_id, manifest.round, task.id, context.round.round_number
        ));
    }
    let policy_sha256 = task.spec.policy(&task.id, &task.tenant_id).sha256_hex();
    if manifest.policy_sha256 != policy_sha256 {
        return Err(format!(
            "the manifest's policy {} is not this task's ({policy_sha256})",
            manifest.policy_sha256
        ));
    }
    if manifest.model_sha256 != context.model.sha256_hex {
        return Err(format!(
            "the manifest's base model {} is not model version {} ({})",
            manifest.model_sha256, context.model.version, context.model.sha256_hex
        ));
    }
    let average_sha256 = sha256_hex(release.average);
    if average_sha256 != manifest.average_sha256 {
        return Err("the average's bytes do not hash to the manifest's average_sha256".into());
    }
    let key_id = context.key_id.as_deref().unwrap_or_default();
    let threshold = keys
        .key(key_id)
        .map(|k| usize::from(k.threshold))
        .ok_or_else(|| format!("key {key_id} is not published by the key services"))?;
    let signers = keys.verifying_keys();
    let trusted: Vec<TrustedSigner<'_>> = signers
        .iter()
        .map(|(id, key)| TrustedSigner {
            id,
            verifying_key: key,
        })
        .collect();
    let check = release.proof.check(
        &commitment_of(manifest),
        &sha256_hex(&manifest.to_json()),
        &average_sha256,
        &trusted,
        threshold,
    );
    if !check.failures.is_empty() {
        return Err(format!(
            "the release's proof does not verify: {}",
            check.failures.join("; ")
        ));
    }
    serde_json::to_string(release.proof).map_err(|e| e.to_string())
}

/// What a stored release's proof comes to when checked again against the key services this
/// server knows now (the console's verification column).
#[derive(Debug, Clone)]
pub struct StoredCheck {
    pub lines: Vec<String>,
    pub failures: Vec<String>,
}

/// Re-checks a committed release: its manifest parses and names the stored average, and its
/// proof (the enclave's signature and a quorum of receipts) verifies against `keys`. This is
/// the server's own view; a partner's independent check is `confed verify release`.
pub fn check_stored(keys: &KeyDirectory, release: &crate::db::jobs::ReleaseRecord) -> StoredCheck {
    let failed = |what: String| StoredCheck {
        lines: vec![format!("FAILED: {what}")],
        failures: vec![what],
    };
    let Some(proof_json) = &release.proof_json else {
        return failed("the release carries no proof (it predates signed releases)".into());
    };
    let proof: confed_attestation::release::ReleaseProof = match serde_json::from_str(proof_json) {
        Ok(proof) => proof,
        Err(e) => return failed(format!("the stored proof does not parse: {e}")),
    };
    let manifest: Manifest = match serde_json::from_str(&release.manifest_json) {
        Ok(manifest) => manifest,
        Err(e) => return failed(format!("the stored manifest does not parse: {e}")),
    };
    if manifest.average_sha256 != release.average_sha256 {
        return failed("the manifest names another average than the one stored".into());
    }
    let Some(key) = keys.key(&manifest.key_id) else {
        return failed(format!(
            "key {} is no longer published by the key services; check this release with `confed verify release`",
            manifest.key_id
        ));
    };
    let signers = keys.verifying_keys();
    let trusted: Vec<TrustedSigner<'_>> = signers
        .iter()
        .map(|(id, key)| TrustedSigner {
            id,
            verifying_key: key,
        })
        .collect();
    let check = proof.check(
        &commitment_of(&manifest),
        &sha256_hex(release.manifest_json.as_bytes()),
        &release.average_sha256,
        &trusted,
        usize::from(key.threshold),
    );
    StoredCheck {
        lines: check.lines,
        failures: check.failures,
    }
}

/// Decodes a published verifying key (helper for callers holding key-set text).
pub fn verifying_key(text: &str) -> Option<p256::ecdsa::VerifyingKey> {
    decode_verifying_key(text)
}
