//! The issuer's only memory of devices: how many tokens each attested device was granted in the
//! current window, durable before any token leaves (RFC 9576's rate limit at the issuer).
//!
//! A device is named by `rate_key = HMAC-SHA256(limiter key, label || window_seconds || window
//! index || device identity)`: the identity the attester derived never reaches the disk, and keys
//! of different windows share nothing. Each grant appends one 40-byte record to
//! `window-<seconds>-<index>.log` (`rate_key || count (u32, big-endian) || first 4 bytes of
//! SHA-256(rate_key || count)`) and syncs it before the tokens are signed, so a crash can lose
//! tokens a device was granted but never hand out more than L. A record torn by a crash (a short
//! tail, or a last record whose check fails) is cut off at start; damage anywhere else refuses the
//! start. A write or sync that fails is cut back to the last whole record (or, if that fails too,
//! the limiter refuses every grant until a restart replays the file). Files of earlier windows are
//! deleted when a later window opens; the window never moves back (a request stamped before the
//! rollover, or a clock stepped backwards, counts in the current window), so no device's count is
//! ever read from an emptied file. The state directory is locked (`flock` on `limiter.lock`) for the
//! life of the process: two issuers on one directory would each keep their own counts.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use confed_protocol::clock::Seconds;
use sha2::{Digest, Sha256};
use thiserror::Error;
use zeroize::Zeroizing;

const RECORD_BYTES: usize = 40;
const KEY_FILE: &str = "limiter.key";
const LABEL: &[u8] = b"confed-issuer-rate-v1\0";

#[derive(Debug, Error)]
pub enum LimiterError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: record {record} is damaged and records follow it; restore the file from a backup or move it aside (the devices of this window then get a fresh allowance)"
    )]
    Damaged { path: PathBuf, record: usize },
    #[error("{0}: the limiter key must be exactly 32 bytes")]
    KeyFile(PathBuf),
    #[error(
        "{0} is in use by another issuer process (its limiter.lock is held); stop it, or give this one another --state"
    )]
    Locked(PathBuf),
    #[error(
        "an earlier grant could not be recorded nor cut back; restart the issuer (it replays the window file)"
    )]
    Poisoned,
}

/// A device's allowance was used up: nothing was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exhausted {
    pub remaining: u32,
    pub window_ends_at: Seconds,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    pub remaining: u32,
    pub window_ends_at: Seconds,
}

struct Window {
    index: i64,
    path: PathBuf,
    file: File,
    /// Bytes of whole records in the file.
    length: u64,
    counts: HashMap<[u8; 32], u32>,
}

