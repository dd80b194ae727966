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

/// Appends the acknowledgement of `lost` to the log at `path` (the service stopped), after
/// verifying every record, then writes a checkpoint after it. A local checkpoint that named
/// exactly `lost` is kept as `<checkpoint>.superseded-<records>`. Refuses a head the log
/// contains and one already acknowledged.
pub fn acknowledge_loss(
    path: &Path,
    keyservice_id: &str,
    key: Arc<p256::ecdsa::SigningKey>,
    lost: LostHead,
    signature: &str,
    note: &str,
    now: i64,
) -> Result<Record, AuditError> {
    // Only a head this service signed can have been lost (a typo names nothing, and would
    // otherwise be written as an acknowledgement of it).
    let signed = lost.records > 0
        && confed_attestation::release::verify_text(
            key.verifying_key(),
            &crate::audit::head_text(keyservice_id, lost.records - 1, &lost.hash),
            signature,
        );
    if !signed {
        return Err(AuditError::Broken {
            path: path.to_path_buf(),
            line: 0,
            reason: format!(
                "the head ({} records, hash {}) with that signature is not one key service {keyservice_id} signed: copy --records, --hash and --signature from the refusal",
                lost.records, lost.hash
            ),
        });
    }
    // Every record is verified, the checkpoint neither used nor rewritten yet: if this stops
    // before the acknowledgement is written, the next start still refuses.
    let mut ledger = Ledger::default();
    let mut log =
        AuditLog::open_ignoring_checkpoint(path, keyservice_id, key.clone(), &mut ledger)?;
    let io = |source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let contained = log.head().records >= lost.records
        && crate::rollback::hash_at(path, lost.records - 1)
            .map_err(io)?
            .as_deref()
            == Some(lost.hash.as_str());
    if contained {
        return Err(AuditError::Broken {
            path: path.to_path_buf(),
            line: lost.records as usize,
            reason: "the log contains this head: nothing was lost, nothing to acknowledge".into(),
        });
    }
    if ledger.acknowledged(&lost) {
        return Err(AuditError::Broken {
            path: path.to_path_buf(),
            line: log.head().records as usize,
            reason: "this loss is already acknowledged in the log".into(),
        });
    }
    // A checkpoint naming exactly the lost head is kept aside (it stands for the lost records).
    let checkpoint = crate::checkpoint::path_for(path);
    let named = crate::checkpoint::load_matching(path, keyservice_id, key.verifying_key());
    let aside = matches!(&named, Err(crate::checkpoint::Unmatched::LogBehind { lost: n, .. }) if *n == lost);
    let record = log.append(Decision {
        acknowledged_loss: Some(lost.clone()),
        ..Decision::note(now, keyservice_id, LOSS_ACKNOWLEDGED, note.into())
    })?;
    ledger.restore(&record);
    if aside {
        let kept = PathBuf::from(format!(
            "{}.superseded-{}",
            checkpoint.display(),
            lost.records
        ));
        std::fs::copy(&checkpoint, &kept).map_err(io)?;
    }
    // Replaces the checkpoint: the next start begins after the acknowledgement.
    log.checkpoint(&ledger);
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(n: u64) -> Decision {
        crate::audit::test_grant(n, &format!("{n:064x}"))
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
        let signature = log.head().signature.clone().unwrap();
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
        let typo = acknowledge_loss(&path, "ks1", key.clone(), other, &signature, "no", 2_000);
        assert!(
            matches!(&typo, Err(AuditError::Broken { reason, .. }) if reason.contains("not one key service ks1 signed")),
            "{typo:?}"
        );
        let record = acknowledge_loss(
            &path,
            "ks1",
            key.clone(),
            lost.clone(),
            &signature,
            "disk lost",
            2_000,
        )
        .unwrap();
        assert_eq!(record.seq, 2);
        assert_eq!(record.decision.decision, LOSS_ACKNOWLEDGED);
        assert_eq!(record.decision.acknowledged_loss, Some(lost.clone()));

        let mut reopened = Ledger::default();
        let started = AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut reopened);
        assert!(started.is_ok(), "{:?}", started.err());
        assert!(reopened.acknowledged(&lost));
        assert!(
            dir.path()
                .join("audit.jsonl.checkpoint.superseded-4")
                .exists(),
            "the checkpoint that named the lost head is kept"
        );
        let (started, _) = started.unwrap();
        let head = LostHead {
            records: 3,
            hash: started.head().hash.clone(),
        };
        let signed = started.head().signature.clone().unwrap();
        assert!(
            acknowledge_loss(&path, "ks1", key.clone(), head, &signed, "x", 3).is_err(),
            "a head the log contains is not a loss"
        );
        assert!(
            acknowledge_loss(&path, "ks1", key, lost, &signature, "again", 3).is_err(),
            "acknowledged once"
        );
    }
}
