//! The embedded default's contribution store: append-only segment files.
//!
//! Every device upload is a small write-once object read back once, by the aggregation. Storing
//! each in the task database wrote its bytes twice (SQLite's WAL, then the checkpoint) on the
//! single writer's thread; a file per object costs an inode, a rename and two fsyncs. Here a
//! put appends one record to the current segment from the request's own task and waits for a
//! sync thread that `fdatasync`s once for every record written meanwhile (group commit). Only
//! then does the caller write the database row that refers to the record, so a row never names
//! bytes that are not durable; a crash between the two leaves an unreferenced record, which is
//! harmless.
//!
//! The log places objects itself: `put_new` returns a key naming the segment, offset and length
//! (`log/<segment>/<offset>/<length>/<caller's key>`), and `get` reads exactly there and checks
//! the record's magic, key and SHA-256. Write-once per caller key is the database row's job
//! (an assignment takes one contribution digest); the log therefore refuses the keyed `put`.
//! A key that is not a log key names nothing here (`NotFound`).
//!
//! Record: `CFL1` | payload length u32 LE | SHA-256 of payload (32) | key length u16 LE | key |
//! payload.
//!
//! A record whose write fails (a full disk) gives its bytes back at once (`log/reclaim.rs`).

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use super::{BlobError, BlobFuture, BlobKey, BlobStore, PutOutcome, SealedReader};

const MAGIC: &[u8; 4] = b"CFL1";
const HEADER_BYTES: usize = 4 + 4 + 32 + 2;
/// A segment is closed once it passes this size (a record is never split).
const SEGMENT_BYTES: u64 = 256 << 20;
/// Records up to this size are written on the calling task (a copy into the page cache costs
/// microseconds, less than a hop to the blocking pool); larger ones go to the blocking pool.
const INLINE_WRITE_BYTES: usize = 1 << 20;

pub struct ContributionLog {
    /// Held open for its exclusive lock: two logs appending to one segment would overwrite
    /// each other's records.
    _lock: File,
    dir: PathBuf,
    segment_bytes: u64,
    active: Mutex<Active>,
    readers: Arc<Readers>,
    sync: Arc<SyncQueue>,
    /// Makes the next record's write fail halfway, as a full disk does.
    #[cfg(test)]
    fail_writes: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ContributionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContributionLog")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

struct Active {
    segment: u32,
    file: Arc<File>,
    /// Where the next record goes; reserved under the lock, written outside it.
    end: u64,
}

/// Writers waiting for an fdatasync that covers their record.
#[derive(Default)]
struct SyncQueue {
    state: Mutex<SyncState>,
    wake: Condvar,
}

/// Told whether the fdatasync covering a record succeeded (why not, if not).
type SyncDone = oneshot::Sender<Result<(), SyncFailure>>;

/// A failed fdatasync: whether the disk was full (so devices are told 507, not 500) and what the
/// kernel said.
#[derive(Debug, Clone)]
struct SyncFailure {
    disk_full: bool,
    reason: String,
}

impl SyncFailure {
    fn into_io(self) -> std::io::Error {
        let kind = if self.disk_full {
            std::io::ErrorKind::StorageFull
        } else {
            std::io::ErrorKind::Other
        };
        std::io::Error::new(kind, self.reason)
    }
}

#[derive(Default)]
struct SyncState {
    waiting: Vec<(Arc<File>, SyncDone)>,
    /// Set after a failed fdatasync: the kernel may have dropped the dirty pages, so nothing
    /// written before it can be called durable again. Every later put fails until a restart.
    poisoned: Option<SyncFailure>,
    stop: bool,
}

fn segment_name(segment: u32) -> String {
    format!("segment-{segment:08}.log")
}

fn io_error(what: impl Into<String>, source: std::io::Error) -> BlobError {
    BlobError::Io {
        key: what.into(),
        source,
    }
}

impl ContributionLog {
    /// Opens (or creates) the log in `dir`; new records go to a fresh segment after the highest
    /// non-empty one, so a torn tail left by a crash is never appended to.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, BlobError> {
        Self::open_with_segment_bytes(dir.into(), SEGMENT_BYTES)
    }

