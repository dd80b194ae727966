//! The limiter's files: the key, the lock, window file names, and replaying a window file.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use super::{KEY_FILE, LimiterError, RECORD_BYTES};

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LimiterError + '_ {
    move |source| LimiterError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A record's 4-byte check: the first bytes of SHA-256(rate_key || count).
pub(super) fn check(rate_key: &[u8], count: &[u8]) -> [u8; 4] {
    let digest = Sha256::new()
        .chain_update(rate_key)
        .chain_update(count)
        .finalize();
    digest[..4].try_into().expect("4 bytes")
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), LimiterError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// The window index in a window file's name (`window-<seconds>-<index>.log`, any length).
pub(super) fn window_index(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("window-")?.strip_suffix(".log")?;
    rest.split_once('-')?.1.parse().ok()
}

/// Locks `dir` for this process (an exclusive advisory lock on `limiter.lock`, `flock` on Linux,
/// released when the file is closed).
pub(super) fn lock_dir(dir: &Path) -> Result<File, LimiterError> {
    let path = dir.join("limiter.lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(LimiterError::Locked(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&path)(e)),
    }
}

/// The counts of a window file (none if it does not exist) and its length, cutting off a torn
/// tail.
pub(super) fn replay(path: &Path) -> Result<(HashMap<[u8; 32], u32>, u64), LimiterError> {
    let mut counts = HashMap::new();
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut file) => file.read_to_end(&mut bytes).map_err(io(path))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((counts, 0)),
        Err(e) => return Err(io(path)(e)),
    };
    let records = bytes.len() / RECORD_BYTES;
    let mut valid = records;
    for (i, record) in bytes.chunks_exact(RECORD_BYTES).enumerate() {
        if check(&record[..32], &record[32..36]) != record[36..] {
            if i + 1 != records {
                return Err(LimiterError::Damaged {
                    path: path.to_path_buf(),
                    record: i,
                });
            }
            valid = i;
            break;
        }
        let key: [u8; 32] = record[..32].try_into().expect("32 bytes");
        let count = u32::from_be_bytes(record[32..36].try_into().expect("4 bytes"));
        let entry = counts.entry(key).or_insert(0u32);
        *entry = entry.saturating_add(count);
    }
    let keep = (valid * RECORD_BYTES) as u64;
    if keep != bytes.len() as u64 {
        tracing::warn!(
            path = %path.display(),
            cut = bytes.len() as u64 - keep,
            "cutting off a record torn by a crash"
        );
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io(path))?;
        file.set_len(keep)
            .and_then(|()| file.sync_all())
            .map_err(io(path))?;
    }
    Ok((counts, keep))
}

pub(super) fn load_or_create_key(dir: &Path) -> Result<Zeroizing<[u8; 32]>, LimiterError> {
    let path = dir.join(KEY_FILE);
    let mut key = Zeroizing::new([0u8; 32]);
    match File::open(&path) {
        Ok(mut file) => {
            let mut bytes = Zeroizing::new(Vec::new());
            file.read_to_end(&mut bytes).map_err(io(&path))?;
            if bytes.len() != 32 {
                return Err(LimiterError::KeyFile(path));
            }
            key.copy_from_slice(&bytes);
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            getrandom::fill(key.as_mut())
                .map_err(|e| io(&path)(std::io::Error::other(e.to_string())))?;
            let mut file = OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&path)
                .map_err(io(&path))?;
            file.write_all(key.as_ref())
                .and_then(|()| file.sync_all())
                .map_err(io(&path))?;
            sync_dir(dir)?;
            Ok(key)
        }
        Err(e) => Err(io(&path)(e)),
    }
}
