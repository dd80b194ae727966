//! The release ledger: what makes a round's release happen once, held by parties the front ends'
//! operator does not control.
//!
//! A key service releases its share for a (task, round) only against a release commitment
//! (`confed_attestation::release`). The first commitment for a round is recorded; later requests
//! for that round get the share again only for the identical commitment (so a crashed job can
//! finish in a new enclave), never for another one. The first commitment of a task also pins the
//! task's policy: every later round must be under the same policy hash, and rounds beyond the
//! policy's are refused. Under a tree mechanism (DP-FTRL) the first commitment of each tree also
//! pins the tree's key: the tree's noise is derived from the round's private key and reused by
//! every later round of the tree, so a round under another key would not continue the tree's
//! noise (`confed_protocol::policy::Mechanism::key_scope`). The enclave goes on only when a quorum q = max(t, ceil((n+t)/2)) of
//! key services recorded its commitment (`confed_attestation::release::quorum`); any two quorums
//! share t key services, so a second commitment for a round needs t of them to betray or lose
//! their ledgers.
//!
//! The ledger is not a file of its own: every granted decision in the audit log carries its
//! commitment, and the audit log is written and fsync'd before the answer leaves, so the ledger
//! is exactly the audit log's granted records, rebuilt when the service starts. State is per
//! (task, round): one digest, whatever the number of contributions. When a task ends (every
//! planned round committed) and `CLOSE_AFTER_SECONDS` have passed since its last commitment (time
//! for a crashed final job to finish), the task is compacted to a tombstone: its per-round
//! digests are dropped and every further request for it is refused.

use std::collections::{BTreeMap, HashMap};

use super::audit::Record;

/// The `decision` of an audit record that agrees to unmask one included set of a round.
pub const UNMASK_AGREED: &str = "unmask_agreed";

/// How long after its last commitment a task whose every planned round is committed stays open
/// for identical repeats (a crashed final job finishing in a new enclave) before it is closed.
pub const CLOSE_AFTER_SECONDS: i64 = 8 * 24 * 3600;

/// One task's pinned policy and its committed rounds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct TaskEntry {
    policy_sha256: String,
    rounds: u32,
    /// round -> commitment digest (emptied when the task is closed).
    committed: BTreeMap<u64, String>,
    /// Unix seconds of the latest commitment.
    last_commit_at: i64,
    /// key scope (a tree) -> the key its first commitment was under (tree mechanisms only).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    scoped_keys: BTreeMap<u64, String>,
    /// Every planned round was committed long enough ago: nothing more is released.
    closed: bool,
    /// round -> the included set this service agreed to unmask (masked tasks; one per round).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    unmasked: BTreeMap<u64, String>,
}

impl TaskEntry {
    fn complete(&self) -> bool {
        self.closed || self.committed.len() as u64 >= u64::from(self.rounds)
    }

    /// Closes a complete task whose last commitment is old enough; returns whether it did.
    fn compact(&mut self, now: i64) -> bool {
        if !self.closed && self.complete() && now - self.last_commit_at >= CLOSE_AFTER_SECONDS {
            self.closed = true;
            self.committed = BTreeMap::new();
            self.scoped_keys = BTreeMap::new();
            self.unmasked = BTreeMap::new();
            return true;
        }
        false
    }
}

/// What a grant would do to the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The round has no commitment yet: this one is recorded.
    New,
    /// The round already has exactly this commitment: the share is released again.
    Repeat,
}

/// What a commitment is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<'a> {
    pub task_id: &'a str,
    pub round: u64,
    pub commitment_sha256: &'a str,
    pub policy_sha256: &'a str,
    pub policy_rounds: u32,
    /// The key the round is encrypted under, and the rounds that must share it (if any).
    pub key_id: &'a str,
    pub key_scope: Option<u64>,
    /// Unix seconds of the request (the key service's clock).
    pub at: i64,
}

#[derive(Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Ledger {
    tasks: HashMap<String, TaskEntry>,
    /// The heads of lost records the operator acknowledged (`loss_acknowledged` records),
    /// exactly: a peer's witnessed head among them no longer stops grants (`rollback.rs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    acknowledged_losses: Vec<super::audit::LostHead>,
}

impl Ledger {
    /// The ledger as JSON with tasks in a fixed order (what a checkpoint stores and signs).
    pub fn to_json(&self) -> String {
        let ordered: BTreeMap<&String, &TaskEntry> = self.tasks.iter().collect();
        let mut json = serde_json::json!({ "tasks": ordered });
        if !self.acknowledged_losses.is_empty() {
            json["acknowledged_losses"] = serde_json::json!(self.acknowledged_losses);
        }
        serde_json::to_string(&json).expect("the ledger serializes")
    }

