//! Attesters: what proves a device genuine before the issuer grants it tokens (RFC 9576's
//! attester role). Each turns the device's evidence, bound to a fresh issuer challenge, into a
//! device identity: a 32-byte value that is the same for the same device within a window and
//! different for different devices, used only to count grants (`limiter/`) and never stored.

pub mod android;
pub mod apple;
pub mod chain;
pub mod dev;
pub mod several;

pub use confed_protocol::clock::Seconds;
pub use confed_protocol::privacy_pass::issuer_api::Evidence;

/// One failed attestation check, as the refusal names it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FailedCheck {
    pub check: &'static str,
    pub reason: String,
}

impl FailedCheck {
    pub fn new(check: &'static str, reason: impl Into<String>) -> Self {
        Self {
            check,
            reason: reason.into(),
        }
    }

    /// Evidence of a format none of `accepted` takes.
    pub fn format(accepted: &[&str]) -> Self {
        let quoted: Vec<String> = accepted.iter().map(|f| format!("\"{f}\"")).collect();
        Self::new(
            "format",
            format!(
                "this issuer takes evidence of format {}",
                quoted.join(" or ")
            ),
        )
    }
}

/// Why an attester did not attest a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttestError {
    /// The evidence failed these checks (403, each named).
    Refused(Vec<FailedCheck>),
    /// The attester could not read or record what it keeps (App Attest's key registry): nothing
    /// was decided; the device may retry (503).
    Storage(String),
}

impl AttestError {
    /// The failed checks of a refusal (none for a storage failure).
    pub fn checks(&self) -> &[FailedCheck] {
        match self {
            Self::Refused(failed) => failed,
            Self::Storage(_) => &[],
        }
    }
}

impl From<Vec<FailedCheck>> for AttestError {
    fn from(failed: Vec<FailedCheck>) -> Self {
        Self::Refused(failed)
    }
}

impl From<FailedCheck> for AttestError {
    fn from(failed: FailedCheck) -> Self {
        Self::Refused(vec![failed])
    }
}

/// An attested device, as the limiter counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceIdentity(pub [u8; 32]);

pub trait Attester: Send + Sync + std::fmt::Debug {
    /// The evidence format this attester accepts (`Evidence`'s `format`).
    fn format(&self) -> &'static str;

    /// Whether anyone can produce evidence this attester accepts (the dev attester): said loudly
    /// wherever the issuer describes itself.
    fn insecure(&self) -> bool;

    /// Every evidence format accepted (several for `Attesters`).
    fn formats(&self) -> Vec<&'static str> {
        vec![self.format()]
    }

    /// Why the attester cannot take evidence now (e.g. its revocation data is stale), if so:
    /// the issuer answers 503 before looking at the evidence.
    fn unavailable(&self, _now: Seconds) -> Option<String> {
        None
    }

    /// Why the attester cannot take this evidence now, if so (`unavailable`, unless several
    /// attesters share the issuer and another one takes `evidence`).
    fn unavailable_for(&self, _evidence: &Evidence, now: Seconds) -> Option<String> {
        self.unavailable(now)
    }

    /// Checks `evidence` against `challenge` (already checked fresh by the issuer) at `now`
    /// (Unix seconds, for certificate validity). Blocking: an attester may sync what it
    /// records (App Attest's key registry) before answering.
    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        now: Seconds,
    ) -> Result<DeviceIdentity, AttestError>;
}
