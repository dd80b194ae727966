//! The key service's audit log: one JSON line per release decision, hash-chained (each record
//! carries the SHA-256 of the previous one), each record's hash signed with the key service's
//! signing key, fsync'd before the decision is answered. A modified, reordered or deleted record
//! breaks the chain; a rewritten and re-chained log breaks the signatures (the rewriter would need
//! the signing key); a truncated tail is detected by comparing the head with a signed head kept
//! elsewhere (the service serves its latest signed head at `GET /v1/audit/head` and logs it).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

#[derive(Debug, Error)]
pub enum AuditError {
    #[error("audit log {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("audit log {path} is broken at line {line}: {reason}")]
    Broken {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    /// The log lost records this key service had made durable: its own signed checkpoint names
    /// a record the log no longer has.
    #[error(
        "audit log {path} is behind this key service's own checkpoint ({why}): release decisions it made durable are gone (a rollback, or a restore from an older copy), and its release ledger with them. Restore the newer log; only to accept the loss, run `confed keyservice audit acknowledge-loss {path} --id ID --signing-key FILE --records {} --hash {} --signature={signature} --note WHY` with the service stopped (the ledger then forgets those rounds)", lost.records, lost.hash
    )]
    RolledBack {
        path: PathBuf,
        why: String,
        lost: LostHead,
        signature: String,
    },
    #[error(
        "audit log {path} is in use by a running key service ({lock} is locked); stop it first"
    )]
    InUse { path: PathBuf, lock: PathBuf },
}

/// A release decision's outcome, as the record's `decision` field spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Granted,
    Refused,
}

impl Verdict {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Refused => "refused",
        }
    }

    /// The verdict a record's `decision` names (`None` for other records, e.g. an
    /// acknowledged loss).
    pub fn parse(decision: &str) -> Option<Self> {
        [Self::Granted, Self::Refused]
            .into_iter()
            .find(|v| v.as_str() == decision)
    }
}

/// What a release decision records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    /// Unix seconds.
    pub at: i64,
    pub keyservice_id: String,
    pub key_id: String,
    /// `granted` or `refused`.
    pub decision: String,
    pub reason: String,
    pub failed_checks: Vec<String>,
    pub token_sha256: String,
    pub image_digest: Option<String>,
    pub nonce: String,
    pub task_id: String,
    pub round: u64,
    pub policy: String,
    /// The release commitment's digest (granted releases; the release ledger is rebuilt from
    /// these). Absent fields are not serialized, so records written before they existed still
    /// hash the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commitment_sha256: Option<String>,
    /// The task policy's hash and planned rounds the commitment was checked against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_rounds: Option<u32>,
    /// The enclave's per-job signing key the receipt was issued to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enclave_signing_key: Option<String>,
    /// The rounds that must share this round's key (a tree task's tree: `Mechanism::key_scope`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_scope: Option<u64>,
    /// A `loss_acknowledged` record: the head of the records the operator accepted as lost
    /// (`confed keyservice audit acknowledge-loss`, `rollback.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acknowledged_loss: Option<LostHead>,
    /// An `unmask_agreed` record: the included set this service agreed to unmask for the round
    /// (`included_digest`) and its size (docs/secure-aggregation.md); the unmask ledger is
    /// rebuilt from these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub included_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub included: Option<u64>,
}

/// The head of a log's lost records, as a peer witnessed it or a checkpoint named it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LostHead {
    pub records: u64,
    pub hash: String,
}

/// A chained record as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub seq: u64,
    pub prev_hash: String,
    #[serde(flatten)]
    pub decision: Decision,
    pub hash: String,
    /// The key service's signature over `head_text(keyservice_id, seq, hash)` (records written
    /// before signed heads existed have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

/// The text a key service signs for the head of its log after record `seq`.
pub fn head_text(keyservice_id: &str, seq: u64, hash: &str) -> String {
    format!("confed-audit-head-v1|{keyservice_id}|{seq}|{hash}")
}

