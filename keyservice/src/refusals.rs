//! Which refusals are written to the audit log. Every grant is written; a refusal is evidence
//! the policy's issuer signed and is worth a record, but the same token refused again says
//! nothing new, and an attacker holding one issuer-signed token (from a Confidential Space VM of
//! its own: another image, audience, or a stale token) could replay it with fresh nonces and
//! have every refusal signed and fsync'd: 6,267 records (7 MB) in 15 s from one client, about
//! 40 GB a day. So a token refused once is not written again, and at most `PER_MINUTE`
//! refusals are written a minute; the rest are counted (`confed_keyservice_refusals_unrecorded_total`,
//! by `why`) and answered exactly as the recorded ones (403 with the failed checks).

use std::collections::{HashSet, VecDeque};

/// Refusal records written per minute, at most: about 1.1 KB each, so at most
/// `PER_MINUTE * 1440 * 1.1 KB` = 32 MB of refusals a day (docs/operations.md).
pub const PER_MINUTE: u32 = 20;

/// Distinct refused tokens remembered (SHA-256 hex, 64 bytes each: about 1 MB).
const REMEMBERED: usize = 16_384;

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

#[derive(Debug, Default)]
pub struct RefusalBudget {
    minute: i64,
    written: u32,
    seen: HashSet<String>,
    order: VecDeque<String>,
}

impl RefusalBudget {
    /// Whether a refusal of the token with SHA-256 `token_sha256` at `now` (Unix seconds) is
    /// written; if so it counts against this minute and the token is remembered.
    pub fn admit(&mut self, token_sha256: &str, now: i64) -> Result<(), Unrecorded> {
        if self.seen.contains(token_sha256) {
            return Err(Unrecorded::Repeat);
        }
        let minute = now.div_euclid(60);
        if minute != self.minute {
            self.minute = minute;
            self.written = 0;
        }
        if self.written >= PER_MINUTE {
            return Err(Unrecorded::OverBudget);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_token_refused_again_is_not_written_again() {
        let mut budget = RefusalBudget::default();
        assert_eq!(budget.admit("t1", 100), Ok(()));
        assert_eq!(budget.admit("t1", 101), Err(Unrecorded::Repeat));
        assert_eq!(budget.admit("t1", 10_000), Err(Unrecorded::Repeat));
        assert_eq!(budget.admit("t2", 101), Ok(()));
    }

    #[test]
    fn refusal_records_are_bounded_per_minute() {
        let mut budget = RefusalBudget::default();
        for i in 0..PER_MINUTE {
            assert_eq!(budget.admit(&format!("a{i}"), 120), Ok(()));
        }
        assert_eq!(budget.admit("over", 179), Err(Unrecorded::OverBudget));
        assert_eq!(budget.admit("next-minute", 180), Ok(()));
    }

    #[test]
    fn memory_stays_bounded() {
        let mut budget = RefusalBudget::default();
        for i in 0..(REMEMBERED as i64 + 10) {
            // One a minute, so the rate never binds.
            budget.admit(&format!("t{i}"), i * 60).unwrap();
        }
        assert_eq!(budget.seen.len(), REMEMBERED);
        assert_eq!(budget.admit("t0", 0), Ok(()), "the oldest was forgotten");
    }
}
