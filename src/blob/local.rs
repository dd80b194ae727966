//! The embedded default blob store: a local directory. A put writes a temporary file next to its
//! target, fsyncs it, renames it into place without replacing (`RENAME_NOREPLACE`; which fails
//! rather than overwrite) and fsyncs the directory, so an acknowledged object survives a crash
//! and no object is ever replaced.
//!
//! Because objects never change, reads of small ones are cached in memory (models are read by
//! every device that checks in; a read from the cache costs no file system call and no hop to
//! the blocking pool).

use std::fs::{self, File};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use super::cache::ReadCache;
use super::{BlobError, BlobFuture, BlobKey, BlobStore, PutOutcome};

#[derive(Clone)]
pub struct LocalBlobStore {
    root: PathBuf,
    cache: std::sync::Arc<std::sync::Mutex<ReadCache>>,
}

impl std::fmt::Debug for LocalBlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBlobStore")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl LocalBlobStore {
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, BlobError> {
        let root = root.into();
        fs::create_dir_all(&root).map_err(|source| BlobError::Io {
            key: root.display().to_string(),
            source,
        })?;
        let swept = sweep_partials(&root).map_err(|source| BlobError::Io {
            key: root.display().to_string(),
            source,
        })?;
        if swept > 0 {
            tracing::info!(root = %root.display(), files = swept,
                "removed temporary files left by an interrupted write");
        }
        Ok(Self {
            root,
            cache: Default::default(),
        })
    }

    fn path(&self, key: &BlobKey) -> PathBuf {
        self.root.join(key.as_str())
    }

    fn put_blocking(&self, key: &BlobKey, source: Source<'_>) -> Result<PutOutcome, BlobError> {
        let io = |source| BlobError::Io {
            key: key.as_str().to_string(),
            source,
        };
        let target = self.path(key);
        if target.exists() {
            return same_content(&target, source, key);
        }
        let parent = target.parent().unwrap_or(&self.root);
        fs::create_dir_all(parent).map_err(io)?;
        // The temporary file lives next to its target, so publishing it is one rename in one
        // directory (no shared temp directory every writer contends on).
        let name = target
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("blob");
        let temp = parent.join(format!(".{name}.{}.partial", uuid::Uuid::new_v4()));
        let written = (|| {
            let mut file = File::create(&temp)?;
            source.write_to(&mut file)?;
            file.sync_all()
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(io(e));
        }
        let published = publish_no_replace(&temp, &target);
        if published.is_err() {
            let _ = fs::remove_file(&temp);
        }
        match published {
            Ok(()) => {
                File::open(parent).and_then(|d| d.sync_all()).map_err(io)?;
                Ok(PutOutcome::Created)
            }
            // Another writer won the race: fine if it stored the same bytes.
            Err(e) if e.kind() == ErrorKind::AlreadyExists => same_content(&target, source, key),
            Err(e) => Err(io(e)),
        }
    }
}

/// Removes `.*.partial` files under `root`: writes interrupted by a crash (a published blob is
/// renamed away from its temporary name, so none of these is referenced). Runs when the store
/// opens, before anything writes.
fn sweep_partials(root: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let kind = entry.file_type()?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if kind.is_dir() {
                pending.push(entry.path());
            } else if kind.is_file() && name.starts_with('.') && name.ends_with(".partial") {
                fs::remove_file(entry.path())?;
                removed += 1;
            }
        }
    }
    Ok(removed)
}

/// Moves `temp` to `target` unless `target` exists (then `AlreadyExists`): `renameat2` with
/// `RENAME_NOREPLACE` on Linux, a hard link and unlink where that is unsupported.
fn publish_no_replace(temp: &Path, target: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let from = CString::new(temp.as_os_str().as_bytes())?;
        let to = CString::new(target.as_os_str().as_bytes())?;
        // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
        let result = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if result == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINVAL) && error.raw_os_error() != Some(libc::ENOSYS)
        {
            return Err(error);
        }
    }
    fs::hard_link(temp, target)?;
    fs::remove_file(temp)
}

