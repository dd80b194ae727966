//! Which refusals are written to the audit log. Every grant is written; a refusal is evidence
//! the policy's issuer signed and is worth a record, but the same token refused again says
//! nothing new, and an attacker holding one issuer-signed token (from a Confidential Space VM of
//! its own: another image, audience, or a stale token) could replay it with fresh nonces and
//! have every refusal signed and fsync'd: 6,267 records (7 MB) in 15 s from one client, about
//! 40 GB a day. So a token refused once is not written again, and at most `PER_MINUTE`
//! refusals are written a minute; the rest are counted (`confed_keyservice_refusals_unrecorded_total`,
//! by `why`), answered exactly as the recorded ones (403 with the failed checks), and summarized:
//! the first decision of a later minute writes one `refusals_unrecorded` record for the minute,
//! with the count by reason and check (`Summary`), so the log says that they happened.
//!
//! A refusal by the release ledger (`release_ledger`: a second commitment for a committed round,
//! another policy for a task) is always written, whatever the budget: it is the sign of a front end
//! run against its devices (docs/operations.md), and it needs evidence that passed every other
//! check, a fresh attestation of a genuine enclave each, so it cannot be flooded cheaply.

use std::collections::{BTreeMap, HashSet, VecDeque};

/// Refusal records written per minute, at most: about 1.1 KB each, so at most
/// `PER_MINUTE * 1440 * 1.1 KB` = 32 MB of refusals a day (docs/operations.md).
pub const PER_MINUTE: u32 = 20;

/// Distinct refused tokens remembered (SHA-256 hex, 64 bytes each: about 1 MB).
const REMEMBERED: usize = 16_384;
/// The failed check whose refusals are always written.
pub const ALWAYS_WRITTEN: &str = "release_ledger";
/// The `decision` of a summary record.
pub const SUMMARY_DECISION: &str = "refusals_unrecorded";
/// Checks a summary names, at most (the most frequent).
const SUMMARY_CHECKS: usize = 16;

/// Why a refusal was not written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unrecorded {
    /// The same token was refused (and written) before.
    Repeat,
    /// This minute's refusal records are spent.
    OverBudget,
}

impl Unrecorded {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Repeat => "repeat",
            Self::OverBudget => "rate",
        }
    }
}

/// The refusals of one minute that were not written one by one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    /// The minute (Unix seconds / 60).
    pub minute: i64,
    pub repeat: u64,
    pub rate: u64,
    /// How often each failed check was among them.
    pub checks: BTreeMap<String, u64>,
}

impl Summary {
    /// The summary record's reason text.
    pub fn reason(&self) -> String {
        format!(
            "{} refusals in the minute from {} were not written one by one: {} repeated a token refused before, {} were over the {PER_MINUTE}-a-minute budget",
            self.repeat + self.rate,
            self.minute * 60,
            self.repeat,
            self.rate
        )
    }

    /// Its failed checks, the most frequent first, as `check:count`.
    pub fn failed_checks(&self) -> Vec<String> {
        let mut counted: Vec<(&String, &u64)> = self.checks.iter().collect();
        counted.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        counted
            .into_iter()
            .take(SUMMARY_CHECKS)
            .map(|(check, count)| format!("{check}:{count}"))
            .collect()
    }
}

#[derive(Debug, Default)]
pub struct RefusalBudget {
    minute: i64,
    written: u32,
    seen: HashSet<String>,
    order: VecDeque<String>,
    /// Refusals not written in `pending.minute`, until a later minute's decision writes them.
    pending: Option<Summary>,
}