impl Decision {
    /// A record that is no release decision (an acknowledged loss, a summary of refusals): the
    /// fields of a decision empty, 0 or absent.
    pub fn note(at: i64, keyservice_id: &str, decision: &str, reason: String) -> Self {
        Self {
            at,
            keyservice_id: keyservice_id.to_string(),
            key_id: String::new(),
            decision: decision.to_string(),
            reason,
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
            acknowledged_loss: None,
            included_sha256: None,
            included: None,
        }
    }
}

/// A signed head, as `GET /v1/audit/head` serves it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedHead {
    pub keyservice_id: String,
    /// Records in the log (the last one's `seq` + 1); 0 for an empty log.
    pub records: u64,
    /// The last record's hash (64 zeros for an empty log).
    pub hash: String,
    /// Signature over `head_text(keyservice_id, records - 1, hash)`; absent for an empty log.
    pub signature: Option<String>,
}

/// The chain hash of a record: SHA-256 over its JSON without `hash` (fields in declaration order).
/// Whether a record's hash is its content's (its chain to the one before is the caller's check).
pub fn hash_matches(record: &Record) -> bool {
    chain_hash(record.seq, &record.prev_hash, &record.decision) == record.hash
}

fn chain_hash(seq: u64, prev_hash: &str, decision: &Decision) -> String {
    #[derive(Serialize)]
    struct Unhashed<'a> {
        seq: u64,
        prev_hash: &'a str,
        #[serde(flatten)]
        decision: &'a Decision,
    }
    let bytes = serde_json::to_vec(&Unhashed {
        seq,
        prev_hash,
        decision,
    })
    .expect("audit records serialize");
    confed_protocol::hex::sha256_hex(&bytes)
}

/// The end of a verified chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub records: u64,
    pub hash: String,
    /// The last record's signature, if it has one.
    pub signature: Option<String>,
}

/// How `verify_file_signed` treats signatures.
#[derive(Debug, Clone, Copy)]
pub struct SignatureCheck<'a> {
    pub keyservice_id: &'a str,
    pub verifying_key: &'a p256::ecdsa::VerifyingKey,
}

/// A verified log and what its signatures showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub head: Head,
    /// Records (from the start) written before records were signed.
    pub unsigned: u64,
}

/// Why `record` does not carry a valid signature of `check`'s key service, if it does not.
fn signature_problem(record: &Record, check: SignatureCheck<'_>) -> Option<String> {
    let Some(signature) = &record.signature else {
        return Some(format!(
            "it is not signed (signatures stripped, or a record forged without key service {}'s key)",
            check.keyservice_id
        ));
    };
    let text = head_text(check.keyservice_id, record.seq, &record.hash);
    (!confed_attestation::release::verify_text(check.verifying_key, &text, signature)).then(|| {
        format!(
            "its signature is not key service {}'s (the log was rewritten, or this is another service's log)",
            check.keyservice_id
        )
    })
}

/// Checks every record's chain and signature: after the first signed record, every record must
/// carry a valid signature of `check`'s key service.
pub fn verify_file_signed(path: &Path, check: SignatureCheck<'_>) -> Result<Verified, AuditError> {
    let mut unsigned = 0u64;
    let mut signed_seen = false;
    let mut problem: Option<(u64, String)> = None;
    let head = verify_file_with(path, |record| {
        if problem.is_some() {
            return;
        }
        match &record.signature {
            None if !signed_seen => unsigned += 1,
            None => {
                problem = Some((
                    record.seq,
                    "unsigned after signed records (a record was replaced)".into(),
                ))
            }
            Some(_) => {
                signed_seen = true;
                problem = signature_problem(record, check).map(|why| (record.seq, why));
            }
        }
    })?;
    if let Some((seq, reason)) = problem {
        return Err(AuditError::Broken {
            path: path.to_path_buf(),
            line: seq as usize + 1,
            reason,
        });
    }
    Ok(Verified { head, unsigned })
}

