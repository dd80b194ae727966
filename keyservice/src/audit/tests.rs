//! The audit log's chain: what it catches, and the torn tail it recovers.

use super::*;

fn decision(n: u64) -> Decision {
    Decision {
        at: 1000 + n as i64,
        keyservice_id: "ks1".into(),
        key_id: "k1".into(),
        decision: if n.is_multiple_of(2) {
            "granted"
        } else {
            "refused"
        }
        .into(),
        reason: format!("case {n}"),
        failed_checks: vec![],
        token_sha256: "ab".into(),
        image_digest: Some("sha256:00".into()),
        nonce: format!("nonce-{n}"),
        task_id: "t".into(),
        round: n,
        policy: "dev".into(),
        commitment_sha256: None,
        policy_sha256: None,
        policy_rounds: None,
        enclave_signing_key: None,
        key_scope: None,
        acknowledged_loss: None,
        included_sha256: None,
        included: None,
    }
}

fn log_with(records: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let mut log = AuditLog::open(&path).unwrap();
    for n in 0..records {
        log.append(decision(n)).unwrap();
    }
    (dir, path)
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn write_lines(path: &Path, lines: &[String]) {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn intact_log_verifies_and_reopens_at_its_head() {
    let (_dir, path) = log_with(4);
    let head = verify_file(&path).unwrap();
    assert_eq!(head.records, 4);
    let mut log = AuditLog::open(&path).unwrap();
    assert_eq!(log.head(), &head);
    log.append(decision(4)).unwrap();
    assert_eq!(verify_file(&path).unwrap().records, 5);
}

#[test]
fn modified_record_is_detected() {
    let (_dir, path) = log_with(4);
    let mut content = lines(&path);
    content[1] = content[1].replace("\"refused\"", "\"granted\"");
    write_lines(&path, &content);
    let error = verify_file(&path).unwrap_err();
    assert!(
        matches!(error, AuditError::Broken { line: 2, .. }),
        "{error}"
    );
    assert!(
        AuditLog::open(&path).is_err(),
        "a broken log is not appended to"
    );
}

#[test]
fn deleted_record_is_detected() {
    let (_dir, path) = log_with(4);
    let mut content = lines(&path);
    content.remove(1);
    write_lines(&path, &content);
    let error = verify_file(&path).unwrap_err();
    assert!(
        matches!(error, AuditError::Broken { line: 2, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("deleted"));
}

/// The attack of issue 12: rewrite a record and re-chain every record after it. The chain is
/// intact again, but the signatures are not (the forger lacks the signing key).
#[test]
fn a_rewritten_and_rechained_log_fails_its_signatures() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let key = std::sync::Arc::new(confed_attestation::exchange::generate_signing_key());
    let mut log = AuditLog::open(&path).unwrap().signed_by("ks1", key.clone());
    for n in 0..4 {
        log.append(decision(n)).unwrap();
    }
    let check = SignatureCheck {
        keyservice_id: "ks1",
        verifying_key: key.verifying_key(),
    };
    let verified = verify_file_signed(&path, check).unwrap();
    assert_eq!((verified.head.records, verified.unsigned), (4, 0));
    let head = log.signed_head("ks1");
    assert!(confed_attestation::release::verify_text(
        key.verifying_key(),
        &head_text("ks1", head.records - 1, &head.hash),
        head.signature.as_deref().unwrap()
    ));

    let mut records: Vec<Record> = lines(&path)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    records[1].decision.decision = "granted".into();
    records[1].decision.reason = "forged".into();
    let mut prev = records[0].hash.clone();
    for record in records.iter_mut().skip(1) {
        record.prev_hash = prev.clone();
        record.hash = chain_hash(record.seq, &record.prev_hash, &record.decision);
        prev = record.hash.clone();
    }
    let rewritten: Vec<String> = records
        .iter()
        .map(|r| serde_json::to_string(r).unwrap())
        .collect();
    write_lines(&path, &rewritten);
    assert_eq!(
        verify_file(&path).unwrap().records,
        4,
        "the chain alone says intact"
    );
    let error = verify_file_signed(&path, check).unwrap_err();
    assert!(
        matches!(error, AuditError::Broken { line: 2, .. }),
        "{error}"
    );
    // Stripping the signatures does not help either: unsigned after signed is refused.
    for record in records.iter_mut().skip(1) {
        record.signature = None;
    }
    let stripped: Vec<String> = records
        .iter()
        .map(|r| serde_json::to_string(r).unwrap())
        .collect();
    write_lines(&path, &stripped);
    assert!(verify_file_signed(&path, check).is_err());
}

#[test]
fn rehashed_forgery_still_breaks_the_chain_to_the_next_record() {
    let (_dir, path) = log_with(3);
    let mut content = lines(&path);
    let mut record: Record = serde_json::from_str(&content[0]).unwrap();
    record.decision.decision = "granted".into();
    record.decision.reason = "forged".into();
    record.hash = chain_hash(record.seq, &record.prev_hash, &record.decision);
    content[0] = serde_json::to_string(&record).unwrap();
    write_lines(&path, &content);
    assert!(matches!(
        verify_file(&path),
        Err(AuditError::Broken { line: 2, .. })
    ));
}

/// A crash mid-append (here: 300 bytes of a record without its newline) must not brick the
/// key service: the torn tail is cut, a copy kept, and the log reopens at its last record.
#[test]
fn a_torn_final_record_is_set_aside_and_the_log_reopens() {
    let (_dir, path) = log_with(7);
    let intact = std::fs::read(&path).unwrap();
    let next = serde_json::to_vec(&decision(7)).unwrap();
    let mut torn = intact.clone();
    torn.extend_from_slice(&next[..300.min(next.len())]);
    std::fs::write(&path, &torn).unwrap();
    assert!(
        verify_file(&path).is_err(),
        "the torn file itself does not verify"
    );
    let mut log = AuditLog::open(&path).unwrap();
    assert_eq!(log.head().records, 7);
    assert_eq!(std::fs::read(&path).unwrap(), intact);
    let copy = PathBuf::from(format!("{}.torn-{}", path.display(), intact.len()));
    assert_eq!(
        std::fs::read(copy).unwrap(),
        torn,
        "the operator keeps the whole file"
    );
    log.append(decision(7)).unwrap();
    assert_eq!(verify_file(&path).unwrap().records, 8);
}

/// Only a torn tail is recovered: a corrupted record in the middle, or a complete but
/// corrupted last line, still refuses to start.
#[test]
fn a_corrupted_middle_or_complete_last_line_still_refuses_to_open() {
    let (_dir, path) = log_with(5);
    let mut content = lines(&path);
    content[2] = content[2][..40].to_string();
    write_lines(&path, &content);
    assert!(matches!(
        AuditLog::open(&path),
        Err(AuditError::Broken { line: 3, .. })
    ));

    let (_dir, path) = log_with(5);
    let mut content = lines(&path);
    content[4] = content[4].replace("case 4", "case X");
    write_lines(&path, &content);
    assert!(matches!(
        AuditLog::open(&path),
        Err(AuditError::Broken { line: 5, .. })
    ));
}