    fn open_with_segment_bytes(dir: PathBuf, segment_bytes: u64) -> Result<Self, BlobError> {
        let shown = dir.display().to_string();
        fs::create_dir_all(&dir).map_err(|e| io_error(&shown, e))?;
        let lock = lock_dir(&dir)?;
        let mut highest = 0u32;
        for entry in fs::read_dir(&dir).map_err(|e| io_error(&shown, e))? {
            let name = entry.map_err(|e| io_error(&shown, e))?.file_name();
            let name = name.to_string_lossy();
            if let Some(n) = name
                .strip_prefix("segment-")
                .and_then(|rest| rest.strip_suffix(".log"))
                .and_then(|n| n.parse::<u32>().ok())
            {
                highest = highest.max(n);
            }
        }
        // An empty last segment (a restart without uploads) is reused rather than left behind.
        let last = dir.join(segment_name(highest));
        let (segment, file) = match fs::metadata(&last) {
            Ok(meta) if highest > 0 && meta.len() == 0 => (
                highest,
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&last)
                    .map_err(|e| io_error(&shown, e))?,
            ),
            _ => {
                let next = highest.checked_add(1).ok_or_else(|| {
                    io_error(&shown, std::io::Error::other("segment numbers exhausted"))
                })?;
                (next, create_segment(&dir, next)?)
            }
        };
        let sync = Arc::new(SyncQueue::default());
        let thread_queue = Arc::clone(&sync);
        std::thread::Builder::new()
            .name("confed-log-sync".into())
            .spawn(move || sync_loop(&thread_queue))
            .map_err(|e| io_error(&shown, e))?;
        Ok(Self {
            _lock: lock,
            dir: dir.clone(),
            segment_bytes,
            active: Mutex::new(Active {
                segment,
                file: Arc::new(file),
                end: 0,
            }),
            readers: Arc::new(Readers {
                dir: dir.clone(),
                open: Mutex::new(ReaderCache::default()),
            }),
            sync,
            #[cfg(test)]
            fail_writes: Default::default(),
        })
    }

    /// Reserves room for a record of `len` bytes, moving to a new segment when the current one
    /// is full. Returns the segment, its file and the record's offset.
    fn reserve(&self, len: u64) -> Result<(u32, Arc<File>, u64), BlobError> {
        let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
        if active.end > 0 && active.end + len > self.segment_bytes {
            let next = active.segment + 1;
            let file = create_segment(&self.dir, next)?;
            *active = Active {
                segment: next,
                file: Arc::new(file),
                end: 0,
            };
        }
        let offset = active.end;
        active.end += len;
        Ok((active.segment, Arc::clone(&active.file), offset))
    }

    async fn append(&self, key: BlobKey, bytes: &[u8]) -> Result<BlobKey, BlobError> {
        let key_bytes = key.as_str().as_bytes();
        let payload_len = u32::try_from(bytes.len()).map_err(|_| {
            io_error(
                key.as_str(),
                std::io::Error::other("a contribution over 4 GiB cannot be logged"),
            )
        })?;
        let mut record = Vec::with_capacity(HEADER_BYTES + key_bytes.len() + bytes.len());
        record.extend_from_slice(MAGIC);
        record.extend_from_slice(&payload_len.to_le_bytes());
        record.extend_from_slice(&Sha256::digest(bytes));
        // BlobKey::new caps keys at 1024 bytes.
        record.extend_from_slice(&(key_bytes.len() as u16).to_le_bytes());
        record.extend_from_slice(key_bytes);
        record.extend_from_slice(bytes);
        let (segment, file, offset) = self.reserve(record.len() as u64)?;
        let record_len = record.len();
        let write_file = Arc::clone(&file);
        let write = move || write_file.write_all_at(&record, offset);
        let written = if record_len <= INLINE_WRITE_BYTES {
            write()
        } else {
            tokio::task::spawn_blocking(write)
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
        };
        #[cfg(test)]
        let written = match self
            .fail_writes
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            // A disk that fills halfway through the record.
            true => file
                .write_all_at(&[0xAB; 64][..64.min(record_len)], offset)
                .and(Err(std::io::Error::from_raw_os_error(libc::ENOSPC))),
            false => written,
        };
        if let Err(e) = written {
            self.abandon(segment, &file, offset, record_len as u64);
            return Err(io_error(key.as_str(), e));
        }
        self.synced(file).await.map_err(|failure| {
            Self::count_unsynced(record_len as u64);
            // A full disk at fdatasync keeps its kind, so devices get 507 rather than 500.
            let failure = SyncFailure {
                reason: format!("contribution log not durable: {}", failure.reason),
                ..failure
            };
            io_error(key.as_str(), failure.into_io())
        })?;
        BlobKey::new(format!(
            "log/{segment:08}/{offset}/{record_len}/{}",
            key.as_str()
        ))
    }

    /// Waits until an fdatasync of `file` that started after this call has finished.
    async fn synced(&self, file: Arc<File>) -> Result<(), SyncFailure> {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.sync.state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(reason) = &state.poisoned {
                return Err(reason.clone());
            }
            state.waiting.push((file, tx));
        }
        self.sync.wake.notify_one();
        rx.await.unwrap_or_else(|_| {
            Err(SyncFailure {
                disk_full: false,
                reason: "the log's sync thread stopped".into(),
            })
        })
    }
}

