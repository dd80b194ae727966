//! The exact, un-noised sums of an analytics round: one counter per key of a closed domain, per
//! node of the quantile tree, or per distinct string of an open domain. Added to from every core
//! at once; never leaves the enclave (`release.rs` noises it).
//!
//! Memory is bounded by the query, not by the reports: a closed domain holds `domain_size`
//! counters, the quantile tree 69,904, an open domain one entry per distinct key it has seen, at
//! most `MAX_OPEN_KEYS` (then it stops taking new keys and the round releases nothing:
//! `dp::analytics::DistinctCheck`).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use confed_dp::analytics::MAX_OPEN_KEYS;
use confed_protocol::analytics::{AnalyticsQuery, QUANTILE_BRANCHING, QUANTILE_LEVELS};
use confed_protocol::answer::Key;

/// Shards of an open domain's map: adds from different cores rarely wait on one another.
const SHARDS: usize = 64;

/// The nodes of the quantile tree, level by level (16, 256, 4096, 65536).
pub fn tree_nodes() -> usize {
    (1..=QUANTILE_LEVELS)
        .map(|level| (QUANTILE_BRANCHING as usize).pow(level))
        .sum()
}

/// Where level `level` (1-based) of the quantile tree starts in the table.
pub fn level_start(level: u32) -> usize {
    (1..level)
        .map(|l| (QUANTILE_BRANCHING as usize).pow(l))
        .sum()
}

/// An open domain's keys with their exact counts, sorted by key bytes.
pub type OpenCounts = Vec<(Box<[u8]>, u64)>;

pub enum Table {
    /// A closed domain's keys or the quantile tree's nodes.
    Dense { counts: Vec<AtomicU64>, tree: bool },
    Open {
        shards: Vec<Mutex<HashMap<Box<[u8]>, u64>>>,
        hasher: RandomState,
        keys: AtomicU64,
        full: AtomicBool,
        /// The query's bounds: what a sealed partition of this table pads to
        /// (`partition.rs`).
        max_key_bytes: u32,
        keys_per_device: u32,
    },
}

impl Table {
    pub fn new(query: &AnalyticsQuery) -> Self {
        let dense = |len: usize, tree: bool| Self::Dense {
            counts: (0..len).map(|_| AtomicU64::new(0)).collect(),
            tree,
        };
        match query {
            AnalyticsQuery::Histogram { domain_size, .. } => dense(*domain_size as usize, false),
            AnalyticsQuery::Quantiles { .. } => dense(tree_nodes(), true),
            AnalyticsQuery::OpenHistogram {
                max_key_bytes,
                keys_per_device,
            } => Self::Open {
                shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                keys: AtomicU64::new(0),
                full: AtomicBool::new(false),
                max_key_bytes: *max_key_bytes,
                keys_per_device: *keys_per_device,
            },
        }
    }

    /// Adds `value` to `key` (a checked answer's slot: inside the domain).
    pub fn add(&self, key: Key<'_>, value: u64) {
        match (self, key) {
            (Self::Dense { counts, tree, .. }, Key::Index(index)) => {
                if *tree {
                    // A leaf adds to its node on every level.
                    for level in 1..=QUANTILE_LEVELS {
                        let shift = 4 * (QUANTILE_LEVELS - level);
                        let node = level_start(level) + (index >> shift) as usize;
                        counts[node].fetch_add(value, Ordering::Relaxed);
                    }
                } else {
                    counts[index as usize].fetch_add(value, Ordering::Relaxed);
                }
            }
            (
                Self::Open {
                    shards,
                    hasher,
                    keys,
                    full,
                    ..
                },
                Key::Text(text),
            ) => {
                let shard = hasher.hash_one(text) as usize % SHARDS;
                let mut map = shards[shard].lock().expect("analytics table shard");
                if let Some(count) = map.get_mut(text) {
                    *count += value;
                } else if keys.fetch_add(1, Ordering::Relaxed) < MAX_OPEN_KEYS {
                    map.insert(text.into(), value);
                } else {
                    full.store(true, Ordering::Relaxed);
                }
            }
            // `Answer::read` gives index keys for dense queries and text keys for open ones.
            _ => {}
        }
    }

    /// The dense counts, in key (node) order.
    pub fn into_dense(self) -> Option<Vec<u64>> {
        match self {
            Self::Dense { counts, .. } => {
                Some(counts.into_iter().map(AtomicU64::into_inner).collect())
            }
            Self::Open { .. } => None,
        }
    }

    /// An open domain's keys and counts, sorted by key bytes, and whether the table filled.
    pub fn into_open(self) -> Option<(OpenCounts, bool)> {
        match self {
            Self::Open { shards, full, .. } => {
                let mut entries: OpenCounts = shards
                    .into_iter()
                    .flat_map(|shard| shard.into_inner().expect("analytics table shard"))
                    .collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                Some((entries, full.into_inner()))
            }
            Self::Dense { .. } => None,
        }
    }
}
