//! Audit-log checkpoints: start-up time that does not grow with the log.
//!
//! A key service rebuilt its release ledger by verifying its whole audit log at every start. A
//! checkpoint, written every `CHECKPOINT_EVERY` records and after each full verification, holds
//! the ledger as of a record and the log's byte length up to it, signed with the key service's
//! key. At start, a checkpoint whose signature verifies and whose record is found, with the
//! same hash, where it says, stands for the verified prefix: only the records after it are
//! verified and replayed. Anything else (missing, unsigned by this service, not matching the log)
//! falls back to verifying the whole log. `confed keyservice audit verify` always checks all.
//!
//! What this trusts: the prefix was verified when the checkpoint was signed. Its bytes are not
//! re-verified record by record at start, but their SHA-256 must be the one the checkpoint signed
//! (`audit::prefix`): any edit inside the prefix refuses the start. The ledger in the checkpoint
//! cannot be altered without the key.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::audit::Record;
use super::ledger::Ledger;

/// Records between checkpoints (a checkpoint is also written after every granted record: what a
/// rollback would take away).
pub const CHECKPOINT_EVERY: u64 = 1000;
/// v2 signs the digest of the prefix's bytes; a v1 checkpoint is not used (the whole log is
/// verified once, and a v2 one written).
const FORMAT: &str = "confed-audit-checkpoint/v2";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub format: String,
    pub keyservice_id: String,
    /// Records covered (the last one's `seq` + 1).
    pub records: u64,
    /// The last covered record's hash.
    pub hash: String,
    /// That record's signature (the head as of the checkpoint).
    pub record_signature: Option<String>,
    /// Bytes of the log covered: the end of the last covered record's line.
    pub offset: u64,
    /// Lowercase hex SHA-256 of those bytes (`audit::prefix`).
    #[serde(default)]
    pub prefix_sha256: String,
    /// `Ledger::to_json` as of the last covered record.
    pub ledger: String,
    /// The key service's signature over `signed_text()`.
    pub signature: String,
}

impl Checkpoint {
    fn signed_text(&self) -> String {
        let ledger = confed_protocol::hex::sha256_hex(self.ledger.as_bytes());
        format!(
            "{FORMAT}|{}|{}|{}|{}|{}|{}|{ledger}",
            self.keyservice_id,
            self.records,
            self.hash,
            self.record_signature.as_deref().unwrap_or("none"),
            self.offset,
            self.prefix_sha256
        )
    }
}

pub fn path_for(log: &Path) -> PathBuf {
    PathBuf::from(format!("{}.checkpoint", log.display()))
}

/// Writes a checkpoint atomically (temporary file, fsync, rename, directory fsync).
pub fn write(
    log: &Path,
    keyservice_id: &str,
    key: &p256::ecdsa::SigningKey,
    head: (u64, &str, Option<&str>),
    (offset, prefix_sha256): (u64, String),
    ledger: &Ledger,
) -> std::io::Result<()> {
    let (records, hash, record_signature) = head;
    let mut checkpoint = Checkpoint {
        format: FORMAT.into(),
        keyservice_id: keyservice_id.into(),
        records,
        hash: hash.into(),
        record_signature: record_signature.map(str::to_string),
        offset,
        prefix_sha256,
        ledger: ledger.to_json(),
        signature: String::new(),
    };
    checkpoint.signature = confed_attestation::release::sign_text(key, &checkpoint.signed_text());
    write_atomically(
        &path_for(log),
        &serde_json::to_vec(&checkpoint).map_err(std::io::Error::other)?,
    )
}

