//! The issuer's only memory of devices: how many tokens each attested device was granted in the
//! current window, durable before any token leaves (RFC 9576's rate limit at the issuer).
//!
//! A device is named by `rate_key = HMAC-SHA256(limiter key, label || window_seconds || window
//! index || device identity)`: the identity the attester derived never reaches the disk, and keys
//! of different windows share nothing. Each grant appends one 40-byte record to
//! `window-<seconds>-<index>.log` (`rate_key || count (u32, big-endian) || first 4 bytes of
//! SHA-256(rate_key || count)`) and syncs it before the tokens are signed, so a crash can lose
//! tokens a device was granted but never hand out more than L. Syncs are group commits: a
//! request appends its record under the lock and waits for a sync that covers it; one thread
//! syncs for everyone waiting, so concurrent requests share a `fdatasync` instead of queueing one
//! each behind the lock. A sync that fails leaves the file's state unknown (Linux may drop the
//! failed pages), so the limiter then refuses every grant until a restart replays the file. A record torn by a crash (a short
//! tail, or a last record whose check fails) is cut off at start; damage anywhere else refuses the
//! start. A write that fails is cut back to the last whole record (or, if that fails too, the
//! limiter refuses every grant until a restart replays the file). Files of earlier windows are
//! deleted when a later window opens; the window never moves back (a request stamped before the
//! rollover, or a clock stepped backwards, counts in the current window), so no device's count is
//! ever read from an emptied file. The state directory is locked (`flock` on `limiter.lock`) for the
//! life of the process: two issuers on one directory would each keep their own counts.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use confed_protocol::clock::Seconds;
use thiserror::Error;

mod files;

use files::{check, io, load_or_create_key, lock_dir, replay, sync_dir, window_index};

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
        "an earlier grant could not be recorded nor cut back, or a sync failed; restart the issuer (it replays the window file)"
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
    /// Shared with the thread that syncs it without holding the lock.
    file: Arc<File>,
    /// Bytes of whole records written to the file.
    length: u64,
    /// Bytes of the file known durable.
    synced: u64,
    counts: HashMap<[u8; 32], u32>,
}

#[derive(Default)]
struct State {
    window: Option<Window>,
    /// A failed write could not be cut back, or a sync failed: nothing more is granted.
    poisoned: bool,
    /// A thread is syncing the current window's file (without the lock).
    syncing: bool,
}

pub struct Limiter {
    dir: PathBuf,
    key: ring::hmac::Key,
    tokens_per_window: u32,
    window_seconds: i64,
    state: Mutex<State>,
    /// Signalled when a sync ends.
    synced: Condvar,
    /// Syncs of window files so far (the benchmark reports syncs per grant).
    syncs: AtomicU64,
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

impl Limiter {
    /// Opens (creating) the limiter state in `dir`.
    pub fn open(
        dir: &Path,
        tokens_per_window: u32,
        window_seconds: i64,
    ) -> Result<Self, LimiterError> {
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let lock = lock_dir(dir)?;
        let key = load_or_create_key(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key.as_ref()),
            tokens_per_window,
            window_seconds,
            state: Mutex::new(State::default()),
            synced: Condvar::new(),
            syncs: AtomicU64::new(0),
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

    /// Syncs of window files so far.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    fn rate_key(&self, index: i64, identity: &[u8; 32]) -> [u8; 32] {
        let mut context = ring::hmac::Context::with_key(&self.key);
        context.update(LABEL);
        context.update(&self.window_seconds.to_be_bytes());
        context.update(&index.to_be_bytes());
        context.update(identity);
        context.sign().as_ref().try_into().expect("32 bytes")
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, LimiterError> {
        // A thread that panicked holding the lock may have left counts half-updated.
        self.state.lock().map_err(|_| LimiterError::Poisoned)
    }

    /// Grants `count` tokens to the device `identity`, durably, or refuses without recording
    /// anything if that would pass the window's allowance. `now` is read under the lock, so
    /// grants of one device are counted in the order they are taken.
    pub fn take(
        &self,
        identity: &[u8; 32],
        count: u32,
        now: impl FnOnce() -> Seconds,
    ) -> Result<Result<Grant, Exhausted>, LimiterError> {
        let mut state = self.lock()?;
        if state.poisoned {
            return Err(LimiterError::Poisoned);
        }
        // Never back to an earlier window: its file may be gone, and its counts with it.
        let index = now()
            .0
            .div_euclid(self.window_seconds)
            .max(state.window.as_ref().map_or(i64::MIN, |w| w.index));
        let window_ends_at = Seconds((index + 1) * self.window_seconds);
        self.enter(&mut state, index)?;
        let rate_key = self.rate_key(index, identity);
        let State {
            window, poisoned, ..
        } = &mut *state;
        let window = window.as_mut().expect("entered");
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
        if let Err(error) = (&*window.file).write_all(&record) {
            // Cut back to the last whole record, so a later append does not follow a torn one.
            if window.file.set_len(window.length).is_err() {
                *poisoned = true;
            }
            return Err(io(&window.path)(error));
        }
        window.length += RECORD_BYTES as u64;
        // Counted now: a concurrent request of the same device sees this grant while it syncs.
        window.counts.insert(rate_key, used + count);
        let written = (index, window.length);
        self.wait_durable(state, written)?;
        Ok(Ok(Grant {
            remaining: remaining - count,
            window_ends_at,
        }))
    }

    /// Returns once the file of window `index` is durable through `length` bytes: syncing it
    /// for every waiter if no other thread is, waiting for that thread otherwise.
    fn wait_durable<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
        (index, length): (i64, u64),
    ) -> Result<(), LimiterError> {
        loop {
            if state.poisoned {
                return Err(LimiterError::Poisoned);
            }
            let Some(window) = state.window.as_ref().filter(|w| w.index == index) else {
                // `enter` synced the window before leaving it.
                return Ok(());
            };
            if window.synced >= length {
                return Ok(());
            }
            if state.syncing {
                state = self
                    .synced
                    .wait(state)
                    .map_err(|_| LimiterError::Poisoned)?;
                continue;
            }
            let (file, target) = (Arc::clone(&window.file), window.length);
            state.syncing = true;
            drop(state);
            let result = file.sync_data();
            self.syncs.fetch_add(1, Ordering::Relaxed);
            state = self.lock()?;
            state.syncing = false;
            match result {
                Ok(()) => {
                    if let Some(window) = state.window.as_mut().filter(|w| w.index == index) {
                        window.synced = window.synced.max(target);
                    }
                }
                Err(error) => {
                    state.poisoned = true;
                    self.synced.notify_all();
                    return Err(io(&self.dir)(error));
                }
            }
            self.synced.notify_all();
        }
    }

    /// Makes window `index` the current one: syncs the one it leaves (its grants' answers may
    /// still be waiting for that), replays the new one's file, or starts it, and deletes the
    /// files of every earlier window.
    fn enter(&self, state: &mut State, index: i64) -> Result<(), LimiterError> {
        if state.window.as_ref().is_some_and(|w| w.index == index) {
            return Ok(());
        }
        if let Some(old) = state.window.as_mut().filter(|w| w.synced < w.length) {
            if let Err(error) = old.file.sync_data() {
                state.poisoned = true;
                self.synced.notify_all();
                return Err(io(&old.path)(error));
            }
            old.synced = old.length;
            self.synced.notify_all();
        }
        state.window = None;
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
        state.window = Some(Window {
            index,
            path,
            file: Arc::new(file),
            length,
            synced: length,
            counts,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests;
