//! What the front end checks before it commits a release an enclave worker hands it: that the
//! release came from an attested enclave that t key services agreed to, for this round, under
//! this task's policy and base model. A worker token is enough to call the worker API; it is not
//! enough to publish a release the enclave did not make.
//!
//! The same check, offline and against the partner's own trust file rather than the front end's
//! view of the key services, is `confed verify release` (`src/verify.rs`).

use confed_attestation::exchange::decode_verifying_key;
use confed_attestation::release::{KeySetShape, ReleaseCommitment, TrustedSigner};
use confed_protocol::policy::sha256_hex;
use confed_worker_api::manifest::Manifest;
use confed_worker_api::store::StagedRelease;

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

/// A staged release that `verify_staged` accepted: what the database records of it.
#[derive(Debug)]
pub struct Verified {
    /// The release's proof, as JSON to store.
    pub proof_json: String,
    /// Lowercase hex SHA-256 of the average's bytes (the manifest's `average_sha256`).
    pub average_sha256: String,
}

/// Checks a staged release against the job it claims to be for; returns what to record of it,
/// or why it is refused.
pub fn verify_staged(
    keys: &KeyDirectory,
    context: &JobContext,
    release: &StagedRelease<'_>,
) -> Result<Verified, String> {
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
    let key_set = key_set_of(keys, key_id)
        .ok_or_else(|| format!("key {key_id} is not published by the key services"))?;
    let check = check_proof(
        keys,
        release.proof,
        manifest,
        &sha256_hex(&manifest.to_json()),
        &average_sha256,
        key_set,
    );
    if !check.failures.is_empty() {
        return Err(format!(
            "the release's proof does not verify: {}",
            check.failures.join("; ")
        ));
    }
    Ok(Verified {
        proof_json: serde_json::to_string(release.proof).map_err(|e| e.to_string())?,
        average_sha256,
    })
}

/// The key set the front end pins for `key_id`: the threshold of the key entry that at least
/// its threshold of the configured key services signed (`KeyDirectory::signed_shape`; devices
/// accept the same entry only with t signatures), and as n the most that any validly signed
/// entry of the key states, at least its holders: t colluding key services that sign an entry
/// saying n = t (so that only theirs reaches its threshold) do not lower the quorum to t while
/// an honest holder says n. Never a receipt's word.
pub fn key_set_of(keys: &KeyDirectory, key_id: &str) -> Option<KeySetShape> {
    let (threshold, shares) = keys.signed_shape(key_id)?;
    Some(KeySetShape::new(
        usize::from(threshold),
        usize::from(shares),
    ))
}

/// A release's proof checked against the key services `keys` publishes: the enclave's
/// signature over `manifest_sha256` and `average_sha256`, and a quorum of receipts for the
/// manifest's commitment, under the key set `key_set` (`key_set_of`).
fn check_proof(
    keys: &KeyDirectory,
    proof: &confed_attestation::release::ReleaseProof,
    manifest: &Manifest,
    manifest_sha256: &str,
    average_sha256: &str,
    key_set: KeySetShape,
) -> confed_attestation::release::ProofCheck {
    let signers = keys.verifying_keys();
    let trusted: Vec<TrustedSigner<'_>> = signers
        .iter()
        .map(|(id, key)| TrustedSigner {
            id,
            verifying_key: key,
        })
        .collect();
    proof.check(
        &commitment_of(manifest),
        manifest_sha256,
        average_sha256,
        &trusted,
        key_set,
    )
}

/// What a stored release comes to when checked again against the key services this server
/// knows now (the console's proof column), with its manifest when it parses.
#[derive(Debug, Clone)]
pub struct StoredCheck {
    pub lines: Vec<String>,
    pub failures: Vec<String>,
    /// The manifest the enclave signed: where the console takes a release's numbers from.
    pub manifest: Option<Manifest>,
}

/// Re-checks a committed release as the commit did (`verify_staged`) and as a partner would:
/// its manifest is for this task and round, under this task's policy, from model version
/// `round - 1` (`base_model_sha256`), names the stored average, and its proof (the enclave's
/// signature and a quorum of receipts) verifies against `keys`. A row copied from another
/// round, task or tenant, or a task whose stored definition changed, fails here. This is the
/// server's own view; a partner's independent check is `confed verify release`.
pub fn check_stored(
    keys: &KeyDirectory,
    task: &crate::db::TaskRecord,
    base_model_sha256: Option<&str>,
    release: &crate::db::jobs::ReleaseRecord,
) -> StoredCheck {
    let mut out = StoredCheck {
        lines: Vec::new(),
        failures: Vec::new(),
        manifest: None,
    };
    let note = |out: &mut StoredCheck, ok: bool, what: String| {
        out.lines
            .push(format!("{}: {what}", if ok { "ok" } else { "FAILED" }));
        if !ok {
            out.failures.push(what);
        }
    };
    let manifest: Manifest = match serde_json::from_str(&release.manifest_json) {
        Ok(manifest) => manifest,
        Err(e) => {
            note(
                &mut out,
                false,
                format!("the stored manifest does not parse: {e}"),
            );
            return out;
        }
    };
    note(
        &mut out,
        manifest.task_id == task.id
            && confed_protocol::ids::wire_round(release.round_number) == Some(manifest.round),
        format!(
            "the manifest is for task {} round {} (this is task {} round {})",
            manifest.task_id, manifest.round, task.id, release.round_number
        ),
    );
    let policy_sha256 = task.spec.policy(&task.id, &task.tenant_id).sha256_hex();
    note(
        &mut out,
        manifest.policy_sha256 == policy_sha256,
        format!("the manifest names this task's policy ({policy_sha256})"),
    );
    note(
        &mut out,
        base_model_sha256 == Some(manifest.model_sha256.as_str()),
        format!(
            "the manifest's base model {} is model version {}",
            manifest.model_sha256,
            task.spec.base_model_version(release.round_number)
        ),
    );
    note(
        &mut out,
        manifest.average_sha256 == release.average_sha256,
        format!(
            "the manifest names the stored average ({})",
            release.average_sha256
        ),
    );
    let proof = match release
        .proof_json
        .as_deref()
        .map(serde_json::from_str::<confed_attestation::release::ReleaseProof>)
    {
        Some(Ok(proof)) => proof,
        Some(Err(e)) => {
            note(
                &mut out,
                false,
                format!("the stored proof does not parse: {e}"),
            );
            out.manifest = Some(manifest);
            return out;
        }
        None => {
            note(
                &mut out,
                false,
                "the release carries no proof (it predates signed releases)".into(),
            );
            out.manifest = Some(manifest);
            return out;
        }
    };
    match key_set_of(keys, &manifest.key_id) {
        None => note(
            &mut out,
            false,
            format!(
                "key {} is no longer published by the key services; check this release with `confed verify release`",
                manifest.key_id
            ),
        ),
        Some(key_set) => {
            let check = check_proof(
                keys,
                &proof,
                &manifest,
                &sha256_hex(release.manifest_json.as_bytes()),
                &release.average_sha256,
                key_set,
            );
            out.lines.extend(check.lines);
            out.failures.extend(check.failures);
        }
    }
    out.manifest = Some(manifest);
    out
}

/// Decodes a published verifying key (helper for callers holding key-set text).
pub fn verifying_key(text: &str) -> Option<p256::ecdsa::VerifyingKey> {
    decode_verifying_key(text)
}

#[cfg(test)]
mod tests;
