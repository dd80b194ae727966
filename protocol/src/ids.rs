//! Identifiers whose kinds must not be mixed up. An assignment has two names: the capability
//! the device holds (a bearer secret, never stored) and its reference (the SHA-256 the server
//! stores and the envelope's associated data binds). Giving each its own type means a secret
//! cannot be stored, logged or bound where its reference belongs, nor the other way round.

use serde::{Deserialize, Serialize};

/// An assignment id as the device holds it: a one-time capability (256 random bits,
/// base64url) that authorizes the assignment's model download, upload and report. Secret:
/// `Debug` redacts it; the server keeps only its `AssignmentRef`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Capability(String);

impl Capability {
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The text to put in URLs, which only the device and the server see.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// How the server and the enclave name this assignment.
    pub fn reference(&self) -> AssignmentRef {
        AssignmentRef(crate::envelope::assignment_ref(&self.0))
    }
}

impl std::fmt::Debug for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Capability(<redacted>)")
    }
}

impl From<String> for Capability {
    fn from(text: String) -> Self {
        Self(text)
    }
}

impl From<&str> for Capability {
    fn from(text: &str) -> Self {
        Self(text.to_string())
    }
}

/// How the server, its database and the enclave name an assignment: the lowercase hex SHA-256
/// of its capability (`envelope::assignment_ref`), which the contribution's associated data
/// binds. Not a secret, and not a capability: it authorizes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AssignmentRef(String);

impl AssignmentRef {
    /// A reference read back from storage (a row the server wrote from a capability).
    pub fn from_stored(text: String) -> Self {
        Self(text)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl std::fmt::Display for AssignmentRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A round number as the wire and the enclave take it (`u64`, from 1), from the `i64` the task
/// database and the partner API store; `None` for zero or a negative number, which no round has
/// (a row that says so was written by someone other than the server).
pub fn wire_round(round: i64) -> Option<u64> {
    u64::try_from(round).ok().filter(|&r| r >= 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_numbers_start_at_one() {
        assert_eq!(wire_round(1), Some(1));
        assert_eq!(wire_round(0), None);
        assert_eq!(wire_round(-1), None, "never wraps to a huge round");
    }

    #[test]
    fn a_capability_is_redacted_and_its_reference_is_its_sha256() {
        let capability = Capability::from("secret-capability");
        assert_eq!(format!("{capability:?}"), "Capability(<redacted>)");
        assert_eq!(
            capability.reference().as_str(),
            crate::hex::sha256_hex(b"secret-capability")
        );
    }
}
