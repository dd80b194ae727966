//! A read cache for small immutable objects (models are read by every device that checks in).
//! Objects are write-once, so a cached copy is never stale.

use super::BlobKey;

/// Objects up to this size are cached ...
pub(super) const CACHE_OBJECT_BYTES: usize = 4 << 20;
/// ... up to this total; past it the cache starts over.
const CACHE_TOTAL_BYTES: usize = 64 << 20;

#[derive(Default)]
pub(super) struct ReadCache {
    objects: std::collections::HashMap<String, std::sync::Arc<Vec<u8>>>,
    bytes: usize,
}

impl ReadCache {
    pub(super) fn get(&self, key: &BlobKey) -> Option<Vec<u8>> {
        self.objects.get(key.as_str()).map(|b| b.as_ref().clone())
    }

    /// Forgets `key` (its object was deleted).
    pub(super) fn remove(&mut self, key: &BlobKey) {
        if let Some(bytes) = self.objects.remove(key.as_str()) {
            self.bytes -= bytes.len();
        }
    }

    pub(super) fn insert(&mut self, key: &BlobKey, bytes: &[u8]) {
        if bytes.len() > CACHE_OBJECT_BYTES {
            return;
        }
        if self.bytes + bytes.len() > CACHE_TOTAL_BYTES {
            self.objects.clear();
            self.bytes = 0;
        }
        self.bytes += bytes.len();
        self.objects.insert(
            key.as_str().to_string(),
            std::sync::Arc::new(bytes.to_vec()),
        );
    }
}
