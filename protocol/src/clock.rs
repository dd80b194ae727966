//! Time as an injected dependency, so deadlines, expiries and leases are tested without sleeping.
//! All timestamps in confed are Unix milliseconds (UTC) as `i64`, which both SQLite and
//! PostgreSQL store as `BIGINT` without conversion.

use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Unix time in milliseconds.
pub type Millis = i64;

/// Unix time in seconds (what the wire carries: key validity, expiries, token times).
pub type Seconds = i64;

/// The whole seconds of a Unix time in milliseconds (floored, also before 1970).
pub fn seconds_of(millis: Millis) -> Seconds {
    millis.div_euclid(1000)
}

/// A Unix time or duration in seconds as milliseconds (saturating).
pub fn millis_of(seconds: Seconds) -> Millis {
    seconds.saturating_mul(1000)
}

pub trait Clock: Send + Sync + Debug {
    fn now_millis(&self) -> Millis;

    /// `now_millis` in whole seconds.
    fn now_seconds(&self) -> Seconds {
        seconds_of(self.now_millis())
    }
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
    fn seconds_floor_and_millis_saturate() {
        assert_eq!(seconds_of(1_999), 1);
        assert_eq!(seconds_of(-1), -1);
        assert_eq!(millis_of(3), 3_000);
        assert_eq!(millis_of(i64::MAX), i64::MAX);
    }

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