    pub fn from_json(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Rebuilds the ledger from an audit log's records (only granted ones with a commitment).
    pub fn restore(&mut self, record: &Record) {
        let d = &record.decision;
        if let Some(lost) = &d.acknowledged_loss {
            if !self.acknowledged_losses.contains(lost) {
                self.acknowledged_losses.push(lost.clone());
            }
            return;
        }
        if d.decision == UNMASK_AGREED {
            if let (Some(commitment), Some(included)) = (&d.commitment_sha256, &d.included_sha256)
                && self
                    .admit_unmask(&d.task_id, d.round, commitment, included)
                    .is_ok()
            {
                self.record_unmask(&d.task_id, d.round, included);
            }
            return;
        }
        if super::audit::Verdict::parse(&d.decision) != Some(super::audit::Verdict::Granted) {
            return;
        }
        if let (Some(commitment), Some(policy), Some(rounds)) =
            (&d.commitment_sha256, &d.policy_sha256, d.policy_rounds)
        {
            self.record(&Entry {
                task_id: &d.task_id,
                round: d.round,
                commitment_sha256: commitment,
                policy_sha256: policy,
                policy_rounds: rounds,
                key_id: &d.key_id,
                key_scope: d.key_scope,
                at: d.at,
            });
        }
    }

    /// Closes every complete task whose last commitment is older than `CLOSE_AFTER_SECONDS`;
    /// returns how many it closed (run at start, after `restore`).
    pub fn compact(&mut self, now: i64) -> usize {
        self.tasks
            .values_mut()
            .map(|t| t.compact(now))
            .filter(|&closed| closed)
            .count()
    }

    /// Whether a share may be released for `entry`; `Err` says why not. Closes the entry's task
    /// first if it is due.
    pub fn admit(&mut self, entry: &Entry<'_>) -> Result<Admission, String> {
        if let Some(task) = self.tasks.get_mut(entry.task_id) {
            task.compact(entry.at);
        }
        if entry.round == 0 || entry.round > u64::from(entry.policy_rounds) {
            return Err(format!(
                "round {} is outside the policy's {} rounds",
                entry.round, entry.policy_rounds
            ));
        }
        let Some(task) = self.tasks.get(entry.task_id) else {
            return Ok(Admission::New);
        };
        if task.closed {
            return Err(format!(
                "task {} is closed: every one of its {} rounds was released",
                entry.task_id, task.rounds
            ));
        }
        if task.policy_sha256 != entry.policy_sha256 {
            return Err(format!(
                "task {} was committed under policy {}, this request names policy {}",
                entry.task_id, task.policy_sha256, entry.policy_sha256
            ));
        }
        if let Some(scope) = entry.key_scope
            && let Some(pinned) = task.scoped_keys.get(&scope)
            && pinned != entry.key_id
        {
            return Err(format!(
                "round {} of task {} is in tree {scope}, whose rounds are released under key {pinned}; this request names key {} (tree noise continues only under one key)",
                entry.round, entry.task_id, entry.key_id
            ));
        }
        match task.committed.get(&entry.round) {
            None => Ok(Admission::New),
            Some(existing) if existing == entry.commitment_sha256 => Ok(Admission::Repeat),
            Some(existing) => Err(format!(
                "round {} of task {} is already committed to release {existing}; a round is released once",
                entry.round, entry.task_id
            )),
        }
    }

    /// Records an admitted commitment (idempotent).
    pub fn record(&mut self, entry: &Entry<'_>) {
        let task = self
            .tasks
            .entry(entry.task_id.to_string())
            .or_insert_with(|| TaskEntry {
                policy_sha256: entry.policy_sha256.to_string(),
                rounds: entry.policy_rounds,
                committed: BTreeMap::new(),
                last_commit_at: entry.at,
                closed: false,
                scoped_keys: BTreeMap::new(),
                unmasked: BTreeMap::new(),
            });
        if task.closed {
            return;
        }
        task.last_commit_at = task.last_commit_at.max(entry.at);
        if let Some(scope) = entry.key_scope {
            task.scoped_keys
                .entry(scope)
                .or_insert_with(|| entry.key_id.to_string());
        }
        task.committed
            .entry(entry.round)
            .or_insert_with(|| entry.commitment_sha256.to_string());
    }

    /// The task's pinned policy hash and the round's admitted commitment, if both are known
    /// (and the task is not closed): what an unmask request must name.
    pub fn committed(&self, task_id: &str, round: u64) -> Option<(&str, &str)> {
        let task = self.tasks.get(task_id).filter(|t| !t.closed)?;
        let commitment = task.committed.get(&round)?;
        Some((task.policy_sha256.as_str(), commitment.as_str()))
    }

    /// The included set agreed for the round, if any.
    pub fn unmask_agreed(&self, task_id: &str, round: u64) -> Option<&str> {
        self.tasks
            .get(task_id)?
            .unmasked
            .get(&round)
            .map(String::as_str)
    }

    /// Whether this service may agree to unmask `included_sha256` for the round whose admitted
    /// commitment is `commitment_sha256`: `New` the first time (append the record, then
    /// `record_unmask`), `Repeat` for the same set; refused for a round without that commitment
    /// or with another set agreed. One set per round, whatever asks: the masks' `q - 1` bound
    /// rests on it (docs/secure-aggregation.md, "Why the agreement").
    pub fn admit_unmask(
        &self,
        task_id: &str,
        round: u64,
        commitment_sha256: &str,
        included_sha256: &str,
    ) -> Result<Admission, String> {
        let task = self
            .tasks
            .get(task_id)
            .filter(|t| !t.closed)
            .ok_or_else(|| format!("task {task_id} has no open release commitment here"))?;
        if task.committed.get(&round).map(String::as_str) != Some(commitment_sha256) {
            return Err(format!(
                "round {round} of task {task_id} is not committed to release {commitment_sha256} here"
            ));
        }
        match task.unmasked.get(&round) {
            Some(agreed) if agreed == included_sha256 => Ok(Admission::Repeat),
            Some(agreed) => Err(format!(
                "round {round} of task {task_id} is already agreed to unmask the included set {agreed}; a round is unmasked for one set"
            )),
            None => Ok(Admission::New),
        }
    }

    /// Records an admitted agreement (idempotent; the first set of a round stays).
    pub fn record_unmask(&mut self, task_id: &str, round: u64, included_sha256: &str) {
        if let Some(task) = self.tasks.get_mut(task_id).filter(|t| !t.closed) {
            task.unmasked
                .entry(round)
                .or_insert_with(|| included_sha256.to_string());
        }
    }

    /// Committed rounds over all tasks.
    /// Whether the operator acknowledged losing the records up to exactly this head.
    pub fn acknowledged(&self, head: &super::audit::LostHead) -> bool {
        self.acknowledged_losses.contains(head)
    }

    pub fn rounds(&self) -> usize {
        self.tasks.values().map(|t| t.committed.len()).sum()
    }

    /// Tasks whose every planned round is committed (closed or not).
    pub fn completed_tasks(&self) -> usize {
        self.tasks.values().filter(|t| t.complete()).count()
    }

    /// Tasks closed (compacted to a tombstone).
    pub fn closed_tasks(&self) -> usize {
        self.tasks.values().filter(|t| t.closed).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry<'a>(round: u64, commitment: &'a str, policy: &'a str) -> Entry<'a> {
        Entry {
            task_id: "t1",
            round,
            commitment_sha256: commitment,
            policy_sha256: policy,
            policy_rounds: 3,
            key_id: "k1",
            key_scope: None,
            at: 1000,
        }
    }

    /// A tree task's rounds continue one noise tree only under one key: the first commitment of
    /// each tree pins its key, a round of the same tree under another key is refused, and the
    /// next tree may use another key (rotation between trees).
    #[test]
    fn a_tree_pins_its_first_rounds_key_and_survives_a_restore() {
        let mut ledger = Ledger::default();
        let tree = |round, commitment, key, scope| Entry {
            key_id: key,
            key_scope: Some(scope),
            ..entry(round, commitment, "p")
        };
        ledger.record(&tree(1, "c1", "k1", 0));
        let refused = ledger.admit(&tree(2, "c2", "k2", 0)).unwrap_err();
        assert!(refused.contains("under key k1"), "{refused}");
        assert_eq!(ledger.admit(&tree(2, "c2", "k1", 0)), Ok(Admission::New));
        assert_eq!(ledger.admit(&tree(3, "c3", "k2", 1)), Ok(Admission::New));
        // The checkpoint keeps the pin.
        let restored = Ledger::from_json(&ledger.to_json()).unwrap();
        let mut restored = restored;
        assert!(restored.admit(&tree(2, "c2", "k2", 0)).is_err());
        // Gaussian tasks pin nothing.
        let mut plain = Ledger::default();
        plain.record(&entry(1, "c1", "p"));
        let other_key = Entry {
            key_id: "k2",
            ..entry(2, "c2", "p")
        };
        assert_eq!(plain.admit(&other_key), Ok(Admission::New));
    }

    #[test]
    fn a_round_admits_its_first_commitment_and_then_only_that_one() {
        let mut ledger = Ledger::default();
        assert_eq!(ledger.admit(&entry(1, "c1", "p")), Ok(Admission::New));
        ledger.record(&entry(1, "c1", "p"));
        assert_eq!(ledger.admit(&entry(1, "c1", "p")), Ok(Admission::Repeat));
        let refused = ledger.admit(&entry(1, "c2", "p")).unwrap_err();
        assert!(refused.contains("released once"), "{refused}");
        assert_eq!(ledger.admit(&entry(2, "c2", "p")), Ok(Admission::New));
        assert_eq!(ledger.rounds(), 1);
    }

    #[test]
    fn rounds_beyond_the_policy_and_another_policy_for_the_task_are_refused() {
        let mut ledger = Ledger::default();
        assert!(
            ledger
                .admit(&entry(4, "c", "p"))
                .unwrap_err()
                .contains("outside")
        );
        assert!(ledger.admit(&entry(0, "c", "p")).is_err());
        ledger.record(&entry(1, "c1", "p"));
        let refused = ledger.admit(&entry(2, "c2", "q")).unwrap_err();
        assert!(refused.contains("policy"), "{refused}");
    }

    #[test]
    fn a_task_is_complete_when_every_planned_round_is_committed() {
        let mut ledger = Ledger::default();
        for round in 1..=3 {
            ledger.record(&entry(round, "c", "p"));
        }
        assert_eq!(ledger.completed_tasks(), 1);
    }

    /// A complete task stays open for identical repeats for a while (a crashed final job), then
    /// is compacted to a tombstone: its per-round state is gone and nothing more is released.
    #[test]
    fn a_complete_task_is_compacted_to_a_tombstone_after_the_grace() {
        let mut ledger = Ledger::default();
        for round in 1..=3 {
            ledger.record(&entry(round, &format!("c{round}"), "p"));
        }
        let soon = Entry {
            at: 1000 + CLOSE_AFTER_SECONDS - 1,
            ..entry(3, "c3", "p")
        };
        assert_eq!(ledger.admit(&soon), Ok(Admission::Repeat));
        let later = Entry {
            at: 1000 + CLOSE_AFTER_SECONDS,
            ..entry(3, "c3", "p")
        };
        let refused = ledger.admit(&later).unwrap_err();
        assert!(refused.contains("closed"), "{refused}");
        assert_eq!(ledger.closed_tasks(), 1);
        assert_eq!(ledger.rounds(), 0, "the per-round digests are dropped");
        // An incomplete task is never closed, however old.
        let mut open = Ledger::default();
        open.record(&entry(1, "c1", "p"));
        assert_eq!(open.compact(i64::MAX / 2), 0);
        assert!(
            open.admit(&Entry {
                at: i64::MAX / 2,
                ..entry(2, "c2", "p")
            })
            .is_ok()
        );
    }

    /// One included set per round, only for a round committed to that release, kept through a
    /// rebuild from the audit log's records and dropped with the task when it closes.
    #[test]
    fn a_round_is_unmasked_for_one_set_of_its_own_commitment() {
        let mut ledger = Ledger::default();
        assert!(
            ledger.admit_unmask("t1", 1, "c1", "s1").is_err(),
            "no commitment"
        );
        ledger.record(&entry(1, "c1", "p"));
        assert!(
            ledger.admit_unmask("t1", 1, "c2", "s1").is_err(),
            "another release"
        );
        assert_eq!(ledger.admit_unmask("t1", 1, "c1", "s1"), Ok(Admission::New));
        ledger.record_unmask("t1", 1, "s1");
        assert_eq!(
            ledger.admit_unmask("t1", 1, "c1", "s1"),
            Ok(Admission::Repeat)
        );
        let other = ledger.admit_unmask("t1", 1, "c1", "s2").unwrap_err();
        assert!(other.contains("one set"), "{other}");
        ledger.record_unmask("t1", 1, "s2");
        assert_eq!(
            ledger.unmask_agreed("t1", 1),
            Some("s1"),
            "the first set stays"
        );

        // Rebuilt from records: the grant, then the agreement.
        let mut rebuilt = Ledger::default();
        let mut grant = crate::audit::test_grant(0, "c1");
        grant.task_id = "t1".into();
        grant.policy_sha256 = Some("p".into());
        grant.policy_rounds = Some(3);
        let mut agreed = crate::audit::Decision::note(1001, "ks1", UNMASK_AGREED, String::new());
        agreed.task_id = "t1".into();
        agreed.round = 1;
        agreed.commitment_sha256 = Some("c1".into());
        agreed.included_sha256 = Some("s1".into());
        for decision in [grant, agreed] {
            rebuilt.restore(&Record {
                seq: 0,
                prev_hash: String::new(),
                decision,
                hash: String::new(),
                signature: None,
            });
        }
        assert_eq!(rebuilt.unmask_agreed("t1", 1), Some("s1"));
        assert!(rebuilt.to_json().contains("\"unmasked\":{\"1\":\"s1\"}"));
    }
}