/// What a put stores: bytes in memory, or a file's content, copied without holding it whole.
#[derive(Debug, Clone, Copy)]
enum Source<'a> {
    Bytes(&'a [u8]),
    File(&'a File),
}

impl Source<'_> {
    fn write_to(self, file: &mut File) -> std::io::Result<()> {
        match self {
            Self::Bytes(bytes) => file.write_all(bytes),
            Self::File(source) => {
                std::io::copy(&mut super::FileFromStart::new(source), file).map(|_| ())
            }
        }
    }

    /// Whether the file at `path` holds exactly this content (read in 1 MiB pieces).
    fn is_content_of(self, path: &Path) -> std::io::Result<bool> {
        use std::io::Read;
        match self {
            Self::Bytes(bytes) => Ok(fs::read(path)? == bytes),
            Self::File(mine) => {
                let (mut a, mut b) = (super::FileFromStart::new(mine), File::open(path)?);
                if mine.metadata()?.len() != b.metadata()?.len() {
                    return Ok(false);
                }
                let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
                loop {
                    let n = a.read(&mut x)?;
                    if n == 0 {
                        return Ok(true);
                    }
                    b.read_exact(&mut y[..n])?;
                    if x[..n] != y[..n] {
                        return Ok(false);
                    }
                }
            }
        }
    }
}

fn same_content(path: &Path, source: Source<'_>, key: &BlobKey) -> Result<PutOutcome, BlobError> {
    let same = source.is_content_of(path).map_err(|source| BlobError::Io {
        key: key.as_str().to_string(),
        source,
    })?;
    if same {
        Ok(PutOutcome::AlreadyPresent)
    } else {
        Err(BlobError::Conflict(key.as_str().to_string()))
    }
}

