//! What only a device knows, and must not forget across restarts: the rounds it sealed an update
//! for (one contribution per round; under DP-FTRL, rounds at least `min_separation` apart) and
//! the on-demand evaluations it granted (at most the policy's `on_demand` per task). The privacy
//! accounting counts on both, and no server can be asked for them (it cannot tell devices apart,
//! by design). A `StateStore` keeps them; `FileStore` is one JSON file, replaced atomically and
//! fsync'd before the update or the metrics it guards are sealed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::schedule::SendTimes;

/// The `format` of a state file; the Python `Device.state_file` writes the same.
pub const STATE_FORMAT: &str = "confed-device-state/v1";

/// How long a drawn schedule is kept after its send instant: longer than any assignment lives
/// (the longest round deadline is a week).
pub const SCHEDULE_RETENTION_MS: i64 = 8 * 24 * 3600 * 1000;

/// A device's record (docs/protocol.md, "The device's state file").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceState {
    pub format: String,
    /// (task, round) this device sealed an update for.
    pub served: BTreeSet<(String, i64)>,
    /// (task, round) of the on-demand evaluations this device granted.
    pub on_demand: BTreeSet<(String, i64)>,
    /// task -> (population, minimum separation, planned rounds) of the DP-FTRL tasks it served:
    /// which `served` entries a check-in may usefully carry.
    pub separated: BTreeMap<String, (String, u32, u32)>,
    /// assignment reference (the SHA-256 of its id) -> the instants drawn for it before
    /// training (`schedule::SendTimes`), until it is reported. Files written before upload
    /// windows have none, and it is left out when empty, so a file without pending sends
    /// reads in a client of the previous release too.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sends: BTreeMap<String, SendTimes>,
}

impl Default for DeviceState {
    fn default() -> Self {
        Self {
            format: STATE_FORMAT.to_string(),
            served: BTreeSet::new(),
            on_demand: BTreeSet::new(),
            separated: BTreeMap::new(),
            sends: BTreeMap::new(),
        }
    }
}

impl DeviceState {
    /// Adds what `other` holds (a record restored next to one given by the caller).
    pub fn merge(&mut self, other: DeviceState) {
        self.served.extend(other.served);
        self.on_demand.extend(other.on_demand);
        for (task, entry) in other.separated {
            self.separated.entry(task).or_insert(entry);
        }
        for (assignment, times) in other.sends {
            self.sends.entry(assignment).or_insert(times);
        }
    }

    /// Forgets the schedules of assignments whose send instant is more than
    /// `SCHEDULE_RETENTION_MS` before `now_ms`: no assignment lives that long, and the file must
    /// not grow with every assignment a device ever took.
    pub fn prune_sends(&mut self, now_ms: i64) {
        self.sends
            .retain(|_, times| times.send_ms >= now_ms.saturating_sub(SCHEDULE_RETENTION_MS));
    }
}

#[derive(Debug, Error)]
pub enum StateError {
    #[error("cannot read the device state file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the device state file {path} is not valid")]
    Parse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("the device state file {path} has format {found:?}, not {STATE_FORMAT}")]
    Format { path: String, found: String },
    #[error("cannot write the device state file {path}; nothing is sealed until it can")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where a device keeps its `DeviceState`. `save` must be durable when it returns: the device
/// seals only after it.
pub trait StateStore: Send + Sync + std::fmt::Debug {
    /// The saved state, or `None` when nothing was ever saved.
    fn load(&self) -> Result<Option<DeviceState>, StateError>;
    fn save(&self, state: &DeviceState) -> Result<(), StateError>;
}

/// One JSON file: written to a temporary file beside it (unique to this process and write),
/// fsync'd, renamed over `path`, and the directory fsync'd, so a crash leaves the old record or
/// the new one, never a torn one. One device per file: two processes sharing a file would each
/// overwrite the other's record.
#[derive(Debug, Clone)]
pub struct FileStore {
    path: PathBuf,
}

impl FileStore {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn shown(&self) -> String {
        self.path.display().to_string()
    }

    fn write(&self, bytes: &[u8]) -> std::io::Result<()> {
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut temporary = self.path.clone().into_os_string();
        temporary.push(format!(".{}.{write}.tmp", std::process::id()));
        let temporary = PathBuf::from(temporary);
        {
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(bytes)?;
            file.sync_all()?;
        }
        std::fs::rename(&temporary, &self.path)?;
        let directory = match self.path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        std::fs::File::open(directory)?.sync_all()
    }
}

impl StateStore for FileStore {
    fn load(&self) -> Result<Option<DeviceState>, StateError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: self.shown(),
                    source,
                });
            }
        };
        let state: DeviceState =
            serde_json::from_str(&text).map_err(|source| StateError::Parse {
                path: self.shown(),
                source,
            })?;
        if state.format != STATE_FORMAT {
            return Err(StateError::Format {
                path: self.shown(),
                found: state.format,
            });
        }
        Ok(Some(state))
    }

    fn save(&self, state: &DeviceState) -> Result<(), StateError> {
        let bytes = serde_json::to_vec(state).expect("a device state serializes");
        self.write(&bytes).map_err(|source| StateError::Write {
            path: self.shown(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DeviceState {
        let mut state = DeviceState::default();
        state.served.insert(("t1".into(), 3));
        state.on_demand.insert(("t1".into(), 5));
        state
            .separated
            .insert("t1".into(), ("phones".into(), 4, 20));
        state
    }

    #[test]
    fn a_saved_state_loads_back_and_a_missing_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path().join("device.json"));
        assert!(store.load().unwrap().is_none());
        store.save(&sample()).unwrap();
        assert_eq!(store.load().unwrap(), Some(sample()));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["device.json"], "no temporary file is left");
    }

    /// The file the Python `Device.state_file` writes reads here, and the other way round.
    #[test]
    fn the_format_is_the_python_clients() {
        let python = r#"{"format": "confed-device-state/v1", "served": [["t1", 3]],
            "on_demand": [["t1", 5]], "separated": {"t1": ["phones", 4, 20]}}"#;
        let state: DeviceState = serde_json::from_str(python).unwrap();
        assert_eq!(state, sample());
        let written: serde_json::Value = serde_json::to_value(sample()).unwrap();
        assert_eq!(written["served"], serde_json::json!([["t1", 3]]));
        assert_eq!(
            written["separated"]["t1"],
            serde_json::json!(["phones", 4, 20])
        );
    }

    #[test]
    fn a_state_file_of_another_format_or_garbled_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("device.json");
        std::fs::write(
            &path,
            r#"{"format": "other", "served": [], "on_demand": [], "separated": {}}"#,
        )
        .unwrap();
        assert!(matches!(
            FileStore::new(&path).load(),
            Err(StateError::Format { .. })
        ));
        std::fs::write(&path, "{").unwrap();
        assert!(matches!(
            FileStore::new(&path).load(),
            Err(StateError::Parse { .. })
        ));
    }
}