impl Drop for ContributionLog {
    fn drop(&mut self) {
        let mut state = self.sync.state.lock().unwrap_or_else(|e| e.into_inner());
        state.stop = true;
        drop(state);
        self.sync.wake.notify_one();
    }
}

/// Segment files kept open for reading at most: an aggregation reads a round's segments
/// in order, so a few suffice, and every segment ever read once stayed open (25 after a
/// 10-minute soak, ~144 an hour).
const MAX_OPEN_READERS: usize = 16;

/// Open segment files for reading, shared with the blocking pool: at most `MAX_OPEN_READERS`,
/// the least recently used closed first (a read in flight keeps its own handle).
struct Readers {
    dir: PathBuf,
    open: Mutex<ReaderCache>,
}

#[derive(Default)]
struct ReaderCache {
    files: HashMap<u32, (Arc<File>, u64)>,
    tick: u64,
}

impl Readers {
    fn file(&self, segment: u32) -> Result<Arc<File>, std::io::Error> {
        let mut cache = self.open.lock().unwrap_or_else(|e| e.into_inner());
        cache.tick += 1;
        let tick = cache.tick;
        if let Some((file, used)) = cache.files.get_mut(&segment) {
            *used = tick;
            return Ok(Arc::clone(file));
        }
        let file = Arc::new(File::open(self.dir.join(segment_name(segment)))?);
        if cache.files.len() >= MAX_OPEN_READERS
            && let Some(oldest) = cache
                .files
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(segment, _)| *segment)
        {
            cache.files.remove(&oldest);
        }
        cache.files.insert(segment, (Arc::clone(&file), tick));
        Ok(file)
    }

    /// Closes a segment's cached handle (before the segment is deleted).
    fn forget(&self, segment: u32) {
        let mut cache = self.open.lock().unwrap_or_else(|e| e.into_inner());
        cache.files.remove(&segment);
    }

    #[cfg(test)]
    fn open_files(&self) -> usize {
        self.open.lock().map(|c| c.files.len()).unwrap_or(0)
    }

    /// The payload of the record at `location`, after checking that the record is there, is
    /// the key's, and (with `digest`) that its bytes match the digest in its header. The payload
    /// is read into `payload`, whose old contents are overwritten (and only its growth zeroed).
    fn read(
        &self,
        location: &Location,
        digest: bool,
        mut payload: Vec<u8>,
    ) -> Result<Vec<u8>, std::io::Error> {
        let file = self.file(location.segment)?;
        let head_len = HEADER_BYTES + location.key.len();
        if location.len < head_len {
            return Err(std::io::Error::other(
                "the record's location is shorter than its header",
            ));
        }
        // Header and payload are read apart, so the payload lands in its own buffer uncopied.
        let mut head = vec![0u8; head_len];
        file.read_exact_at(&mut head, location.offset)?;
        let payload_len = location.len - head_len;
        // The record's own length before the buffer is sized: a key naming more than its record
        // holds (whoever writes the database writes keys) must cost an error, not that memory.
        if head[..4] != *MAGIC {
            return Err(std::io::Error::other(
                "no record at this offset (bad magic)",
            ));
        }
        if u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize != payload_len {
            return Err(std::io::Error::other(
                "the record at this offset is not of the key's length",
            ));
        }
        if payload.len() >= payload_len {
            payload.truncate(payload_len);
        } else {
            payload.resize(payload_len, 0);
        }
        file.read_exact_at(&mut payload, location.offset + head_len as u64)?;
        check_record(&head, &payload, &location.key, digest).map_err(std::io::Error::other)?;
        Ok(payload)
    }
}

