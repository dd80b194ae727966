//! Time as an injected dependency, so deadlines, expiries and leases are tested without sleeping.
//! All timestamps in confed are Unix milliseconds (UTC) as `i64`, which both SQLite and
//! PostgreSQL store as `BIGINT` without conversion.

use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Unix time in milliseconds.
pub type Millis = i64;

pub trait Clock: Send + Sync + Debug {
    fn now_millis(&self) -> Millis;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_millis(&self) -> Millis {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as Millis)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to: for tests and simulations.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn starting_at(millis: Millis) -> Self {
        Self(AtomicI64::new(millis))
    }

    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as Millis, Ordering::SeqCst);
    }

    pub fn set(&self, millis: Millis) {
        self.0.store(millis, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::starting_at(1_000);
        assert_eq!(clock.now_millis(), 1_000);
        clock.advance(Duration::from_secs(2));
        assert_eq!(clock.now_millis(), 3_000);
        clock.set(5);
        assert_eq!(clock.now_millis(), 5);
    }
}