pub struct Limiter {
    dir: PathBuf,
    key: ring::hmac::Key,
    tokens_per_window: u32,
    window_seconds: Seconds,
    window: Option<Window>,
    /// A failed write could not be cut back: nothing more is granted.
    poisoned: bool,
    /// Held for the process's life: the `flock` on `limiter.lock`.
    _lock: File,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("tokens_per_window", &self.tokens_per_window)
            .field("window_seconds", &self.window_seconds)
            .finish_non_exhaustive()
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LimiterError + '_ {
    move |source| LimiterError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn check(rate_key: &[u8], count: &[u8]) -> [u8; 4] {
    let digest = Sha256::new()
        .chain_update(rate_key)
        .chain_update(count)
        .finalize();
    digest[..4].try_into().expect("4 bytes")
}

fn sync_dir(dir: &Path) -> Result<(), LimiterError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

impl Limiter {
    /// Opens (creating) the limiter state in `dir`.
    pub fn open(
        dir: &Path,
        tokens_per_window: u32,
        window_seconds: Seconds,
    ) -> Result<Self, LimiterError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let lock = lock_dir(dir)?;
        let key = load_or_create_key(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_ref()),
            tokens_per_window,
            window_seconds,
            window: None,
            poisoned: false,
            _lock: lock,
        })
    }

    /// A key for another purpose (`label`), derived from the persistent limiter key.
    pub fn derived_key(&self, label: &[u8]) -> ring::hmac::Key {
        let derived = ring::hmac::sign(&self.key, label);
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref())
    }

    pub fn tokens_per_window(&self) -> u32 {
        self.tokens_per_window
    }

    fn rate_key(&self, index: i64, identity: &[u8; 32]) -> [u8; 32] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(LABEL);
        context.update(&self.window_seconds.to_be_bytes());
        context.update(&index.to_be_bytes());
        context.update(identity);
        context.sign().as_ref().try_into().expect("32 bytes")
    }

    /// Grants `count` tokens to the device `identity` at `now`, durably, or refuses without
    /// recording anything if that would pass the window's allowance.
    pub fn take(
        &mut self,
        identity: &[u8; 32],
        count: u32,
        now: Seconds,
    ) -> Result<Result<Grant, Exhausted>, LimiterError> {
        if self.poisoned {
            return Err(LimiterError::Poisoned);
        }
        // Never back to an earlier window: its file may be gone, and its counts with it.
        let index = now
            .div_euclid(self.window_seconds)
            .max(self.window.as_ref().map_or(i64::MIN, |w| w.index));
        let window_ends_at = (index + 1) * self.window_seconds;
        self.enter(index)?;
        let rate_key = self.rate_key(index, identity);
        let window = self.window.as_mut().expect("entered");
        let used = window.counts.get(&rate_key).copied().unwrap_or(0);
        let remaining = self.tokens_per_window.saturating_sub(used);
        if count > remaining {
            return Ok(Err(Exhausted {
                remaining,
                window_ends_at,
            }));
        }
        let mut record = [0u8; RECORD_BYTES];
        record[..32].copy_from_slice(&rate_key);
        record[32..36].copy_from_slice(&count.to_be_bytes());
        let sum = check(&record[..32], &record[32..36]);
        record[36..].copy_from_slice(&sum);
        if let Err(error) = window
            .file
            .write_all(&record)
            .and_then(|()| window.file.sync_data())
        {
            // Cut back to the last whole record, so a later append does not follow a torn one.
            let cut = window
                .file
                .set_len(window.length)
                .and_then(|()| window.file.sync_data());
            if cut.is_err() {
                self.poisoned = true;
            }
            return Err(io(&window.path)(error));
        }
        window.length += RECORD_BYTES as u64;
        window.counts.insert(rate_key, used + count);
        Ok(Ok(Grant {
            remaining: remaining - count,
            window_ends_at,
        }))
    }

    /// Makes window `index` the current one: replays its file, or starts it and deletes the
    /// files of every other window.
    fn enter(&mut self, index: i64) -> Result<(), LimiterError> {
        if self.window.as_ref().is_some_and(|w| w.index == index) {
            return Ok(());
        }
        self.window = None;
        let name = format!("window-{}-{index}.log", self.window_seconds);
        let path = self.dir.join(&name);
        let (counts, length) = replay(&path)?;
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .map_err(io(&path))?;
        sync_dir(&self.dir)?;
        for entry in std::fs::read_dir(&self.dir).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let other = entry.file_name();
            if window_index(&other.to_string_lossy()).is_some_and(|other| other < index) {
                std::fs::remove_file(entry.path()).map_err(io(&entry.path()))?;
            }
        }
        self.window = Some(Window {
            index,
            path,
            file,
            length,
            counts,
        });
        Ok(())
    }
}

/// The window index in a window file's name (`window-<seconds>-<index>.log`, any length).
fn window_index(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("window-")?.strip_suffix(".log")?;
    rest.split_once('-')?.1.parse().ok()
}

/// Locks `dir` for this process (`flock` on `limiter.lock`, released when the file is closed).
fn lock_dir(dir: &Path) -> Result<File, LimiterError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("limiter.lock");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io(&path))?;
    // SAFETY: flock only takes an advisory lock on an open descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(LimiterError::Locked(dir.to_path_buf()));
    }
    Ok(file)
}