impl BlobStore for LocalBlobStore {
    fn put<'a>(&'a self, key: &'a BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            // Large writes and fsync block: keep them off the async workers.
            let store = self.clone();
            let key_owned = key.clone();
            let bytes_owned = bytes.to_vec();
            tokio::task::spawn_blocking(move || {
                store.put_blocking(&key_owned, Source::Bytes(&bytes_owned))
            })
            .await
            .map_err(|e| BlobError::Io {
                key: key.as_str().to_string(),
                source: std::io::Error::other(e),
            })?
        })
    }

    fn put_file<'a>(&'a self, key: &'a BlobKey, file: &'a File) -> BlobFuture<'a, PutOutcome> {
        Box::pin(async move {
            let store = self.clone();
            let key_owned = key.clone();
            let io = |source| BlobError::Io {
                key: key.as_str().to_string(),
                source,
            };
            let file = file.try_clone().map_err(io)?;
            tokio::task::spawn_blocking(move || store.put_blocking(&key_owned, Source::File(&file)))
                .await
                .map_err(|e| BlobError::Io {
                    key: key.as_str().to_string(),
                    source: std::io::Error::other(e),
                })?
        })
    }

    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            if let Some(bytes) = self.cache.lock().ok().and_then(|c| c.get(key)) {
                return Ok(bytes);
            }
            match tokio::fs::read(self.path(key)).await {
                Ok(bytes) => {
                    if let Ok(mut cache) = self.cache.lock() {
                        cache.insert(key, &bytes);
                    }
                    Ok(bytes)
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    Err(BlobError::NotFound(key.as_str().to_string()))
                }
                Err(source) => Err(BlobError::Io {
                    key: key.as_str().to_string(),
                    source,
                }),
            }
        })
    }

    fn discard<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, ()> {
        Box::pin(async move {
            if let Ok(mut cache) = self.cache.lock() {
                cache.remove(key);
            }
            match tokio::fs::remove_file(self.path(key)).await {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(source) => Err(BlobError::Io {
                    key: key.as_str().to_string(),
                    source,
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::cache::CACHE_OBJECT_BYTES;

    #[tokio::test]
    async fn small_objects_are_read_from_memory_after_the_first_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalBlobStore::open(dir.path()).unwrap();
        let key = BlobKey::new("tenants/a/tasks/b/models/1-y.safetensors").unwrap();
        store.put(&key, b"model bytes").await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), b"model bytes");
        // The file is gone (no code path of confed does this); the cached copy still answers,
        // which is only correct because objects never change.
        std::fs::remove_file(dir.path().join(key.as_str())).unwrap();
        assert_eq!(store.get(&key).await.unwrap(), b"model bytes");
        let big = BlobKey::new("tenants/a/tasks/b/models/2-z.safetensors").unwrap();
        store
            .put(&big, &vec![7u8; CACHE_OBJECT_BYTES + 1])
            .await
            .unwrap();
        store.get(&big).await.unwrap();
        std::fs::remove_file(dir.path().join(big.as_str())).unwrap();
        assert!(matches!(store.get(&big).await, Err(BlobError::NotFound(_))));
    }

    #[tokio::test]
    async fn a_discarded_object_is_gone_from_disk_and_memory() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalBlobStore::open(dir.path()).unwrap();
        let key = BlobKey::new("tenants/a/tasks/b/rounds/1/attempt-1/partition-0-of-2-x.partition")
            .unwrap();
        store.put(&key, b"sealed").await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), b"sealed");
        store.discard(&key).await.unwrap();
        assert!(!dir.path().join(key.as_str()).exists());
        assert!(matches!(store.get(&key).await, Err(BlobError::NotFound(_))));
        // Again: nothing to delete is not an error.
        store.discard(&key).await.unwrap();
    }

    #[tokio::test]
    async fn put_then_get_round_trips_and_is_write_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalBlobStore::open(dir.path()).unwrap();
        let key = BlobKey::new("tenants/a/tasks/b/models/0-x.safetensors").unwrap();
        assert_eq!(
            store.put(&key, b"hello").await.unwrap(),
            PutOutcome::Created
        );
        assert_eq!(store.get(&key).await.unwrap(), b"hello");
        assert_eq!(
            store.put(&key, b"hello").await.unwrap(),
            PutOutcome::AlreadyPresent
        );
        assert!(matches!(
            store.put(&key, b"other").await,
            Err(BlobError::Conflict(_))
        ));
        assert_eq!(store.get(&key).await.unwrap(), b"hello");
        let leftovers = fs::read_dir(dir.path().join("tenants/a/tasks/b/models"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".partial")
            })
            .count();
        assert_eq!(leftovers, 0, "no temporary file is left behind");
    }

    /// A kill during a write left `.partial` files forever; the next open removes them and
    /// leaves every published blob alone.
    #[tokio::test]
    async fn partial_files_left_by_a_kill_are_removed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalBlobStore::open(dir.path()).unwrap();
        let key = BlobKey::new("tenants/a/tasks/b/models/1.safetensors").unwrap();
        store.put(&key, b"kept").await.unwrap();
        let models = dir.path().join("tenants/a/tasks/b/models");
        let leftover = models.join(".2.safetensors.0b1e.partial");
        fs::write(&leftover, b"half").unwrap();
        fs::write(models.join("not-a-temp.partial"), b"a blob named so").unwrap();
        drop(store);
        let store = LocalBlobStore::open(dir.path()).unwrap();
        assert!(!leftover.exists());
        assert!(
            models.join("not-a-temp.partial").exists(),
            "only our temp names"
        );
        assert_eq!(store.get(&key).await.unwrap(), b"kept");
    }

    #[tokio::test]
    async fn missing_blob_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalBlobStore::open(dir.path()).unwrap();
        let key = BlobKey::new("nothing/here").unwrap();
        assert!(matches!(store.get(&key).await, Err(BlobError::NotFound(_))));
    }
}