/// Replaces `path` with `bytes` so that a crash leaves the old or the new content, never half:
/// a temporary file, fsync, rename, directory fsync.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let temp = PathBuf::from(format!("{}.partial", path.display()));
    {
        let mut file = File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    std::fs::rename(&temp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Why an existing checkpoint is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unmatched {
    /// Not readable, another format or service, or not signed by this service: it stands for
    /// nothing (the whole log is verified instead).
    Unusable(String),
    /// Signed by this service, but the log no longer has the record it names where it names it:
    /// records this service made durable are gone, up to `lost`.
    LogBehind {
        why: String,
        lost: super::audit::LostHead,
        /// The lost head's signature (what `acknowledge-loss --signature` takes).
        signature: String,
    },
}

/// The checkpoint of `log`, if there is one this service signed and it matches the log: the
/// record it names is the line that ends at its offset, with its hash. `Err` says why one that
/// exists is not used.
pub fn load_matching(
    log: &Path,
    keyservice_id: &str,
    key: &p256::ecdsa::VerifyingKey,
) -> Result<Option<Checkpoint>, Unmatched> {
    let unusable = |why: String| Unmatched::Unusable(why);
    let text = match std::fs::read(path_for(log)) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unusable(e.to_string())),
    };
    let checkpoint: Checkpoint =
        serde_json::from_slice(&text).map_err(|e| unusable(e.to_string()))?;
    if checkpoint.format != FORMAT || checkpoint.keyservice_id != keyservice_id {
        return Err(unusable(
            "another format or another key service's checkpoint".into(),
        ));
    }
    if !confed_attestation::release::verify_text(
        key,
        &checkpoint.signed_text(),
        &checkpoint.signature,
    ) {
        return Err(unusable("its signature is not this key service's".into()));
    }
    if checkpoint.records == 0 {
        return Ok(Some(checkpoint));
    }
    let behind = |why: String| Unmatched::LogBehind {
        why: format!(
            "the checkpoint covers {} records up to byte {}; {why}",
            checkpoint.records, checkpoint.offset
        ),
        lost: super::audit::LostHead {
            records: checkpoint.records,
            hash: checkpoint.hash.clone(),
        },
        signature: checkpoint
            .record_signature
            .clone()
            .unwrap_or_else(|| "none".into()),
    };
    let record = line_ending_at(log, checkpoint.offset).map_err(|e| behind(e.to_string()))?;
    let record: Record = serde_json::from_slice(&record)
        .map_err(|e| behind(format!("the line it names is not a record: {e}")))?;
    if record.seq + 1 != checkpoint.records || record.hash != checkpoint.hash {
        return Err(behind(format!(
            "the log's record there is seq {} with another hash",
            record.seq
        )));
    }
    Ok(Some(checkpoint))
}

