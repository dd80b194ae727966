//! Google's attestation certificate status list (`https://android.googleapis.com/attestation/status`):
//! the serials of revoked or suspended attestation keys and intermediates. The issuer cannot fetch
//! it at run time (nor should it trust whatever a network answers at that moment), so the operator
//! fetches it on a schedule into a file the issuer reads at start (`docs/operations.md`, "Token
//! issuer"). Both REVOKED and SUSPENDED refuse: deny by default.

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StatusListError {
    #[error("the status list is not the JSON of android.googleapis.com/attestation/status: {0}")]
    Format(#[from] serde_json::Error),
    #[error("the status list's entry {0:?} is not a lowercase hex serial without leading zeros")]
    Serial(String),
}

#[derive(Debug, Deserialize)]
struct StatusFile {
    entries: BTreeMap<String, StatusEntry>,
}

#[derive(Debug, Deserialize)]
struct StatusEntry {
    status: Status,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
enum Status {
    Revoked,
    Suspended,
}

/// The serials a chain must not contain.
#[derive(Debug, Default, Clone)]
pub struct StatusList {
    serials: HashSet<String>,
}

impl StatusList {
    pub fn parse(json: &[u8]) -> Result<Self, StatusListError> {
        let file: StatusFile = serde_json::from_slice(json)?;
        let mut serials = HashSet::with_capacity(file.entries.len());
        for (serial, entry) in file.entries {
            let valid = serial
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
                && !serial.is_empty()
                && !serial.starts_with('0');
            if !valid {
                return Err(StatusListError::Serial(serial));
            }
            match entry.status {
                Status::Revoked | Status::Suspended => serials.insert(serial),
            };
        }
        Ok(Self { serials })
    }

    pub fn len(&self) -> usize {
        self.serials.len()
    }

    pub fn is_empty(&self) -> bool {
        self.serials.is_empty()
    }

    pub fn contains(&self, serial_key: &str) -> bool {
        self.serials.contains(serial_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revoked_and_suspended_serials_are_listed_and_other_shapes_refused() {
        let list = StatusList::parse(
            br#"{"entries": {
                "2c8cdddfd5e03bfc": {"status": "REVOKED", "expires": "2020-11-13", "reason": "KEY_COMPROMISE", "comment": "Key stored on unsecure system"},
                "c8966fcb2fbb0d7a": {"status": "SUSPENDED", "reason": "SOFTWARE_FLAW"}
            }}"#,
        )
        .unwrap();
        assert!(list.contains("2c8cdddfd5e03bfc"));
        assert!(list.contains("c8966fcb2fbb0d7a"));
        assert!(!list.contains("1"));
        assert_eq!(list.len(), 2);
        assert!(matches!(
            StatusList::parse(br#"{"entries": {"02c8": {"status": "REVOKED"}}}"#),
            Err(StatusListError::Serial(_))
        ));
        assert!(StatusList::parse(br#"{"entries": {"2c8": {"status": "MAYBE"}}}"#).is_err());
        assert!(StatusList::parse(b"[]").is_err());
    }
}
