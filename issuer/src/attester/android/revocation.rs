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
struct StatusJson {
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
        let file: StatusJson = serde_json::from_slice(json)?;
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

/// The status list as a file the operator refreshes: reloaded whenever its modification time
/// changes, and too old to rely on after `max_age` (the issuer then stops taking attestations
/// until a fresh copy arrives, as Google's own verifier fails closed).
#[derive(Debug)]
pub struct StatusFile {
    path: std::path::PathBuf,
    max_age: i64,
    loaded: std::sync::RwLock<(std::time::SystemTime, std::sync::Arc<StatusList>)>,
}

fn unix_seconds(time: std::time::SystemTime) -> i64 {
    match time.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => after.as_secs() as i64,
        Err(before) => -(before.duration().as_secs() as i64),
    }
}

impl StatusFile {
    /// Reads the file now; an unreadable or malformed file is an error (the issuer does not start).
    pub fn open(path: &std::path::Path, max_age: i64) -> Result<Self, String> {
        let (modified, list) = Self::read(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            max_age,
            loaded: std::sync::RwLock::new((modified, std::sync::Arc::new(list))),
        })
    }

    fn read(path: &std::path::Path) -> Result<(std::time::SystemTime, StatusList), String> {
        let describe = |e: &dyn std::fmt::Display| format!("status list {}: {e}", path.display());
        let modified = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .map_err(|e| describe(&e))?;
        let bytes = std::fs::read(path).map_err(|e| describe(&e))?;
        let list = StatusList::parse(&bytes).map_err(|e| describe(&e))?;
        Ok((modified, list))
    }

    /// Seconds since the loaded copy was written, at `now`.
    pub fn age(&self, now: confed_protocol::clock::Seconds) -> i64 {
        let loaded = self
            .loaded
            .read()
            .map(|l| l.0)
            .unwrap_or(std::time::UNIX_EPOCH);
        now.0 - unix_seconds(loaded)
    }

    /// Reloads the file if it changed (a copy that fails to read or parse is logged and the
    /// loaded one kept), then says whether the loaded copy is fresh enough at `now`.
    pub fn refresh(&self, now: confed_protocol::clock::Seconds) -> Result<(), String> {
        let changed = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok()
            .is_some_and(|modified| self.loaded.read().map(|l| l.0 != modified).unwrap_or(true));
        if changed {
            match Self::read(&self.path) {
                Ok((modified, list)) => {
                    tracing::info!(revoked_serials = list.len(), "Android status list reloaded");
                    if let Ok(mut loaded) = self.loaded.write() {
                        *loaded = (modified, std::sync::Arc::new(list));
                    }
                }
                Err(error) => tracing::warn!(%error, "keeping the loaded Android status list"),
            }
        }
        let age = self.age(now);
        if age > self.max_age {
            return Err(format!(
                "its copy of Google's attestation status list is {} hours old (the limit is {}) and its operator must refresh it; nothing was granted, retry later",
                age / 3600,
                self.max_age / 3600
            ));
        }
        Ok(())
    }

    pub fn list(&self) -> std::sync::Arc<StatusList> {
        self.loaded
            .read()
            .map(|l| std::sync::Arc::clone(&l.1))
            .unwrap_or_default()
    }
}
