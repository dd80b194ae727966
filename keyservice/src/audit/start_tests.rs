//! What a key service refuses to start on: the attacks on its audit log that the chain alone
//! does not catch, because the attacker recomputes it. Each would otherwise rebuild a release
//! ledger that admits a second commitment for a round, or pins a forger's.

use std::sync::Arc;

use super::*;
use crate::ledger::Ledger;

use super::test_grant as granted;

struct Service {
    _dir: tempfile::TempDir,
    path: PathBuf,
    key: Arc<p256::ecdsa::SigningKey>,
}

/// A key service's log with `n` granted rounds, written as the service writes it (signed, a
/// checkpoint after each grant), then closed.
fn service_with(n: u64) -> Service {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let key = Arc::new(confed_attestation::exchange::generate_signing_key());
    let mut ledger = Ledger::default();
    let (mut log, _) = AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut ledger).unwrap();
    for i in 0..n {
        let record = log.append(granted(i, &format!("{i:064x}"))).unwrap();
        ledger.restore(&record);
        log.checkpoint(&ledger);
    }
    Service {
        _dir: dir,
        path,
        key,
    }
}

fn start(s: &Service) -> Result<(AuditLog, VerifiedFrom), AuditError> {
    AuditLog::open_checkpointed(&s.path, "ks1", s.key.clone(), &mut Ledger::default())
}

fn records(s: &Service) -> Vec<Record> {
    std::fs::read_to_string(&s.path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Rewrites the log with `records` re-chained (hashes recomputed; signatures as given).
fn write_rechained(s: &Service, records: Vec<Record>) {
    let mut prev = GENESIS_HASH.to_string();
    let mut text = String::new();
    for (seq, mut record) in records.into_iter().enumerate() {
        record.seq = seq as u64;
        record.prev_hash = prev.clone();
        record.hash = chain_hash(record.seq, &record.prev_hash, &record.decision);
        prev = record.hash.clone();
        text.push_str(&serde_json::to_string(&record).unwrap());
        text.push('\n');
    }
    std::fs::write(&s.path, text).unwrap();
    // The attacker also removes the checkpoint, which it cannot forge.
    let _ = std::fs::remove_file(crate::checkpoint::path_for(&s.path));
}

fn assert_broken_at(result: Result<(AuditLog, VerifiedFrom), AuditError>, line: usize, why: &str) {
    match result {
        Err(AuditError::Broken {
            line: at, reason, ..
        }) => {
            assert_eq!(at, line, "{reason}");
            assert!(reason.contains(why), "{reason}");
        }
        other => panic!("the key service started: {other:?}"),
    }
}

#[test]
fn an_intact_signed_log_starts() {
    let s = service_with(3);
    let (log, _) = start(&s).unwrap();
    assert_eq!(log.head().records, 3);
}

/// Delete a round's granted record and recompute the chain, signatures left as they were.
#[test]
fn a_log_with_a_grant_deleted_and_the_chain_recomputed_refuses_to_start() {
    let s = service_with(3);
    let mut kept = records(&s);
    kept.remove(1);
    write_rechained(&s, kept);
    assert_broken_at(start(&s), 2, "signature is not key service ks1's");
}

/// The same with every signature stripped.
#[test]
fn a_log_stripped_of_its_signatures_refuses_to_start() {
    let s = service_with(3);
    let mut kept = records(&s);
    kept.remove(1);
    kept.iter_mut().for_each(|r| r.signature = None);
    write_rechained(&s, kept);
    assert_broken_at(start(&s), 1, "not signed");
}

/// Append a chained but unsigned granted record that pins a round to the forger's commitment.
#[test]
fn a_forged_unsigned_grant_appended_refuses_to_start() {
    let s = service_with(2);
    let mut forged = records(&s);
    let mut record = forged[1].clone();
    record.decision = granted(7, &"f".repeat(64));
    record.signature = None;
    forged.push(record);
    let mut prev = forged[1].hash.clone();
    let last = forged.last_mut().unwrap();
    last.seq = 2;
    last.prev_hash = std::mem::take(&mut prev);
    last.hash = chain_hash(2, &last.prev_hash, &last.decision);
    let text: String = forged
        .iter()
        .map(|r| serde_json::to_string(r).unwrap() + "\n")
        .collect();
    std::fs::write(&s.path, text).unwrap();
    assert_broken_at(start(&s), 3, "not signed");
}

/// A log restored from an older copy (its first grant only), the checkpoint written after the
/// second grant kept: a service that started would admit a new commitment for round 2.
#[test]
fn a_log_restored_from_an_older_copy_refuses_to_start() {
    let s = service_with(1);
    let older = std::fs::read(&s.path).unwrap();
    let (mut log, _) = start(&s).unwrap();
    let mut ledger = Ledger::default();
    let record = log.append(granted(1, &"2".repeat(64))).unwrap();
    ledger.restore(&record);
    log.checkpoint(&ledger);
    drop(log);
    std::fs::write(&s.path, older).unwrap();
    match start(&s) {
        Err(AuditError::RolledBack { why, .. }) => {
            assert!(why.contains("2 records"), "{why}")
        }
        other => panic!("a rolled-back log started: {other:?}"),
    }
}

/// v3 refused a same-length edit inside the checkpointed prefix at start; checkpoints that
/// stand for a prefix without re-verifying it let it start silently. The checkpoint now signs
/// the prefix's digest: the edit (a refusal rewritten as a grant, 7 bytes for 7) refuses the
/// start, while the log, the checkpoint and the tail after it are untouched.
#[test]
fn a_same_length_edit_inside_the_checkpointed_prefix_refuses_to_start() {
    let s = service_with(3);
    {
        let mut ledger = Ledger::default();
        let (mut log, _) = start(&s).unwrap();
        let refused = Decision {
            decision: "refused".into(),
            ..granted(9, &format!("{:064x}", 9))
        };
        ledger.restore(&log.append(refused).unwrap());
        log.checkpoint(&ledger);
    }
    assert!(matches!(
        start(&s).unwrap().1,
        VerifiedFrom::Checkpoint { records: 4 }
    ));
    let text = std::fs::read_to_string(&s.path).unwrap();
    let edited = text.replacen("\"decision\":\"refused\"", "\"decision\":\"granted\"", 1);
    assert_eq!(edited.len(), text.len(), "the same length");
    assert_ne!(edited, text);
    std::fs::write(&s.path, edited).unwrap();
    assert_broken_at(start(&s), 0, "not the ones its checkpoint signed");
}
