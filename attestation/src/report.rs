//! A verification report: one result per appraisal check, collapsed into a single decision at the
//! end. Deny by default: a report with no checks, or with any failed check, does not pass.

use serde::Serialize;

/// What one check concluded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", content = "reason", rename_all = "snake_case")]
pub enum CheckOutcome {
    Passed,
    Failed(String),
}

/// One named check and its outcome, e.g. `("iss", Failed("expected ..."))`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckResult {
    pub check: String,
    #[serde(flatten)]
    pub outcome: CheckOutcome,
}

/// Every check an appraisal ran, in the order it ran them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerificationReport {
    results: Vec<CheckResult>,
}

impl VerificationReport {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the outcome of one check; `Err` carries why it failed.
    pub fn record(&mut self, check: impl Into<String>, outcome: Result<(), String>) {
        let outcome = match outcome {
            Ok(()) => CheckOutcome::Passed,
            Err(reason) => CheckOutcome::Failed(reason),
        };
        self.results.push(CheckResult {
            check: check.into(),
            outcome,
        });
    }

    /// Appends every result of another report (e.g. token checks after the verifier's own).
    pub fn extend(&mut self, other: VerificationReport) {
        self.results.extend(other.results);
    }

    /// The collapsed decision: true only if at least one check ran and every check passed.
    pub fn passed(&self) -> bool {
        !self.results.is_empty()
            && self
                .results
                .iter()
                .all(|r| r.outcome == CheckOutcome::Passed)
    }

    /// The checks that failed, with their reasons, for error messages and audit records.
    pub fn failures(&self) -> impl Iterator<Item = (&str, &str)> {
        self.results.iter().filter_map(|r| match &r.outcome {
            CheckOutcome::Failed(reason) => Some((r.check.as_str(), reason.as_str())),
            CheckOutcome::Passed => None,
        })
    }

    pub fn results(&self) -> &[CheckResult] {
        &self.results
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_report_is_denied() {
        assert!(!VerificationReport::new().passed());
    }

    #[test]
    fn all_passed_checks_pass() {
        let mut report = VerificationReport::new();
        report.record("iss", Ok(()));
        report.record("aud", Ok(()));
        assert!(report.passed());
        assert_eq!(report.failures().count(), 0);
    }

    #[test]
    fn one_failed_check_denies_and_is_named() {
        let mut report = VerificationReport::new();
        report.record("iss", Ok(()));
        report.record("image_digest", Err("digest not in allow-list".into()));
        report.record("aud", Ok(()));
        assert!(!report.passed());
        let failures: Vec<_> = report.failures().collect();
        assert_eq!(failures, vec![("image_digest", "digest not in allow-list")]);
        assert_eq!(report.results().len(), 3);
    }
}
