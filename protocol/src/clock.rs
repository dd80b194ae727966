//! Time as an injected dependency, so deadlines, expiries and leases are tested without sleeping.
//! Points in time are Unix milliseconds (UTC) inside (`Millis`) and Unix seconds on the wire
//! (`Seconds`): two types, so one is never passed for the other, nor a duration for either. Both
//! hold an `i64`, which SQLite and PostgreSQL store as `BIGINT` (bound as `.0`), and serialize as
//! that plain number.

use std::fmt::Debug;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in Unix time, in milliseconds.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Millis(pub i64);

/// A point in Unix time, in seconds (what the wire carries: key validity, expiries, token times).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Seconds(pub i64);

impl Millis {
    /// This time plus `duration` (saturating).
    pub fn plus(self, duration: Duration) -> Self {
        Self(self.0.saturating_add(duration_millis(duration)))
    }

    /// This time minus `duration` (saturating).
    pub fn minus(self, duration: Duration) -> Self {
        Self(self.0.saturating_sub(duration_millis(duration)))
    }

    /// The whole seconds of this time (floored, also before 1970).
    pub fn seconds(self) -> Seconds {
        Seconds(self.0.div_euclid(1000))
    }
}

impl Seconds {
    /// This time in milliseconds (saturating).
    pub fn millis(self) -> Millis {
        Millis(self.0.saturating_mul(1000))
    }
}

impl std::fmt::Display for Millis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::fmt::Display for Seconds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

fn duration_millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// The whole seconds of a Unix time in milliseconds (floored, also before 1970).
pub fn seconds_of(millis: Millis) -> Seconds {
    millis.seconds()
}

/// A Unix time in seconds as milliseconds (saturating).
pub fn millis_of(seconds: Seconds) -> Millis {
    seconds.millis()
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
            .map(|d| Millis(duration_millis(d)))
            .unwrap_or_default()
    }
}

/// A clock that only moves when told to: for tests and simulations.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn starting_at(millis: Millis) -> Self {
        Self(AtomicI64::new(millis.0))
    }

    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(duration_millis(by), Ordering::SeqCst);
    }

    pub fn set(&self, millis: Millis) {
        self.0.store(millis.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_millis(&self) -> Millis {
        Millis(self.0.load(Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_floor_and_millis_saturate() {
        assert_eq!(seconds_of(Millis(1_999)), Seconds(1));
        assert_eq!(seconds_of(Millis(-1)), Seconds(-1));
        assert_eq!(millis_of(Seconds(3)), Millis(3_000));
        assert_eq!(millis_of(Seconds(i64::MAX)), Millis(i64::MAX));
        assert_eq!(Millis(1_000).plus(Duration::from_secs(2)), Millis(3_000));
        assert_eq!(Millis(3_000).minus(Duration::from_secs(2)), Millis(1_000));
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::starting_at(Millis(1_000));
        assert_eq!(clock.now_millis(), Millis(1_000));
        clock.advance(Duration::from_secs(2));
        assert_eq!(clock.now_millis(), Millis(3_000));
        clock.set(Millis(5));
        assert_eq!(clock.now_millis(), Millis(5));
    }
}
