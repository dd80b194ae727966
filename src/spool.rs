//! Large request bodies (model uploads) go to a temporary file as they arrive, hashed on the
//! way, instead of into memory: a 512 MiB model costs the front end a file in the temporary
//! directory (`TMPDIR`), not 512 MiB of RSS, and a body over the limit is cut off at the limit.
//! The file has no name (`O_TMPFILE`, or unlinked at once): whatever ends the request, a crash
//! included, its space is given back.

use axum::body::Body;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use thiserror::Error;

/// Why a body was not spooled; `api::error` maps each to its status.
#[derive(Debug, Error)]
pub enum SpoolError {
    /// Every spool slot is taken: 503 with `Retry-After`.
    #[error(
        "{CONCURRENT_SPOOLS} uploads of a {what} are in progress on this server; retry after the Retry-After seconds"
    )]
    Busy { what: String },
    #[error("the {what} is larger than this server's limit of {limit} bytes")]
    TooLarge { what: String, limit: u64 },
    #[error("the {what} upload broke off: {detail}; send it again")]
    BrokenOff { what: String, detail: String },
    /// The temporary directory's disk is full (507).
    #[error("spooling the {what}: {source}")]
    DiskFull {
        what: String,
        source: std::io::Error,
    },
    #[error("spooling the {what}: {detail}")]
    Failed { what: String, detail: String },
}

/// Model uploads spooled at once by one process. Each may take up to the model limit on disk
/// (docs/operations.md: size the temporary directory for it).
pub const CONCURRENT_SPOOLS: usize = 4;
/// How long an upload waits for a slot before it is answered 503 with `Retry-After`.
const SLOT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

static SPOOLS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(CONCURRENT_SPOOLS);

/// A body written to a private, nameless temporary file (gone when this is dropped).
#[derive(Debug)]
pub struct Spooled {
    file: std::fs::File,
    pub len: u64,
    pub sha256_hex: String,
    _slot: tokio::sync::SemaphorePermit<'static>,
}

impl Spooled {
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The file's bytes mapped read-only (for validation without reading them into memory).
    pub fn map(&self) -> std::io::Result<memmap2::Mmap> {
        // SAFETY: the file is this process's own temporary file without a name (no other
        // process can open it), written completely before this call and never written again
        // while the map lives (`Spooled` owns it and offers no writer), so the mapped bytes do
        // not change under the reader.
        unsafe { memmap2::Mmap::map(&self.file) }
    }
}

/// Streams `body` into a temporary file, refusing (413) at the first byte past `limit`.
pub async fn spool(body: Body, limit: u64, what: &str) -> Result<Spooled, SpoolError> {
    spool_chunks(body.into_data_stream(), limit, what).await
}

/// `spool` of any stream of chunks (a multipart field of the console's form).
pub async fn spool_chunks<E: std::fmt::Display>(
    chunks: impl futures_util::Stream<Item = Result<axum::body::Bytes, E>>,
    limit: u64,
    what: &str,
) -> Result<Spooled, SpoolError> {
    let failed = |detail: String| SpoolError::Failed {
        what: what.to_string(),
        detail,
    };
    let slot = match tokio::time::timeout(SLOT_WAIT, SPOOLS.acquire()).await {
        Ok(slot) => slot.map_err(|e| failed(e.to_string()))?,
        Err(_) => {
            return Err(SpoolError::Busy {
                what: what.to_string(),
            });
        }
    };
    let io = |source: std::io::Error| {
        if crate::blob::is_disk_full(&source) {
            SpoolError::DiskFull {
                what: what.to_string(),
                source,
            }
        } else {
            failed(source.to_string())
        }
    };
    let file = tokio::task::spawn_blocking(tempfile::tempfile)
        .await
        .map_err(|e| failed(e.to_string()))?
        .map_err(io)?;
    let mut writer = tokio::io::BufWriter::with_capacity(
        1 << 20,
        tokio::fs::File::from_std(file.try_clone().map_err(io)?),
    );
    let mut digest = Sha256::new();
    let mut len = 0u64;
    let mut chunks = std::pin::pin!(chunks);
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| SpoolError::BrokenOff {
            what: what.to_string(),
            detail: e.to_string(),
        })?;
        len += chunk.len() as u64;
        if len > limit {
            return Err(SpoolError::TooLarge {
                what: what.to_string(),
                limit,
            });
        }
        digest.update(&chunk);
        writer.write_all(&chunk).await.map_err(io)?;
    }
    writer.flush().await.map_err(io)?;
    Ok(Spooled {
        file,
        len,
        sha256_hex: confed_protocol::hex::encode(digest.finalize()),
        _slot: slot,
    })
}
