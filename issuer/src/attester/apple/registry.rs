//! The App Attest keys this issuer has seen attested: what it needs to check their later
//! assertions (the public key, the app, the environment) and the highest counter each has shown.
//!
//! A key is named on disk by `HMAC-SHA256(registry key, label || key id)`, so the directory holds
//! no key id Apple or the app could look up; it is the same value the limiter counts by (the
//! device identity). Each key is one file, `app-attest/<first byte, hex>/<name, hex>`, of
//! `RECORD_BYTES` bytes:
//!
//! ```text
//! version (1) = 1 | environment (1: 0 production, 1 development) | rpIdHash (32)
//!   | public key (65, uncompressed P-256) | counter (4, big-endian) | SHA-256 of the above (first 4)
//! ```
//!
//! A record is replaced whole (write to a temporary file, sync, rename, sync the directory) before
//! the issuer grants anything on it, so a crash leaves the old record or the new one, and a counter
//! once accepted is never accepted again. Updates of one shard are serialized by its lock; the
//! state directory belongs to one issuer process (the limiter's lock).

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use sha2::{Digest, Sha256};

const LABEL: &[u8] = b"confed-issuer-app-attest-key-v1\0";
const VERSION: u8 = 1;
pub const RECORD_BYTES: usize = 1 + 1 + 32 + 65 + 4 + 4;
const SHARDS: usize = 256;

/// What the issuer remembers of an attested key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub development: bool,
    pub rp_id_hash: [u8; 32],
    pub public_key: [u8; 65],
    pub counter: u32,
}

impl Registered {
    fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut out = [0u8; RECORD_BYTES];
        out[0] = VERSION;
        out[1] = u8::from(self.development);
        out[2..34].copy_from_slice(&self.rp_id_hash);
        out[34..99].copy_from_slice(&self.public_key);
        out[99..103].copy_from_slice(&self.counter.to_be_bytes());
        let check = Sha256::digest(&out[..103]);
        out[103..].copy_from_slice(&check[..4]);
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != RECORD_BYTES
            || bytes[0] != VERSION
            || bytes[1] > 1
            || Sha256::digest(&bytes[..103])[..4] != bytes[103..]
        {
            return None;
        }
        Some(Self {
            development: bytes[1] == 1,
            rp_id_hash: bytes[2..34].try_into().ok()?,
            public_key: bytes[34..99].try_into().ok()?,
            counter: u32::from_be_bytes(bytes[99..103].try_into().ok()?),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: not a key record of this issuer (damaged?)")]
    Damaged(PathBuf),
}

pub struct Registry {
    dir: PathBuf,
    key: ring::hmac::Key,
    shards: Vec<Mutex<()>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RegistryError + '_ {
    move |source| RegistryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A shard's lock, held while one key's record is read and replaced.
pub struct Held<'r> {
    registry: &'r Registry,
    name: [u8; 32],
    _guard: MutexGuard<'r, ()>,
}

impl Registry {
    /// The registry under `state_dir/app-attest`, created if absent with all its shard
    /// directories, each synced into its parent: a record written later needs only its own
    /// file and shard synced to survive a crash.
    pub fn open(state_dir: &Path, key: ring::hmac::Key) -> Result<Self, RegistryError> {
        let dir = state_dir.join("app-attest");
        let sync = |path: &Path| {
            File::open(path)
                .and_then(|d| d.sync_all())
                .map_err(io(path))
        };
        if !dir.is_dir() {
            fs::create_dir_all(&dir).map_err(io(&dir))?;
            sync(state_dir)?;
        }
        for shard in 0..SHARDS {
            let path = dir.join(format!("{shard:02x}"));
            if !path.is_dir() {
                fs::create_dir(&path).map_err(io(&path))?;
            }
        }
        sync(&dir)?;
        Ok(Self {
            dir,
            key,
            shards: (0..SHARDS).map(|_| Mutex::new(())).collect(),
        })
    }

    /// The name a key id is filed under, which is also the device identity the limiter counts.
    pub fn name(&self, key_id: &[u8]) -> [u8; 32] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(LABEL);
        context.update(key_id);
        context
            .sign()
            .as_ref()
            .try_into()
            .unwrap_or_else(|_| unreachable!("HMAC-SHA256 is 32 bytes"))
    }

    /// Locks the record of `key_id` for reading and replacing.
    pub fn hold(&self, key_id: &[u8]) -> Held<'_> {
        let name = self.name(key_id);
        let guard = self.shards[usize::from(name[0])]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Held {
            registry: self,
            name,
            _guard: guard,
        }
    }

    /// The record of `key_id` without the lock (a record is replaced by a rename: this reads the
    /// old one or the new one).
    pub fn read(&self, key_id: &[u8]) -> Result<Option<Registered>, RegistryError> {
        read_record(&self.path(&self.name(key_id)).1)
    }

    fn path(&self, name: &[u8; 32]) -> (PathBuf, PathBuf) {
        let hex = confed_protocol::hex::encode(name);
        let shard = self.dir.join(&hex[..2]);
        let file = shard.join(&hex);
        (shard, file)
    }
}

impl Held<'_> {
    /// The name the key is filed under (the device identity).
    pub fn name(&self) -> [u8; 32] {
        self.name
    }

    pub fn read(&self) -> Result<Option<Registered>, RegistryError> {
        read_record(&self.registry.path(&self.name).1)
    }

    /// Replaces the record durably.
    pub fn write(&self, record: &Registered) -> Result<(), RegistryError> {
        let (shard, path) = self.registry.path(&self.name);
        // A `.tmp` left by a crash is overwritten by the next write of the same key.
        let temporary = path.with_extension("tmp");
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&temporary)
            .map_err(io(&temporary))?;
        file.write_all(&record.encode())
            .and_then(|()| file.sync_all())
            .map_err(io(&temporary))?;
        fs::rename(&temporary, &path).map_err(io(&path))?;
        File::open(&shard)
            .and_then(|d| d.sync_all())
            .map_err(io(&shard))
    }
}

fn read_record(path: &Path) -> Result<Option<Registered>, RegistryError> {
    match fs::read(path) {
        Ok(bytes) => Registered::decode(&bytes)
            .map(Some)
            .ok_or_else(|| RegistryError::Damaged(path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry(dir: &Path) -> Registry {
        Registry::open(dir, ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[1; 32])).unwrap()
    }

    #[test]
    fn a_record_survives_reopening_and_a_damaged_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let record = Registered {
            development: true,
            rp_id_hash: [2; 32],
            public_key: [4; 65],
            counter: 7,
        };
        {
            let registry = registry(dir.path());
            let held = registry.hold(b"key");
            assert_eq!(held.read().unwrap(), None);
            held.write(&record).unwrap();
        }
        let registry = registry(dir.path());
        assert_eq!(registry.hold(b"key").read().unwrap(), Some(record));
        assert_eq!(registry.hold(b"other key").read().unwrap(), None);
        // The key id never reaches the disk: only its HMAC names the file.
        let name = confed_protocol::hex::encode(registry.name(b"key"));
        let path = dir.path().join("app-attest").join(&name[..2]).join(&name);
        let mut bytes = fs::read(&path).unwrap();
        bytes[100] ^= 1;
        fs::write(&path, bytes).unwrap();
        assert!(matches!(
            registry.hold(b"key").read(),
            Err(RegistryError::Damaged(_))
        ));
    }
}