impl RefusalBudget {
    /// Whether a refusal of the token with SHA-256 `token_sha256`, failing `failed_checks`, at
    /// `now` (Unix seconds) is written; if so it counts against this minute and the token is
    /// remembered; if not it is counted in the minute's summary.
    pub fn admit(
        &mut self,
        token_sha256: &str,
        failed_checks: &[String],
        now: i64,
    ) -> Result<(), Unrecorded> {
        if failed_checks.iter().any(|c| c == ALWAYS_WRITTEN) {
            return Ok(());
        }
        let minute = now.div_euclid(60);
        let unrecorded = if self.seen.contains(token_sha256) {
            Some(Unrecorded::Repeat)
        } else {
            if minute != self.minute {
                self.minute = minute;
                self.written = 0;
            }
            (self.written >= PER_MINUTE).then_some(Unrecorded::OverBudget)
        };
        if let Some(why) = unrecorded {
            let summary = self.pending.get_or_insert_with(|| Summary {
                minute,
                ..Summary::default()
            });
            match why {
                Unrecorded::Repeat => summary.repeat += 1,
                Unrecorded::OverBudget => summary.rate += 1,
            }
            for check in failed_checks {
                *summary.checks.entry(check.clone()).or_default() += 1;
            }
            return Err(why);
        }
        self.written += 1;
        if self.order.len() >= REMEMBERED
            && let Some(oldest) = self.order.pop_front()
        {
            self.seen.remove(&oldest);
        }
        self.seen.insert(token_sha256.to_string());
        self.order.push_back(token_sha256.to_string());
        Ok(())
    }

    /// The summary of an earlier minute than `now`'s, to be written before this decision (one
    /// record a minute at most, outside the budget).
    pub fn take_summary(&mut self, now: i64) -> Option<Summary> {
        if self
            .pending
            .as_ref()
            .is_some_and(|s| s.minute < now.div_euclid(60))
        {
            self.pending.take()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_token_refused_again_is_not_written_again() {
        let mut budget = RefusalBudget::default();
        assert_eq!(budget.admit("t1", &[], 100), Ok(()));
        assert_eq!(budget.admit("t1", &[], 101), Err(Unrecorded::Repeat));
        assert_eq!(budget.admit("t1", &[], 10_000), Err(Unrecorded::Repeat));
        assert_eq!(budget.admit("t2", &[], 101), Ok(()));
    }

    #[test]
    fn refusal_records_are_bounded_per_minute() {
        let mut budget = RefusalBudget::default();
        for i in 0..PER_MINUTE {
            assert_eq!(budget.admit(&format!("a{i}"), &[], 120), Ok(()));
        }
        assert_eq!(budget.admit("over", &[], 179), Err(Unrecorded::OverBudget));
        assert_eq!(budget.admit("next-minute", &[], 180), Ok(()));
    }

    #[test]
    fn memory_stays_bounded() {
        let mut budget = RefusalBudget::default();
        for i in 0..(REMEMBERED as i64 + 10) {
            // One a minute, so the rate never binds.
            budget.admit(&format!("t{i}"), &[], i * 60).unwrap();
        }
        assert_eq!(budget.seen.len(), REMEMBERED);
        assert_eq!(
            budget.admit("t0", &[], 0),
            Ok(()),
            "the oldest was forgotten"
        );
    }

    #[test]
    fn ledger_refusals_are_written_past_the_budget_and_the_rest_are_summarized_per_minute() {
        let mut budget = RefusalBudget::default();
        let token = ["token".to_string()];
        for i in 0..PER_MINUTE {
            budget.admit(&format!("a{i}"), &token, 120).unwrap();
        }
        assert_eq!(budget.admit("b", &token, 130), Err(Unrecorded::OverBudget));
        assert_eq!(budget.admit("a0", &token, 131), Err(Unrecorded::Repeat));
        // The refusal that matters is written whatever the budget, the same token or not.
        let ledger = ["release_ledger".to_string()];
        assert_eq!(budget.admit("c", &ledger, 140), Ok(()));
        assert_eq!(budget.admit("c", &ledger, 141), Ok(()));
        // Nothing to summarize within the minute; the next minute's first decision writes it.
        assert_eq!(budget.take_summary(179), None);
        let summary = budget.take_summary(180).unwrap();
        assert_eq!((summary.minute, summary.repeat, summary.rate), (2, 1, 1));
        assert_eq!(summary.failed_checks(), ["token:2"]);
        assert!(
            summary.reason().contains("2 refusals"),
            "{}",
            summary.reason()
        );
        assert_eq!(budget.take_summary(240), None, "written once");
    }
}
