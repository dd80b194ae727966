//! The operator's acknowledgement that a key service's audit log lost records: a signed
//! `loss_acknowledged` record naming the head of what was lost, appended to the log as it is.
//!
//! A service whose log is behind its own checkpoint refuses to start, and one behind what a peer
//! witnessed grants nothing (`rollback.rs`); both name the lost head. Restoring the newer log is
//! the fix; when it is gone for good, this record lets the service grant again. Its ledger then
//! no longer knows the rounds committed in the lost records: the other key services' ledgers
//! still hold them (any two release quorums share t services, `ledger.rs`), and the record says
//! for every later reader of the log exactly what was accepted, when, and why.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::audit::{AuditError, AuditLog, Decision, LostHead, Record};
use crate::ledger::Ledger;

/// The decision name of an acknowledgement record.
pub const LOSS_ACKNOWLEDGED: &str = "loss_acknowledged";

/// Appends the acknowledgement of `lost` to the log at `path` (the service stopped). A local
/// checkpoint that names exactly `lost` is moved aside to `<checkpoint>.superseded-<records>`
/// first (it would refuse the open); any other mismatch refuses.
pub fn acknowledge_loss(
    path: &Path,
    keyservice_id: &str,
    key: Arc<p256::ecdsa::SigningKey>,
    lost: LostHead,
    note: &str,
    now: i64,
) -> Result<Record, AuditError> {
    let mut ledger = Ledger::default();
    let (mut log, _) =
        match AuditLog::open_checkpointed(path, keyservice_id, key.clone(), &mut ledger) {
            Err(AuditError::RolledBack { lost: named, .. }) if named == lost => {
                let checkpoint = crate::checkpoint::path_for(path);
                let aside = PathBuf::from(format!(
                    "{}.superseded-{}",
                    checkpoint.display(),
                    lost.records
                ));
                std::fs::rename(&checkpoint, &aside).map_err(|source| AuditError::Io {
                    path: checkpoint.clone(),
                    source,
                })?;
                ledger = Ledger::default();
                AuditLog::open_checkpointed(path, keyservice_id, key, &mut ledger)?
            }
            other => other?,
        };
    let contained = lost.records == 0
        || (log.head().records >= lost.records
            && crate::rollback::hash_at(path, lost.records - 1)
                .ok()
                .flatten()
                .as_deref()
                == Some(lost.hash.as_str()));
    if contained {
        return Err(AuditError::Broken {
            path: path.to_path_buf(),
            line: lost.records as usize,
            reason: "the log contains this head: nothing was lost, nothing to acknowledge".into(),
        });
    }
    let record = log.append(Decision {
        at: now,
        keyservice_id: keyservice_id.into(),
        key_id: String::new(),
        decision: LOSS_ACKNOWLEDGED.into(),
        reason: note.into(),
        failed_checks: Vec::new(),
        token_sha256: String::new(),
        image_digest: None,
        nonce: String::new(),
        task_id: String::new(),
        round: 0,
        policy: String::new(),
        commitment_sha256: None,
        policy_sha256: None,
        policy_rounds: None,
        enclave_signing_key: None,
        key_scope: None,
        acknowledged_loss: Some(lost),
    })?;
    ledger.restore(&record);
    log.checkpoint(&ledger);
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(n: u64) -> Decision {
        Decision {
            at: 1_000,
            keyservice_id: "ks1".into(),
            key_id: "k1".into(),
            decision: "granted".into(),
            reason: "every check passed".into(),
            failed_checks: vec![],
            token_sha256: "ab".into(),
            image_digest: None,
            nonce: format!("nonce-{n}"),
            task_id: "task".into(),
            round: n + 1,
            policy: "dev".into(),
            commitment_sha256: Some(format!("{n:064x}")),
            policy_sha256: Some("p".repeat(64)),
            policy_rounds: Some(100),
            enclave_signing_key: None,
            key_scope: None,
            acknowledged_loss: None,
        }
    }

    /// A log rolled back below its own checkpoint refuses the start; the acknowledgement of
    /// exactly the head the refusal names is a signed record, and the service starts after it
    /// with the acknowledged head on its ledger.
    #[test]
    fn a_rollback_below_the_checkpoint_starts_again_only_after_a_signed_acknowledgement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let key = Arc::new(confed_attestation::exchange::generate_signing_key());
        let open = |key: &Arc<p256::ecdsa::SigningKey>| {
            AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut Ledger::default())
        };
        let (mut log, _) = open(&key).unwrap();
        let mut ledger = Ledger::default();
        for n in 0..4 {
            let record = log.append(granted(n)).unwrap();
            ledger.restore(&record);
            log.checkpoint(&ledger);
            if n == 1 {
                std::fs::copy(&path, dir.path().join("backup")).unwrap();
            }
        }
        let lost = LostHead {
            records: 4,
            hash: log.head().hash.clone(),
        };
        drop(log);
        std::fs::copy(dir.path().join("backup"), &path).unwrap();
        let refused = open(&key).unwrap_err();
        assert!(
            matches!(&refused, AuditError::RolledBack { lost: named, .. } if *named == lost),
            "{refused}"
        );
        assert!(
            refused.to_string().contains("acknowledge-loss"),
            "{refused}"
        );

        let other = LostHead {
            records: 9,
            hash: "f".repeat(64),
        };
        assert!(acknowledge_loss(&path, "ks1", key.clone(), other, "no", 2_000).is_err());
        let record =
            acknowledge_loss(&path, "ks1", key.clone(), lost.clone(), "disk lost", 2_000).unwrap();
        assert_eq!(record.seq, 2);
        assert_eq!(record.decision.decision, LOSS_ACKNOWLEDGED);
        assert_eq!(record.decision.acknowledged_loss, Some(lost.clone()));

        let mut reopened = Ledger::default();
        let started = AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut reopened);
        assert!(started.is_ok(), "{:?}", started.err());
        assert_eq!(reopened.acknowledged_through(), 4);
        let head = LostHead {
            records: 3,
            hash: started.unwrap().0.head().hash.clone(),
        };
        assert!(
            acknowledge_loss(&path, "ks1", key, head, "x", 3).is_err(),
            "a head the log contains is not a loss"
        );
    }
}