/// The line of `log` that ends (with its newline) at byte `offset`.
fn line_ending_at(log: &Path, offset: u64) -> std::io::Result<Vec<u8>> {
    let file = File::open(log)?;
    if offset == 0 || file.metadata()?.len() < offset {
        return Err(std::io::Error::other(
            "the log is shorter than the checkpoint",
        ));
    }
    let mut last = [0u8; 1];
    file.read_exact_at(&mut last, offset - 1)?;
    if last[0] != b'\n' {
        return Err(std::io::Error::other(
            "no record ends at the checkpoint's offset",
        ));
    }
    // Records are small (no payloads): look back at most 1 MiB for the line's start.
    let start = offset.saturating_sub(1 << 20);
    let mut window = vec![0u8; (offset - 1 - start) as usize];
    file.read_exact_at(&mut window, start)?;
    let begin = window
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    if begin == 0 && start > 0 {
        return Err(std::io::Error::other(
            "the record before the offset is too long",
        ));
    }
    Ok(window[begin..].to_vec())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::audit::{AuditError, AuditLog, Decision, VerifiedFrom, verify_file_with};

    /// Grants spread over three tasks.
    fn granted(n: u64) -> Decision {
        Decision {
            task_id: format!("task-{}", n % 3),
            round: n / 3 + 1,
            ..crate::audit::test_grant(n, &format!("{n:064x}"))
        }
    }

    fn key() -> Arc<p256::ecdsa::SigningKey> {
        Arc::new(confed_attestation::exchange::generate_signing_key())
    }

    /// Appends `n` granted decisions from `from` on, keeping the ledger as the service does.
    fn append(log: &mut AuditLog, ledger: &mut Ledger, from: u64, n: u64) {
        for i in from..from + n {
            let record = log.append(granted(i)).unwrap();
            ledger.restore(&record);
        }
    }

    fn rebuilt(path: &Path) -> Ledger {
        let mut ledger = Ledger::default();
        verify_file_with(path, |r| ledger.restore(r)).unwrap();
        ledger
    }

    /// A log of `before` granted records, a checkpoint, then `after` more; with its ledger.
    struct Written {
        _dir: tempfile::TempDir,
        path: PathBuf,
        key: Arc<p256::ecdsa::SigningKey>,
        ledger: Ledger,
    }

    fn written(before: u64, after: u64) -> Written {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let key = key();
        let mut ledger = Ledger::default();
        let (mut log, from) =
            AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut ledger).unwrap();
        assert_eq!(from, VerifiedFrom::Start);
        append(&mut log, &mut ledger, 0, before);
        log.checkpoint(&ledger);
        append(&mut log, &mut ledger, before, after);
        Written {
            _dir: dir,
            path,
            key,
            ledger,
        }
    }

    fn reopen(path: &Path, key: Arc<p256::ecdsa::SigningKey>) -> (VerifiedFrom, u64, Ledger) {
        let mut ledger = Ledger::default();
        let (log, from) = AuditLog::open_checkpointed(path, "ks1", key, &mut ledger).unwrap();
        (from, log.head().records, ledger)
    }

    /// The whole log was re-verified at every start; now only what follows the checkpoint.
    #[test]
    fn start_up_verifies_only_the_records_after_a_matching_checkpoint() {
        let w = written(30, 5);
        let (from, records, reopened) = reopen(&w.path, w.key.clone());
        assert_eq!(from, VerifiedFrom::Checkpoint { records: 30 });
        assert_eq!(records, 35);
        assert_eq!(
            reopened,
            rebuilt(&w.path),
            "the same ledger as a full rebuild"
        );
        assert_eq!(reopened, w.ledger);
    }

    /// A checkpoint another key signed, or one edited after signing, is not used: the whole log
    /// is verified and the ledger rebuilt from it. One this service signed that the log no
    /// longer matches (rolled back below it) refuses the start.
    #[test]
    fn a_checkpoint_that_does_not_match_is_ignored() {
        let w = written(12, 0);
        let original = std::fs::read(path_for(&w.path)).unwrap();
        let with = |checkpoint: &[u8], key: Arc<p256::ecdsa::SigningKey>| {
            std::fs::write(path_for(&w.path), checkpoint).unwrap();
            reopen(&w.path, key)
        };
        let mut edited: Checkpoint = serde_json::from_slice(&original).unwrap();
        edited.ledger = Ledger::default().to_json();
        let (from, _, ledger) = with(&serde_json::to_vec(&edited).unwrap(), w.key.clone());
        assert_eq!(
            from,
            VerifiedFrom::Start,
            "an edited ledger breaks the signature"
        );
        assert_eq!(ledger, w.ledger);
        // Under another key the checkpoint stands for nothing, and neither do the records'
        // signatures: the start is refused.
        std::fs::write(path_for(&w.path), &original).unwrap();
        let other =
            AuditLog::open_checkpointed(&w.path, "ks1", self::key(), &mut Ledger::default());
        assert!(
            matches!(&other, Err(AuditError::Broken { line: 1, reason, .. }) if reason.contains("signature")),
            "{other:?}"
        );
        let mut moved: Checkpoint = serde_json::from_slice(&original).unwrap();
        moved.offset -= 1;
        let (from, _, _) = with(&serde_json::to_vec(&moved).unwrap(), w.key.clone());
        assert_eq!(from, VerifiedFrom::Start, "unsigned change of the offset");

        // Validly signed, but the log was rolled back to 8 records: records are gone.
        std::fs::write(path_for(&w.path), &original).unwrap();
        let text = std::fs::read_to_string(&w.path).unwrap();
        let kept: String = text.split_inclusive('\n').take(8).collect();
        std::fs::write(&w.path, kept).unwrap();
        let opened = AuditLog::open_checkpointed(&w.path, "ks1", w.key, &mut Ledger::default());
        assert!(
            matches!(&opened, Err(AuditError::RolledBack { why, .. }) if why.contains("12 records")),
            "{opened:?}"
        );
    }

    /// After a checkpoint, a modified record still refuses the start.
    #[test]
    fn a_record_modified_after_the_checkpoint_refuses_the_start() {
        let w = written(10, 3);
        let text = std::fs::read_to_string(&w.path).unwrap();
        std::fs::write(&w.path, text.replace("nonce-11", "nonce-99")).unwrap();
        let opened = AuditLog::open_checkpointed(&w.path, "ks1", w.key, &mut Ledger::default());
        assert!(matches!(opened, Err(AuditError::Broken { line: 12, .. })));
    }
}
