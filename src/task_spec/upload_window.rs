//! A task's upload window as the partner gives it, checked against the assignment timeout, and
//! the default a task gets when the partner does not say (docs/api.md, "Upload window").
//!
//! Devices send at an instant drawn uniformly in the window after they receive an assignment,
//! whatever their training did (`confed_protocol::upload_window`). The window must end early
//! enough that the upload and the report still fit inside the assignment timeout (which itself
//! fits inside the round deadline): `UPLOAD_ALLOWANCE_MS` are kept for them.

use confed_protocol::policy::UploadWindow;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::problems::Problems;

/// What is kept after the latest send instant, inside the assignment timeout, for sealing,
/// uploading and reporting.
pub const UPLOAD_ALLOWANCE_MS: i64 = 5_000;

/// When devices send, in milliseconds after they receive their assignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadWindowSpec {
    /// Earliest send instant, ms after the assignment (0..=end_ms).
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 0, maximum = 604800000)]
    pub start_ms: i64,
    /// Latest send instant, ms after the assignment: at most the assignment timeout minus 5 s.
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 0, maximum = 604800000)]
    pub end_ms: i64,
}

impl UploadWindowSpec {
    /// The default for a task whose partner did not give one: devices send between one and
    /// two `device_seconds_per_round` after their assignment (the partner's own estimate of a
    /// device's time), ending at the latest `UPLOAD_ALLOWANCE_MS` before the assignment times
    /// out. Honest training that takes the estimated time is then sent every time.
    pub fn default_for(device_seconds_per_round: u32, assignment_timeout_seconds: u32) -> Self {
        let latest = latest_end_ms(assignment_timeout_seconds);
        let end_ms = (2 * i64::from(device_seconds_per_round) * 1000).min(latest);
        Self {
            start_ms: (i64::from(device_seconds_per_round) * 1000).min(end_ms / 2),
            end_ms,
        }
    }

    /// The policy's window (of a validated spec: always within range).
    pub fn policy(&self) -> UploadWindow {
        let clamp = |ms: i64| ms.clamp(0, i64::from(u32::MAX)) as u32;
        UploadWindow::new(clamp(self.start_ms), clamp(self.end_ms)).unwrap_or(UploadWindow {
            start_ms: 0,
            end_ms: 0,
        })
    }

    /// The window if it fits the assignment timeout; otherwise records why in `p`.
    pub(super) fn validate(
        self,
        p: &mut Problems,
        assignment_timeout_seconds: u32,
    ) -> UploadWindowSpec {
        let latest = latest_end_ms(assignment_timeout_seconds);
        if self.start_ms < 0 || self.start_ms > self.end_ms {
            p.add(
                "upload_window.start_ms",
                format!(
                    "must be between 0 and end_ms {} (got {})",
                    self.end_ms, self.start_ms
                ),
            );
        }
        if !(0..=latest).contains(&self.end_ms) {
            p.add(
                "upload_window.end_ms",
                format!(
                    "must be between 0 and {latest}: the assignment timeout of {assignment_timeout_seconds} s less {UPLOAD_ALLOWANCE_MS} ms for the upload and the report (got {}); raise assignment_timeout_seconds or end the window earlier",
                    self.end_ms
                ),
            );
        }
        self
    }
}

/// The latest end of a window under this assignment timeout.
fn latest_end_ms(assignment_timeout_seconds: u32) -> i64 {
    (i64::from(assignment_timeout_seconds) * 1000 - UPLOAD_ALLOWANCE_MS).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_follows_the_device_time_estimate_inside_the_timeout() {
        assert_eq!(
            UploadWindowSpec::default_for(60, 600),
            UploadWindowSpec {
                start_ms: 60_000,
                end_ms: 120_000
            }
        );
        // A short timeout caps the window; the start stays below the end.
        assert_eq!(
            UploadWindowSpec::default_for(60, 10),
            UploadWindowSpec {
                start_ms: 2_500,
                end_ms: 5_000
            }
        );
        let mut p = Problems::default();
        for (d, timeout) in [(1, 10), (60, 600), (86_400, 10), (86_400, 604_800)] {
            UploadWindowSpec::default_for(d, timeout).validate(&mut p, timeout);
        }
        assert!(p.0.is_empty(), "{:?}", p.0);
    }

    #[test]
    fn a_window_past_the_timeout_or_backwards_is_refused_by_field() {
        let mut p = Problems::default();
        UploadWindowSpec {
            start_ms: 0,
            end_ms: 6_000,
        }
        .validate(&mut p, 10);
        UploadWindowSpec {
            start_ms: 500,
            end_ms: 100,
        }
        .validate(&mut p, 10);
        UploadWindowSpec {
            start_ms: -1,
            end_ms: 100,
        }
        .validate(&mut p, 10);
        let names: Vec<_> = p.0.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "upload_window.end_ms",
                "upload_window.start_ms",
                "upload_window.start_ms"
            ]
        );
        assert!(p.0[0].reason.contains("between 0 and 5000"), "{:?}", p.0);
    }
}
