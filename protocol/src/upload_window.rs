//! The upload window of a task policy: when, after receiving an assignment, a device sends.
//!
//! A model or plan that someone other than the device chose can make training slow or fast on a
//! condition of the device's data (subnormal weights until a row crosses a threshold, an early
//! NaN). Whoever reads when a device uploads or reports (the operator's database, a tenant polling
//! round counts, the console's durations) would read that condition. So a device draws its send
//! instant uniformly in this window, from randomness its data cannot influence, before it touches
//! any data; at that instant it seals and uploads whatever is ready (the trained update, or a
//! well-formed zero update if training is still running) and reports right after
//! (docs/privacy.md, "Time").
//!
//! Encoded in the policy as `upload_window=<start_ms>,<end_ms>`: milliseconds after the device
//! received the assignment, integers, `start_ms <= end_ms <= MAX_UPLOAD_WINDOW_MS`.

use std::time::Duration;

/// The latest send instant a policy may ask for: a week, the longest round deadline.
pub const MAX_UPLOAD_WINDOW_MS: u32 = 7 * 24 * 3600 * 1000;

/// When a device sends, in milliseconds after it received its assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UploadWindow {
    pub start_ms: u32,
    pub end_ms: u32,
}

impl UploadWindow {
    /// A window, if `start_ms <= end_ms <= MAX_UPLOAD_WINDOW_MS`.
    pub fn new(start_ms: u32, end_ms: u32) -> Result<Self, String> {
        if start_ms > end_ms {
            return Err(format!(
                "upload window start {start_ms} ms is after its end {end_ms} ms"
            ));
        }
        if end_ms > MAX_UPLOAD_WINDOW_MS {
            return Err(format!(
                "upload window end {end_ms} ms is beyond {MAX_UPLOAD_WINDOW_MS} ms (a week)"
            ));
        }
        Ok(Self { start_ms, end_ms })
    }

    /// The policy's text form, `<start_ms>,<end_ms>`.
    pub fn encode(&self) -> String {
        format!("{},{}", self.start_ms, self.end_ms)
    }

    /// Parses `<start_ms>,<end_ms>` strictly (decimal, no sign, no leading zeros).
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("`upload_window` must be `<start_ms>,<end_ms>`, not `{text}`");
        let (start, end) = text.split_once(',').ok_or_else(bad)?;
        let number = |part: &str| -> Result<u32, String> {
            let canonical = !part.is_empty()
                && part.bytes().all(|b| b.is_ascii_digit())
                && (part == "0" || !part.starts_with('0'));
            canonical
                .then(|| part.parse::<u32>().ok())
                .flatten()
                .ok_or_else(bad)
        };
        Self::new(number(start)?, number(end)?)
    }

    /// The offset of the send instant for `unit`, a uniform draw in `[0, 1)`: `start + unit *
    /// (end - start)`, rounded down to the millisecond. The draw must come from randomness the
    /// device's data cannot influence, made before the device reads any data.
    pub fn offset(&self, unit: f64) -> Duration {
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let span = f64::from(self.end_ms - self.start_ms);
        let extra = ((unit * span).floor() as u32).min(self.end_ms - self.start_ms);
        Duration::from_millis(u64::from(self.start_ms + extra))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_round_trips_and_refuses_non_canonical_text() {
        let window = UploadWindow::new(250, 60_000).unwrap();
        assert_eq!(window.encode(), "250,60000");
        assert_eq!(UploadWindow::parse("250,60000"), Ok(window));
        assert_eq!(
            UploadWindow::parse("0,0"),
            Ok(UploadWindow::new(0, 0).unwrap())
        );
        for bad in [
            "",
            "250",
            "250,",
            ",1",
            "0250,1000",
            "250,1000,5",
            "-1,5",
            "+1,5",
            "1.5,2",
            "5,4",
            "0,604800001",
            " 1,2",
        ] {
            assert!(UploadWindow::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_offset_spans_the_window_and_never_leaves_it() {
        let window = UploadWindow::new(1_000, 3_000).unwrap();
        assert_eq!(window.offset(0.0), Duration::from_millis(1_000));
        assert_eq!(window.offset(0.5), Duration::from_millis(2_000));
        assert_eq!(window.offset(0.999_999_9), Duration::from_millis(2_999));
        for outside in [1.0, 7.0, -1.0, f64::NAN, f64::INFINITY] {
            let offset = window.offset(outside);
            assert!(
                (1_000..=3_000).contains(&(offset.as_millis() as u32)),
                "{outside}: {offset:?}"
            );
        }
        let point = UploadWindow::new(40, 40).unwrap();
        assert_eq!(point.offset(0.7), Duration::from_millis(40));
    }
}
