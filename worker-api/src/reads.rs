//! How a job reads its contributions from the untrusted store: once, after the key, when the job
//! lists their digests (uploads through the server); twice if it must (direct uploads): once to
//! digest them before the key is asked for, and (for those not kept from that read) again to open
//! them.
//!
//! The reads are the job's longest wait, so they overlap: `READ_AHEAD` store reads are in flight
//! at once, and while one batch of a first read is digested on all cores the next is read (the
//! open pass opens each contribution as it arrives, `Worker::open_all`). Buffers come back to a
//! small pool once digested or opened and are handed to the store for the next read, so a round
//! does not fault in (or zero) a fresh megabyte per contribution.

use std::sync::Mutex;

use futures_util::{Stream, StreamExt};

use crate::store::StoreError;

/// Store reads in flight at once. A local store overlaps its file reads with one another and
/// with the hashing; a remote one its round trips.
pub const READ_AHEAD: usize = 8;

/// Free read buffers, kept up to a total capacity.
pub struct BufferPool {
    free: Mutex<Free>,
    keep_bytes: usize,
}

#[derive(Default)]
struct Free {
    buffers: Vec<Vec<u8>>,
    /// The sum of their capacities.
    bytes: usize,
}

impl BufferPool {
    /// A pool that keeps at most `keep_bytes` of free buffers (the rest are dropped).
    pub fn new(keep_bytes: usize) -> Self {
        Self {
            free: Mutex::default(),
            keep_bytes,
        }
    }

    /// A buffer to read into: a returned one if any (its length and contents are the last
    /// read's; the store overwrites them), else an empty one.
    pub fn take(&self) -> Vec<u8> {
        let mut free = self.lock();
        let buffer = free.buffers.pop().unwrap_or_default();
        free.bytes -= buffer.capacity();
        buffer
    }

    /// Returns a buffer for a later read, unless the pool already keeps its share.
    pub fn give(&self, buffer: Vec<u8>) {
        let mut free = self.lock();
        if free.bytes + buffer.capacity() <= self.keep_bytes {
            free.bytes += buffer.capacity();
            free.buffers.push(buffer);
        }
    }

    pub fn give_all(&self, buffers: impl IntoIterator<Item = Vec<u8>>) {
        for buffer in buffers {
            self.give(buffer);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The next batch of `reads`: at most `max` items, ending early once it holds `max_bytes` of
/// stored bytes; empty when `reads` is done.
pub async fn next_batch<T>(
    reads: &mut (impl Stream<Item = Result<(T, Option<Vec<u8>>), StoreError>> + Unpin),
    max: usize,
    max_bytes: usize,
) -> Result<Vec<(T, Option<Vec<u8>>)>, StoreError> {
    let mut batch = Vec::new();
    let mut bytes = 0usize;
    while let Some(read) = reads.next().await {
        let (item, stored) = read?;
        bytes += stored.as_ref().map_or(0, Vec::len);
        batch.push((item, stored));
        if batch.len() >= max.max(1) || bytes >= max_bytes {
            break;
        }
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_keeps_buffers_up_to_its_capacity_and_drops_the_rest() {
        let pool = BufferPool::new(3000);
        pool.give(Vec::with_capacity(1000));
        pool.give(Vec::with_capacity(1000));
        pool.give(Vec::with_capacity(1500));
        let kept: Vec<usize> = (0..3).map(|_| pool.take().capacity()).collect();
        assert_eq!(kept, [1000, 1000, 0]);
        // Taken buffers free their share: the pool keeps up to its capacity again.
        pool.give(Vec::with_capacity(3000));
        assert_eq!(pool.take().capacity(), 3000);
    }

    #[tokio::test]
    async fn batches_end_at_the_count_or_the_bytes_whichever_comes_first() {
        let items = (0..10).map(|i| Ok((i, Some(vec![0u8; 100]))));
        let mut reads = futures_util::stream::iter(items);
        let by_count = next_batch(&mut reads, 3, 10_000).await.unwrap();
        assert_eq!(by_count.len(), 3);
        let by_bytes = next_batch(&mut reads, 100, 250).await.unwrap();
        assert_eq!(by_bytes.len(), 3, "the batch ends once it holds 250 bytes");
        let rest = next_batch(&mut reads, 100, 10_000).await.unwrap();
        assert_eq!(rest.len(), 4);
        assert!(
            next_batch(&mut reads, 100, 10_000)
                .await
                .unwrap()
                .is_empty()
        );
    }
}
