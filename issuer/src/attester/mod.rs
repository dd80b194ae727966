//! Attesters: what proves a device genuine before the issuer grants it tokens (RFC 9576's
//! attester role). Each turns the device's evidence, bound to a fresh issuer challenge, into a
//! device identity: a 32-byte value that is the same for the same device within a window and
//! different for different devices, used only to count grants (`limiter/`) and never stored.

pub mod android;
pub mod dev;

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

    /// Why the attester cannot take evidence now (e.g. its revocation data is stale), if so:
    /// the issuer answers 503 before looking at the evidence.
    fn unavailable(&self, _now: Seconds) -> Option<String> {
        None
    }

    /// Checks `evidence` against `challenge` (already checked fresh by the issuer) at `now`
    /// (Unix seconds, for certificate validity).
    fn attest(
        &self,
        evidence: &Evidence,
        challenge: &[u8],
        now: Seconds,
    ) -> Result<DeviceIdentity, Vec<FailedCheck>>;
}