fn lock_dir(dir: &Path) -> Result<File, BlobError> {
    let path = dir.join("LOCK");
    let shown = path.display().to_string();
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io_error(&shown, e))?;
    // An exclusive advisory lock (`flock` on Linux), released when the file is closed.
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(io_error(
            &shown,
            std::io::Error::other(
                "another process has this contribution log open; run one confed server per data directory",
            ),
        )),
        Err(std::fs::TryLockError::Error(e)) => Err(io_error(&shown, e)),
    }
}

fn create_segment(dir: &Path, segment: u32) -> Result<File, BlobError> {
    let path = dir.join(segment_name(segment));
    let shown = path.display().to_string();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| io_error(&shown, e))?;
    // The new name must be durable before any record in it is acknowledged.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(&shown, e))?;
    Ok(file)
}

/// One fdatasync per distinct segment for everything queued since the last one.
fn sync_loop(queue: &SyncQueue) {
    loop {
        let batch = {
            let mut state = queue.state.lock().unwrap_or_else(|e| e.into_inner());
            while state.waiting.is_empty() && !state.stop {
                state = queue.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.waiting.is_empty() {
                return;
            }
            std::mem::take(&mut state.waiting)
        };
        let mut synced: Vec<*const File> = Vec::new();
        let mut failure = None;
        for (file, _) in &batch {
            let ptr = Arc::as_ptr(file);
            if synced.contains(&ptr) || failure.is_some() {
                continue;
            }
            if let Err(e) = file.sync_data() {
                failure = Some(SyncFailure {
                    disk_full: super::is_disk_full(&e),
                    reason: format!("fdatasync failed: {e}"),
                });
            }
            synced.push(ptr);
        }
        if let Some(failure) = &failure {
            tracing::error!(reason = %failure.reason, "contribution log: fdatasync failed; refusing further uploads until restart");
            queue
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .poisoned = Some(failure.clone());
        }
        for (_, done) in batch {
            let _ = done.send(failure.clone().map_or(Ok(()), Err));
        }
    }
}

/// Where a log key says its record is.
struct Location {
    segment: u32,
    offset: u64,
    len: usize,
    key: String,
}

fn parse_location(key: &str) -> Option<Location> {
    let rest = key.strip_prefix("log/")?;
    let mut parts = rest.splitn(4, '/');
    let segment = parts.next()?.parse().ok()?;
    let offset = parts.next()?.parse().ok()?;
    let len: usize = parts.next()?.parse().ok()?;
    let key = parts.next()?;
    (len >= HEADER_BYTES + key.len()).then(|| Location {
        segment,
        offset,
        len,
        key: key.to_string(),
    })
}

/// Checks a record read as `head` (header and key) and `payload`: the magic, that it is `key`'s
/// and of the stated length, and with `digest` its SHA-256.
fn check_record(head: &[u8], payload: &[u8], key: &str, digest: bool) -> Result<(), String> {
    if &head[..4] != MAGIC {
        return Err("no record at this offset (bad magic)".into());
    }
    let payload_len = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes")) as usize;
    let key_len = u16::from_le_bytes(head[40..42].try_into().expect("2 bytes")) as usize;
    if key_len != key.len()
        || HEADER_BYTES + key_len != head.len()
        || payload_len != payload.len()
        || &head[HEADER_BYTES..] != key.as_bytes()
    {
        return Err("the record at this offset belongs to another object".into());
    }
    if digest && Sha256::digest(payload)[..] != head[8..40] {
        return Err("the record's bytes do not match its digest (corrupted)".into());
    }
    Ok(())
}

impl ContributionLog {
    /// Deletes segments below the oldest one a row still refers to (all but the active one when
    /// none is), if last written more than `idle` ago: a segment written moments ago may hold a
    /// durable record whose row is about to be committed.
    async fn retire(
        &self,
        oldest_referenced: Option<&str>,
        idle: std::time::Duration,
    ) -> Result<usize, BlobError> {
        let active = self
            .active
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .segment;
        let keep_from = oldest_referenced
            .and_then(parse_location)
            .map_or(active, |l| l.segment.min(active));
        let (dir, readers) = (self.dir.clone(), Arc::clone(&self.readers));
        let shown = dir.display().to_string();
        tokio::task::spawn_blocking(move || retire_segments(&dir, &readers, keep_from, idle))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
            .map_err(|e| io_error(shown, e))
    }
}

fn retire_segments(
    dir: &Path,
    readers: &Readers,
    keep_from: u32,
    idle: std::time::Duration,
) -> std::io::Result<usize> {
    let now = std::time::SystemTime::now();
    let mut retired = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(segment) = name
            .to_str()
            .and_then(|n| n.strip_prefix("segment-"))
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let idle_enough = entry
            .metadata()?
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age >= idle);
        if segment < keep_from && idle_enough {
            readers.forget(segment);
            fs::remove_file(entry.path())?;
            retired += 1;
        }
    }
    if retired > 0 {
        File::open(dir)?.sync_all()?;
    }
    Ok(retired)
}