/// The counts of a window file (none if it does not exist) and its length, cutting off a torn
/// tail.
fn replay(path: &Path) -> Result<(HashMap<[u8; 32], u32>, u64), LimiterError> {
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

fn load_or_create_key(dir: &Path) -> Result<Zeroizing<[u8; 32]>, LimiterError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Seconds = 86_400;

    #[test]
    fn a_device_gets_at_most_l_tokens_per_window_and_a_fresh_allowance_in_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let mut limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        let (alice, bob) = ([1u8; 32], [2u8; 32]);
        let grant = limiter.take(&alice, 3, 10).unwrap().unwrap();
        assert_eq!(grant.remaining, 2);
        assert_eq!(grant.window_ends_at, DAY);
        assert_eq!(
            limiter.take(&alice, 3, 20).unwrap(),
            Err(Exhausted {
                remaining: 2,
                window_ends_at: DAY
            })
        );
        assert_eq!(limiter.take(&alice, 2, 30).unwrap().unwrap().remaining, 0);
        assert_eq!(limiter.take(&bob, 5, 30).unwrap().unwrap().remaining, 0);
        // The next window: a fresh allowance, and the past window's file is gone.
        assert_eq!(limiter.take(&alice, 5, DAY).unwrap().unwrap().remaining, 0);
        let files: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("window-"))
            .collect();
        assert_eq!(files, vec![format!("window-{DAY}-1.log")]);
    }

    #[test]
    fn grants_survive_a_restart_and_a_torn_last_record_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let alice = [1u8; 32];
        {
            let mut limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
            limiter.take(&alice, 4, 10).unwrap().unwrap();
        }
        let path = dir.path().join(format!("window-{DAY}-0.log"));
        // A crash in the middle of the next append.
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&[7u8; 17]).unwrap();
        drop(file);
        let mut limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        assert_eq!(
            limiter.take(&alice, 2, 11).unwrap(),
            Err(Exhausted {
                remaining: 1,
                window_ends_at: DAY
            })
        );
        assert_eq!(limiter.take(&alice, 1, 12).unwrap().unwrap().remaining, 0);
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            2 * RECORD_BYTES as u64
        );
    }

    #[test]
    fn a_damaged_record_before_others_refuses_the_start_and_nothing_names_the_device() {
        let dir = tempfile::tempdir().unwrap();
        let identity = [9u8; 32];
        {
            let mut limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
            limiter.take(&identity, 1, 10).unwrap().unwrap();
            limiter.take(&[3u8; 32], 1, 10).unwrap().unwrap();
        }
        let path = dir.path().join(format!("window-{DAY}-0.log"));
        let mut bytes = std::fs::read(&path).unwrap();
        assert!(!bytes.windows(32).any(|w| w == identity));
        bytes[33] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mut limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        assert!(matches!(
            limiter.take(&identity, 1, 11),
            Err(LimiterError::Damaged { record: 0, .. })
        ));
    }

    #[test]
    fn a_request_stamped_before_the_rollover_counts_in_the_new_window_and_empties_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut limiter = Limiter::open(dir.path(), 3, DAY).unwrap();
        let device = [5u8; 32];
        limiter.take(&device, 3, DAY + 1).unwrap().unwrap();
        // A request read the clock just before midnight and got the lock after this one, or
        // the clock stepped back: it counts in the current window, whose count holds.
        assert_eq!(
            limiter.take(&device, 1, DAY - 1).unwrap(),
            Err(Exhausted {
                remaining: 0,
                window_ends_at: 2 * DAY
            })
        );
        assert_eq!(
            limiter.take(&device, 1, DAY + 2).unwrap(),
            Err(Exhausted {
                remaining: 0,
                window_ends_at: 2 * DAY
            })
        );
        assert!(dir.path().join(format!("window-{DAY}-1.log")).exists());
    }

    #[test]
    fn a_second_limiter_on_the_same_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = Limiter::open(dir.path(), 3, DAY).unwrap();
        assert!(matches!(
            Limiter::open(dir.path(), 3, DAY),
            Err(LimiterError::Locked(_))
        ));
        drop(first);
        Limiter::open(dir.path(), 3, DAY).unwrap();
    }

    #[test]
    fn window_file_names_give_their_index() {
        assert_eq!(window_index("window-86400-20424.log"), Some(20424));
        assert_eq!(window_index("window-60--3.log"), Some(-3));
        assert_eq!(window_index("limiter.key"), None);
    }

    #[test]
    fn the_same_device_has_unrelated_rate_keys_in_different_windows_and_issuers() {
        let dir = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        let second = Limiter::open(other.path(), 5, DAY).unwrap();
        let identity = [4u8; 32];
        assert_ne!(
            limiter.rate_key(0, &identity),
            limiter.rate_key(1, &identity)
        );
        assert_ne!(
            limiter.rate_key(0, &identity),
            second.rate_key(0, &identity)
        );
        // The key persists: the same issuer names the device the same way after a restart.
        let before = limiter.rate_key(0, &identity);
        drop(limiter);
        let reopened = Limiter::open(dir.path(), 5, DAY).unwrap();
        assert_eq!(before, reopened.rate_key(0, &identity));
    }
}
