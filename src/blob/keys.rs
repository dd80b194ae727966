//! Every layout of the blob store's object names, in one place. A key names its tenant, task and
//! round, so one prefix holds a task's objects; the layouts are stored data (and GCS lifecycle
//! rules match them: `contributions/` by prefix, `.partition` by suffix,
//! deploy/gcp/terraform/storage.tf), so they never change within a deployment's life.
//!
//! A round attempt is spelled two ways, for history's sake and kept because objects exist under
//! both: contributions live under `rounds/{round}-{attempt}/` (they are deleted by retention,
//! round by round), everything the enclave writes for an attempt under
//! `rounds/{round}/attempt-{attempt}/` (kept; next to the round's other outputs).

use super::{BlobError, BlobKey};
use confed_protocol::ids::AssignmentRef;

impl BlobKey {
    /// Key of a task's model version, including the content hash so a retried upload after a
    /// crash never collides with an orphan of the first attempt.
    pub fn model(
        tenant_id: &str,
        task_id: &str,
        version: i64,
        sha256_hex: &str,
    ) -> Result<Self, BlobError> {
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/models/{version}-{sha256_hex}.safetensors"
        ))
    }

    /// The server optimizer's state after the round that made model `version`.
    pub fn optimizer_state(
        tenant_id: &str,
        task_id: &str,
        version: i64,
        sha256_hex: &str,
    ) -> Result<Self, BlobError> {
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/models/{version}-optimizer-{sha256_hex}.safetensors"
        ))
    }

    /// The sealed BLT state round `round` left, under its BLAKE3 (the release manifest's
    /// `noise.blt.state_out_blake3`).
    pub fn blt_state(
        tenant_id: &str,
        task_id: &str,
        round: i64,
        blake3_hex: &str,
    ) -> Result<Self, BlobError> {
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/rounds/{round}/blt-state-{blake3_hex}.sealed"
        ))
    }

    /// Partition `index` of `count` of a round attempt's aggregation, sealed by its enclave
    /// worker, under its BLAKE3. The `.partition` suffix is what GCS's lifecycle rule for them
    /// matches (deploy/gcp/terraform/storage.tf): only the round's merge reads one.
    pub fn partition(
        tenant_id: &str,
        task_id: &str,
        round: i64,
        attempt: i64,
        index: u32,
        count: u32,
        blake3_hex: &str,
    ) -> Result<Self, BlobError> {
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/rounds/{round}/attempt-{attempt}/partition-{index}-of-{count}-{blake3_hex}.partition"
        ))
    }

    /// Where a round attempt's release lives: its noised average and its manifest. Fixed names
    /// (no content hash): the blob store refuses a second, different release under the same
    /// name, on top of the database's one-release-per-round key.
    pub fn release(
        tenant_id: &str,
        task_id: &str,
        round: i64,
        attempt: i64,
    ) -> Result<(Self, Self), BlobError> {
        let base = format!("tenants/{tenant_id}/tasks/{task_id}/rounds/{round}/attempt-{attempt}");
        Ok((
            Self::new(format!("{base}/average.safetensors"))?,
            Self::new(format!("{base}/manifest.json"))?,
        ))
    }

    /// Where an assignment's contribution is stored. 256 subdirectories per round keep any one
    /// directory small and its lock uncontended.
    pub fn contribution(
        tenant_id: &str,
        task_id: &str,
        round: i64,
        attempt: i64,
        assignment: &AssignmentRef,
    ) -> Result<Self, BlobError> {
        let assignment = assignment.as_str();
        Self::new(format!(
            "tenants/{tenant_id}/tasks/{task_id}/rounds/{round}-{attempt}/contributions/{}/{assignment}.cbor",
            &assignment[..2.min(assignment.len())],
        ))
    }
}

/// Whether `key` has `BlobKey::partition`'s shape:
/// `tenants/{t}/tasks/{task}/rounds/{r}/attempt-{a}/partition-{i}-of-{k}-{blake3}.partition`.
pub fn is_partition_key(key: &str) -> bool {
    let parts: Vec<&str> = key.split('/').collect();
    matches!(
        parts.as_slice(),
        ["tenants", _, "tasks", _, "rounds", _, attempt, name]
            if attempt.starts_with("attempt-")
                && name.starts_with("partition-")
                && name.ends_with(".partition")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layouts_are_the_stored_ones() {
        let sha = "ab".repeat(32);
        let key = |k: Result<BlobKey, BlobError>| k.unwrap().as_str().to_string();
        assert_eq!(
            key(BlobKey::model("a", "t", 3, &sha)),
            format!("tenants/a/tasks/t/models/3-{sha}.safetensors")
        );
        assert_eq!(
            key(BlobKey::optimizer_state("a", "t", 3, &sha)),
            format!("tenants/a/tasks/t/models/3-optimizer-{sha}.safetensors")
        );
        assert_eq!(
            key(BlobKey::blt_state("a", "t", 3, &sha)),
            format!("tenants/a/tasks/t/rounds/3/blt-state-{sha}.sealed")
        );
        let partition = key(BlobKey::partition("a", "t", 3, 2, 0, 4, &sha));
        assert_eq!(
            partition,
            format!("tenants/a/tasks/t/rounds/3/attempt-2/partition-0-of-4-{sha}.partition")
        );
        assert!(is_partition_key(&partition));
        let (average, manifest) = BlobKey::release("a", "t", 3, 2).unwrap();
        assert_eq!(
            average.as_str(),
            "tenants/a/tasks/t/rounds/3/attempt-2/average.safetensors"
        );
        assert_eq!(
            manifest.as_str(),
            "tenants/a/tasks/t/rounds/3/attempt-2/manifest.json"
        );
        assert!(!is_partition_key(average.as_str()));
        let assignment = AssignmentRef::from_stored("Qx9z".into());
        assert_eq!(
            key(BlobKey::contribution("a", "t", 3, 2, &assignment)),
            "tenants/a/tasks/t/rounds/3-2/contributions/Qx/Qx9z.cbor"
        );
    }
}