impl BlobStore for ContributionLog {
    fn retire_unreferenced<'a>(
        &'a self,
        oldest_referenced: Option<&'a str>,
        idle: std::time::Duration,
    ) -> BlobFuture<'a, usize> {
        Box::pin(self.retire(oldest_referenced, idle))
    }

    fn put<'a>(&'a self, key: &'a BlobKey, _bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            Err(BlobError::Io {
                key: key.as_str().to_string(),
                source: std::io::Error::other(
                    "the contribution log places objects itself; store with put_new",
                ),
            })
        })
    }

    fn put_new<'a>(&'a self, key: BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, BlobKey> {
        Box::pin(self.append(key, bytes))
    }

    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(self.read_object(key, true, Vec::new()))
    }

    /// Skips the SHA-256 of the record: the enclave's AEAD authenticates every byte of a
    /// contribution (see `BlobStore::get_sealed`). Magic, key and length are still checked.
    fn get_sealed<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(self.read_object(key, false, Vec::new()))
    }

    fn get_sealed_into<'a>(&'a self, key: &'a BlobKey, buffer: Vec<u8>) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(self.read_object(key, false, buffer))
    }

    fn sealed_reader(&self) -> Option<Arc<dyn SealedReader>> {
        Some(Arc::new(SegmentReader(Arc::clone(&self.readers))))
    }
}

/// The log's sealed reads on the calling thread: a positioned read from a segment file.
struct SegmentReader(Arc<Readers>);

impl SealedReader for SegmentReader {
    fn get_sealed_into(&self, key: &BlobKey, buffer: Vec<u8>) -> Result<Vec<u8>, BlobError> {
        let location = located(key)?;
        self.0
            .read(&location, false, buffer)
            .map_err(|e| read_error(key, e))
    }
}

/// Where `key`'s record is, or `NotFound` for a key the log never gave out.
fn located(key: &BlobKey) -> Result<Location, BlobError> {
    parse_location(key.as_str()).ok_or_else(|| BlobError::NotFound(key.as_str().to_string()))
}

fn read_error(key: &BlobKey, e: std::io::Error) -> BlobError {
    if e.kind() == std::io::ErrorKind::NotFound {
        BlobError::NotFound(key.as_str().to_string())
    } else {
        io_error(key.as_str(), e)
    }
}

impl ContributionLog {
    async fn read_object(
        &self,
        key: &BlobKey,
        digest: bool,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, BlobError> {
        let location = located(key)?;
        let readers = Arc::clone(&self.readers);
        tokio::task::spawn_blocking(move || readers.read(&location, digest, buffer))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
            .map_err(|e| read_error(key, e))
    }
}

mod reclaim;

#[cfg(test)]
mod tests;
