//! Time in the front ends: the injected clock (`confed_protocol::clock`, shared with the key
//! service and devices) and RFC 3339 formatting for API answers.

pub use confed_protocol::clock::{
    Clock, ManualClock, Millis, Seconds, SystemClock, millis_of, seconds_of,
};

/// Formats Unix milliseconds as RFC 3339 in UTC, as `docs/protocol.md` documents it: seconds
/// precision when the milliseconds are zero (`2026-11-30T08:53:27Z`), else exactly three digits
/// of them (`2026-11-30T08:53:27.120Z`, never `.12Z`).
pub fn rfc3339(millis: Millis) -> String {
    let Ok(at) = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(millis.0) * 1_000_000)
    else {
        return format!("@{millis}ms");
    };
    let fraction = match at.millisecond() {
        0 => String::new(),
        ms => format!(".{ms:03}"),
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}{fraction}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_formats_utc_with_three_millisecond_digits_unless_zero() {
        assert_eq!(
            rfc3339(Millis(1_764_492_807_123)),
            "2025-11-30T08:53:27.123Z"
        );
        assert_eq!(
            rfc3339(Millis(1_764_492_807_120)),
            "2025-11-30T08:53:27.120Z"
        );
        assert_eq!(
            rfc3339(Millis(1_764_492_807_100)),
            "2025-11-30T08:53:27.100Z"
        );
        assert_eq!(
            rfc3339(Millis(1_764_492_807_001)),
            "2025-11-30T08:53:27.001Z"
        );
        assert_eq!(rfc3339(Millis(0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(Millis(-1)), "1969-12-31T23:59:59.999Z");
    }
}