/// Checks every record of a log file; returns its head.
pub fn verify_file(path: &Path) -> Result<Head, AuditError> {
    verify_file_with(path, |_| {})
}

/// Checks every record of a log file, handing each verified record to `visit`; returns its head.
pub fn verify_file_with(path: &Path, visit: impl FnMut(&Record)) -> Result<Head, AuditError> {
    let genesis = Head {
        records: 0,
        hash: GENESIS_HASH.into(),
        signature: None,
    };
    verify_from(path, 0, genesis, visit).map(|(head, _)| head)
}

/// Checks the records of a log file from byte `offset` on, chaining onto `head` (the verified
/// head of everything before `offset`); returns the new head and the file's length.
pub fn verify_from(
    path: &Path,
    offset: u64,
    mut head: Head,
    mut visit: impl FnMut(&Record),
) -> Result<(Head, u64), AuditError> {
    use std::io::{Seek, SeekFrom};
    let io = |source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && offset == 0 => {
            return Ok((head, 0));
        }
        Err(e) => return Err(io(e)),
    };
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut length = offset;
    for line in BufReader::new(file).lines() {
        let line = line.map_err(io)?;
        length += line.len() as u64 + 1;
        let broken = |reason: String| AuditError::Broken {
            path: path.to_path_buf(),
            line: head.records as usize + 1,
            reason,
        };
        let record: Record =
            serde_json::from_str(&line).map_err(|e| broken(format!("not a record: {e}")))?;
        if record.seq != head.records {
            return Err(broken(format!(
                "sequence {} where {} was expected (a record was deleted or moved)",
                record.seq, head.records
            )));
        }
        if record.prev_hash != head.hash {
            return Err(broken(
                "prev_hash does not match the previous record".into(),
            ));
        }
        if chain_hash(record.seq, &record.prev_hash, &record.decision) != record.hash {
            return Err(broken(
                "hash does not match the record's content (modified)".into(),
            ));
        }
        visit(&record);
        head = Head {
            records: head.records + 1,
            hash: record.hash,
            signature: record.signature,
        };
    }
    Ok((head, length))
}

/// A crash during an append can leave the last line without its newline: the record was never
/// made durable, so its decision was never answered (the answer waits for the fsync). Such a
/// tail is cut off, after the whole file is copied to `<log>.torn-<bytes kept>` for the
/// operator. Returns the copy's path when it cut. A final line that is complete (newline and
/// all) is never touched here: if it does not verify, the open refuses, as for any other line.
fn recover_torn_tail(path: &Path) -> Result<Option<PathBuf>, AuditError> {
    use std::os::unix::fs::FileExt;
    let io = |source| AuditError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let len = file.metadata().map_err(io)?.len();
    let mut last = [0u8; 1];
    if len == 0 || (file.read_at(&mut last, len - 1).map_err(io)? == 1 && last[0] == b'\n') {
        return Ok(None);
    }
    // Where the torn line starts: after the last newline, read backwards block by block.
    let mut keep = 0u64;
    let mut end = len;
    let mut block = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(block.len() as u64);
        let chunk = &mut block[..(end - start) as usize];
        file.read_exact_at(chunk, start).map_err(io)?;
        if let Some(at) = chunk.iter().rposition(|&b| b == b'\n') {
            keep = start + at as u64 + 1;
            break;
        }
        end = start;
    }
    let copy = PathBuf::from(format!("{}.torn-{keep}", path.display()));
    std::fs::copy(path, &copy)
        .and_then(|_| File::open(&copy)?.sync_all())
        .map_err(io)?;
    file.set_len(keep)
        .and_then(|_| file.sync_all())
        .map_err(io)?;
    Ok(Some(copy))
}

/// An open log, positioned after its verified head.
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    file: File,
    head: Head,
    /// Signs each record's head: (key service id, key).
    signer: Option<(String, std::sync::Arc<p256::ecdsa::SigningKey>)>,
    /// An append failed and its partial line could not be removed.
    broken: bool,
    /// Bytes of the file up to the head (a checkpoint's offset).
    length: u64,
    /// The digest of those bytes (what a checkpoint signs for its prefix).
    prefix: prefix::PrefixDigest,
    /// (seq, byte offset) of the records appended by this process, the latest
    /// `RECENT_OFFSETS`: where a peer's request for recent records starts reading.
    recent: std::collections::VecDeque<(u64, u64)>,
}

