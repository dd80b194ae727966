//! Time in the front ends: the injected clock (`confed_protocol::clock`, shared with the key
//! service and devices) and RFC 3339 formatting for API answers.

pub use confed_protocol::clock::{
    Clock, ManualClock, Millis, Seconds, SystemClock, millis_of, seconds_of,
};

/// Formats Unix milliseconds as RFC 3339 (`2026-11-30T08:53:27.123Z`).
pub fn rfc3339(millis: Millis) -> String {
    use time::format_description::well_known::Rfc3339;
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("@{millis}ms"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc_with_millis() {
        assert_eq!(rfc3339(1_764_492_807_123), "2025-11-30T08:53:27.123Z");
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    }
}