/// Appended records whose offsets are remembered (`records_from`).
const RECENT_OFFSETS: usize = 4096;

/// Where an opened log's verification started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifiedFrom {
    /// Every record was verified.
    Start,
    /// A checkpoint stood for the first `records`; only the rest were verified.
    Checkpoint { records: u64 },
}

impl AuditLog {
    /// Opens (creating) a log; refuses one whose chain is broken.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        Self::open_with(path, |_| {})
    }

    /// `open`, handing every verified record to `visit` (how the release ledger is rebuilt).
    /// A torn final record (a crash mid-append) is set aside first; anything else that does not
    /// verify refuses the open.
    pub fn open_with(path: &Path, visit: impl FnMut(&Record)) -> Result<Self, AuditError> {
        if let Some(copy) = recover_torn_tail(path)? {
            tracing::error!(
                log = %path.display(), copy = %copy.display(),
                "the audit log ended in a torn record (a crash during an append); the partial \
                 line was removed and the whole file kept as the copy; nothing was answered for it"
            );
        }
        let genesis = Head {
            records: 0,
            hash: GENESIS_HASH.into(),
            signature: None,
        };
        let (head, length) = verify_from(path, 0, genesis, visit)?;
        let prefix = Self::digest(path, length)?;
        Self::opened(path, head, length, prefix)
    }

    fn digest(path: &Path, length: u64) -> Result<prefix::PrefixDigest, AuditError> {
        prefix::PrefixDigest::of_file(path, length).map_err(|source| AuditError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    fn opened(
        path: &Path,
        head: Head,
        length: u64,
        prefix: prefix::PrefixDigest,
    ) -> Result<Self, AuditError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| AuditError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            head,
            signer: None,
            broken: false,
            length,
            prefix,
            recent: Default::default(),
        })
    }

    /// Opens a key service's log and rebuilds its ledger, from its checkpoint when one matches
    /// (`checkpoint.rs`), else from the start; then writes a fresh checkpoint after a full
    /// verification, so the next start is short.
    ///
    /// Every record it replays must carry this key service's valid signature, not only a valid
    /// chain: a log whose granted records were deleted and the chain recomputed, stripped of its
    /// signatures, or with a forged record appended would otherwise rebuild a ledger that admits
    /// a second commitment for a round (or pins the forger's). Only a prefix that a checkpoint
    /// this service signed stands for is not re-verified (it was when the checkpoint was
    /// written). A checkpoint signed by this service that the log no longer matches refuses the
    /// start (`RolledBack`): records it had made durable are gone.
    pub fn open_checkpointed(
        path: &Path,
        keyservice_id: &str,
        key: std::sync::Arc<p256::ecdsa::SigningKey>,
        ledger: &mut super::ledger::Ledger,
    ) -> Result<(Self, VerifiedFrom), AuditError> {
        Self::open_signed(path, keyservice_id, key, ledger, true)
    }

    /// `open_checkpointed` without looking at the checkpoint or writing one: every record is
    /// verified (what acknowledging a loss below the checkpoint needs).
    pub fn open_ignoring_checkpoint(
        path: &Path,
        keyservice_id: &str,
        key: std::sync::Arc<p256::ecdsa::SigningKey>,
        ledger: &mut super::ledger::Ledger,
    ) -> Result<Self, AuditError> {
        Self::open_signed(path, keyservice_id, key, ledger, false).map(|(log, _)| log)
    }

    fn open_signed(
        path: &Path,
        keyservice_id: &str,
        key: std::sync::Arc<p256::ecdsa::SigningKey>,
        ledger: &mut super::ledger::Ledger,
        use_checkpoint: bool,
    ) -> Result<(Self, VerifiedFrom), AuditError> {
        if let Some(copy) = recover_torn_tail(path)? {
            tracing::error!(
                log = %path.display(), copy = %copy.display(),
                "the audit log ended in a torn record (a crash during an append); the partial \
                 line was removed and the whole file kept as the copy; nothing was answered for it"
            );
        }
        use super::checkpoint::Unmatched;
        let found = match use_checkpoint {
            true => super::checkpoint::load_matching(path, keyservice_id, key.verifying_key()),
            false => Ok(None),
        };
        let checkpoint = match found {
            Ok(found) => found,
            Err(Unmatched::Unusable(why)) => {
                // Not this service's, or not readable: it stands for nothing, and the whole
                // log (signatures included) is verified instead.
                tracing::warn!(log = %path.display(), %why,
                        "not using the audit checkpoint; verifying the whole log");
                None
            }
            Err(Unmatched::LogBehind {
                why,
                lost,
                signature,
            }) => {
                return Err(AuditError::RolledBack {
                    path: path.to_path_buf(),
                    why,
                    lost,
                    signature,
                });
            }
        }
        .and_then(|c| Some((super::ledger::Ledger::from_json(&c.ledger).ok()?, c)));
        let verifying = *key.verifying_key();
        let check = SignatureCheck {
            keyservice_id,
            verifying_key: &verifying,
        };
        let mut unsigned: Option<(u64, String)> = None;
        let mut replay = |ledger: &mut super::ledger::Ledger, r: &Record| {
            if unsigned.is_none() {
                unsigned = signature_problem(r, check).map(|why| (r.seq, why));
            }
            if unsigned.is_none() {
                ledger.restore(r);
            }
        };
        let (log, from) = match checkpoint {
            Some((restored, c)) => {
                *ledger = restored;
                let start = Head {
                    records: c.records,
                    hash: c.hash.clone(),
                    signature: c.record_signature.clone(),
                };
                // The prefix the checkpoint stands for is not re-verified record by record, but
                // its bytes must be the ones the checkpoint signed: an edit inside it (a
                // "refused" rewritten as "granted", the same length) refuses the start.
                let mut prefix = Self::digest(path, c.offset)?;
                if prefix.hex() != c.prefix_sha256 {
                    return Err(AuditError::Broken {
                        path: path.to_path_buf(),
                        line: 0,
                        reason: format!(
                            "its first {} bytes ({} records) are not the ones its checkpoint signed: a record inside them was edited. `confed keyservice audit verify` names it; restore a copy whose records all verify",
                            c.offset, c.records
                        ),
                    });
                }
                let (head, length) = verify_from(path, c.offset, start, |r| replay(ledger, r))?;
                prefix
                    .extend_from_file(path, c.offset, length)
                    .map_err(|source| AuditError::Io {
                        path: path.to_path_buf(),
                        source,
                    })?;
                let from = VerifiedFrom::Checkpoint { records: c.records };
                (Self::opened(path, head, length, prefix)?, from)
            }
            None => {
                let genesis = Head {
                    records: 0,
                    hash: GENESIS_HASH.into(),
                    signature: None,
                };
                let (head, length) = verify_from(path, 0, genesis, |r| replay(ledger, r))?;
                let prefix = Self::digest(path, length)?;
                (
                    Self::opened(path, head, length, prefix)?,
                    VerifiedFrom::Start,
                )
            }
        };
        if let Some((seq, reason)) = unsigned {
            return Err(AuditError::Broken {
                path: path.to_path_buf(),
                line: seq as usize + 1,
                reason: format!(
                    "{reason}. `confed keyservice audit verify` shows the whole log; restore a copy whose records all verify"
                ),
            });
        }
        let log = log.signed_by(keyservice_id, key);
        if from == VerifiedFrom::Start && use_checkpoint {
            log.checkpoint(ledger);
        }
        Ok((log, from))
    }

    /// Writes a checkpoint at the current head (failures are logged: the next start then
    /// verifies more, nothing is lost).
    pub fn checkpoint(&self, ledger: &super::ledger::Ledger) {
        let Some((id, key)) = &self.signer else {
            return;
        };
        let head = (
            self.head.records,
            self.head.hash.as_str(),
            self.head.signature.as_deref(),
        );
        let covered = (self.length, self.prefix.hex());
        if let Err(error) = super::checkpoint::write(&self.path, id, key, head, covered, ledger) {
            tracing::warn!(log = %self.path.display(), %error, "could not write the audit checkpoint");
        }
    }

    /// Signs every record appended from now on with the key service's signing key.
    pub fn signed_by(
        mut self,
        keyservice_id: &str,
        key: std::sync::Arc<p256::ecdsa::SigningKey>,
    ) -> Self {
        self.signer = Some((keyservice_id.to_string(), key));
        self
    }

    pub fn head(&self) -> &Head {
        &self.head
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where to start reading for record `seq`: its offset when this process appended it
    /// (recently), else the file's start.
    pub fn offset_hint(&self, seq: u64) -> (u64, u64) {
        match self.recent.front() {
            Some(&(first, _)) if seq >= first => {
                let index = (seq - first) as usize;
                self.recent.get(index).map_or((0, 0), |&(s, at)| (s, at))
            }
            _ => (0, 0),
        }
    }

    /// The latest head, signed (what `GET /v1/audit/head` serves).
    pub fn signed_head(&self, keyservice_id: &str) -> SignedHead {
        SignedHead {
            keyservice_id: keyservice_id.to_string(),
            records: self.head.records,
            hash: self.head.hash.clone(),
            signature: self.head.signature.clone(),
        }
    }

    /// Appends a decision durably (fsync) and returns its record.
    pub fn append(&mut self, decision: Decision) -> Result<Record, AuditError> {
        let seq = self.head.records;
        let hash = chain_hash(seq, &self.head.hash, &decision);
        let signature = self.signer.as_ref().map(|(id, key)| {
            confed_attestation::release::sign_text(key, &head_text(id, seq, &hash))
        });
        let record = Record {
            seq,
            prev_hash: self.head.hash.clone(),
            decision,
            hash: hash.clone(),
            signature: signature.clone(),
        };
        let mut line = serde_json::to_vec(&record).expect("audit records serialize");
        line.push(b'\n');
        let io = |source| AuditError::Io {
            path: self.path.clone(),
            source,
        };
        if self.broken {
            return Err(io(std::io::Error::other(
                "an earlier append failed and could not be undone; restart the key service",
            )));
        }
        let before = self.file.metadata().map_err(io)?.len();
        if let Err(error) = self
            .file
            .write_all(&line)
            .and_then(|_| self.file.sync_data())
        {
            // Nothing was answered for this record: take back whatever part of it reached the
            // file, so the next append chains onto the head, not onto half a line. If even that
            // fails, append nothing more until a restart verifies the file.
            let undone = self
                .file
                .set_len(before)
                .and_then(|_| self.file.sync_data());
            self.broken = undone.is_err();
            return Err(io(error));
        }
        self.head = Head {
            records: seq + 1,
            hash,
            signature,
        };
        self.length = before + line.len() as u64;
        self.prefix.extend(&line);
        if self.recent.len() == RECENT_OFFSETS {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, before));
        Ok(record)
    }
}

/// A granted decision of key service `ks1` for round `n + 1` of task `task` (tests).
#[cfg(test)]
pub(crate) fn test_grant(n: u64, commitment: &str) -> Decision {
    Decision {
        at: 1_000 + n as i64,
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
        commitment_sha256: Some(commitment.into()),
        policy_sha256: Some("p".repeat(64)),
        policy_rounds: Some(1000),
        enclave_signing_key: None,
        key_scope: None,
        acknowledged_loss: None,
        included_sha256: None,
        included: None,
    }
}

mod history;
pub mod prefix;
pub use history::{find_acknowledgement, head_of, read_records};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod start_tests;
