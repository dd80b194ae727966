//! The rounds a key service holds prepared (`unmask_prepare.rs`): each round's running mask
//! sums and the inputs in them, behind a lock of its own, so a sums request waits only for a
//! batch of its own round under way, never for another round's.
//!
//! Bounded three ways: at most `MAX_PREPARED_BYTES` estimated (sums, seeds, the entries
//! themselves), at most `MAX_PREPARED_ROUNDS` rounds, the least recently used dropped first; and
//! a task's earlier rounds are dropped when a later one of it is prepared (rounds of a task run
//! one after another: an earlier one that was not unmasked by then never will be). A dropped
//! round's sums are simply computed in full.

use std::collections::HashMap;
use std::sync::Arc;

use confed_attestation::unmask_api::MaskedInput;
use confed_protocol::masking::{MaskSums, SEED_BYTES, Seed};
use sha2::Digest as _;

/// Most bytes of prepared rounds one service holds (running sums and opened seeds).
pub const MAX_PREPARED_BYTES: usize = 256 * 1024 * 1024;
/// Most rounds one service holds prepared.
pub const MAX_PREPARED_ROUNDS: usize = 1_024;
/// What one held input costs besides its seeds, over-estimated: its ref (64 bytes on the heap),
/// digest, the map's entry at its load factor and the allocator's headers.
pub(crate) const INPUT_OVERHEAD_BYTES: usize = 320;
/// What one held seed costs: its group, the seed, alignment and the vector's rounding.
pub(crate) const HELD_SEED_BYTES: usize = 2 * SEED_BYTES;
/// What one held round costs besides its sums and inputs: its key's strings, the map entries,
/// the lock and the vectors' headers.
const ROUND_OVERHEAD_BYTES: usize = 1_024;

/// Which preparation a sums request may use: the same key, round, policy and length.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct RoundKey {
    pub(crate) key_id: String,
    pub(crate) task_id: String,
    pub(crate) round: u64,
    /// `TaskPolicy::sha256_hex`, which the seeds' context names.
    pub(crate) policy_sha256: String,
    pub(crate) values: usize,
}

/// One input added ahead: the digest of its bytes as a sums request names it, and its opened
/// seeds (for the noise key, or to subtract it).
pub(crate) struct PreparedInput {
    pub(crate) digest: [u8; 32],
    pub(crate) seeds: Vec<(usize, Seed)>,
}

/// A round's running sums and the inputs in them, by ref.
pub(crate) struct PreparedRound {
    pub(crate) sums: MaskSums,
    pub(crate) inputs: HashMap<String, PreparedInput>,
}

impl PreparedRound {
    /// The estimate of what the round holds (over, not under: tests/memory_bounds.rs style).
    pub(crate) fn bytes(&self) -> usize {
        ROUND_OVERHEAD_BYTES + self.sums_bytes() + self.inputs.len() * self.input_bytes()
    }

    pub(crate) fn sums_bytes(&self) -> usize {
        let values = self.sums.sums.first().map_or(0, |(_, sum)| sum.len());
        self.sums.sums.len() * values * 8
    }

    pub(crate) fn input_bytes(&self) -> usize {
        INPUT_OVERHEAD_BYTES + self.sums.sums.len() * HELD_SEED_BYTES
    }
}

/// The digest a prepared input is matched by: SHA-256 of the input as the sums request names
/// it (JSON). Equal digests are equal inputs; an input sent with other bytes is computed anew.
pub(crate) fn input_digest(input: &MaskedInput) -> [u8; 32] {
    let bytes = serde_json::to_vec(input).expect("a struct of strings always serializes");
    sha2::Sha256::digest(bytes).into()
}

/// A round's place: open (empty until a batch adds to it), then taken by the round's first sums
/// computation, after which no batch adds to it.
pub(crate) enum Cell {
    Open(Option<PreparedRound>),
    Taken,
}

/// A round's cell, behind a lock of its own (a batch holds it while it adds, a sums request
/// while it waits for the sums queue).
pub(crate) type RoundCell = Arc<tokio::sync::Mutex<Cell>>;

fn open_cell() -> RoundCell {
    Arc::new(tokio::sync::Mutex::new(Cell::Open(None)))
}

struct Held {
    used: u64,
    bytes: usize,
    cell: RoundCell,
}

/// The rounds a service holds prepared, least recently used first to go.
pub struct PreparedRounds {
    rounds: HashMap<RoundKey, Held>,
    uses: u64,
    bytes: usize,
    limit: usize,
    max_rounds: usize,
}

impl Default for PreparedRounds {
    fn default() -> Self {
        Self {
            rounds: HashMap::new(),
            uses: 0,
            bytes: 0,
            limit: MAX_PREPARED_BYTES,
            max_rounds: MAX_PREPARED_ROUNDS,
        }
    }
}

impl std::fmt::Debug for PreparedRounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedRounds")
            .field("rounds", &self.rounds.len())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl PreparedRounds {
    /// Most bytes held in all, and so by one round.
    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// `key`'s round's cell, marked as just used. A new round is counted at once at the size
    /// of its empty sums (`sums_bytes`), and room made for it, before a batch allocates them;
    /// `settle` corrects the count.
    pub(crate) fn cell(&mut self, key: &RoundKey, sums_bytes: usize) -> RoundCell {
        self.uses += 1;
        let used = self.uses;
        if let Some(held) = self.rounds.get_mut(key) {
            held.used = used;
            return held.cell.clone();
        }
        let bytes = ROUND_OVERHEAD_BYTES + sums_bytes;
        let cell = open_cell();
        self.rounds.insert(
            key.clone(),
            Held {
                used,
                bytes,
                cell: cell.clone(),
            },
        );
        self.bytes += bytes;
        self.keep_within(key);
        cell
    }

    /// `key`'s round's cell if it has one, left in place.
    pub(crate) fn cell_of(&self, key: &RoundKey) -> Option<RoundCell> {
        self.rounds.get(key).map(|held| held.cell.clone())
    }

    /// Records that `key`'s round, if `cell` is still its cell, now holds `bytes` (0: nothing,
    /// and it is forgotten). A round that holds something drops the task's earlier rounds under
    /// the same key and policy, then the least recently used others while over the limits.
    pub(crate) fn settle(&mut self, key: &RoundKey, cell: &RoundCell, bytes: usize) {
        let Some(held) = self.rounds.get_mut(key) else {
            return;
        };
        if !Arc::ptr_eq(&held.cell, cell) {
            return;
        }
        self.bytes = self.bytes - held.bytes + bytes;
        held.bytes = bytes;
        if bytes == 0 {
            self.remove(key);
            return;
        }
        let earlier: Vec<RoundKey> = self
            .rounds
            .keys()
            .filter(|k| {
                (&k.key_id, &k.task_id, &k.policy_sha256)
                    == (&key.key_id, &key.task_id, &key.policy_sha256)
                    && k.round < key.round
            })
            .cloned()
            .collect();
        for earlier in earlier {
            self.remove(&earlier);
        }
        self.keep_within(key);
    }

    /// Forgets `key`'s round and every other preparation of the same key and round (under
    /// another policy or length: no sums request of this round can use them now).
    pub(crate) fn forget_round(&mut self, key: &RoundKey) {
        let same_round: Vec<RoundKey> = self
            .rounds
            .keys()
            .filter(|k| (&k.key_id, &k.task_id, k.round) == (&key.key_id, &key.task_id, key.round))
            .cloned()
            .collect();
        for other in same_round {
            self.remove(&other);
        }
    }

    fn remove(&mut self, key: &RoundKey) {
        if let Some(held) = self.rounds.remove(key) {
            self.bytes -= held.bytes;
        }
    }

    /// Drops the least recently used rounds but `keep` while over the limits.
    fn keep_within(&mut self, keep: &RoundKey) {
        while self.bytes > self.limit || self.rounds.len() > self.max_rounds {
            let Some(oldest) = self
                .rounds
                .iter()
                .filter(|(key, _)| *key != keep)
                .min_by_key(|(_, held)| held.used)
                .map(|(key, _)| key.clone())
            else {
                break;
            };
            tracing::info!(task = %oldest.task_id, round = oldest.round, "a prepared round dropped to make room: its sums will be computed in full");
            self.remove(&oldest);
        }
    }

    #[cfg(test)]
    fn held(&self, key: &RoundKey) -> bool {
        self.rounds.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_protocol::masking::Layout;

    fn key(task: &str, round: u64, values: usize) -> RoundKey {
        RoundKey {
            key_id: "k".into(),
            task_id: task.into(),
            round,
            policy_sha256: "p".into(),
            values,
        }
    }

    fn round_of(values: usize, inputs: usize) -> PreparedRound {
        let layout = Layout::new(3, 2).unwrap();
        PreparedRound {
            sums: MaskSums::new(&layout, 1, values).unwrap(),
            inputs: (0..inputs)
                .map(|i| {
                    let input = PreparedInput {
                        digest: [0; 32],
                        seeds: vec![(0, Seed::random())],
                    };
                    (format!("{i:064x}"), input)
                })
                .collect(),
        }
    }

    /// Puts `round` under `key` as a batch would.
    fn put(rounds: &mut PreparedRounds, key: &RoundKey, round: PreparedRound) {
        let cell = rounds.cell(key, round.sums_bytes());
        let bytes = round.bytes();
        *cell.try_lock().unwrap() = Cell::Open(Some(round));
        rounds.settle(key, &cell, bytes);
    }

    /// Past the byte limit the least recently used round goes first; taking a round forgets
    /// the round's other preparations too; a round settled empty is forgotten.
    #[test]
    fn prepared_rounds_keep_within_their_limit_least_recently_used_first() {
        let one = round_of(1_000, 10).bytes();
        let mut rounds = PreparedRounds {
            limit: 2 * one + one / 2,
            ..PreparedRounds::default()
        };
        put(&mut rounds, &key("a", 1, 1_000), round_of(1_000, 10));
        put(&mut rounds, &key("b", 1, 1_000), round_of(1_000, 10));
        // "a" used again: "b" is now the least recently used.
        rounds.cell(&key("a", 1, 1_000), 8_000);
        // A batch that adds nothing leaves the others as they were.
        let nothing = rounds.cell(&key("z", 1, 10), 80);
        rounds.settle(&key("z", 1, 10), &nothing, 0);
        assert!(rounds.held(&key("b", 1, 1_000)));
        put(&mut rounds, &key("c", 1, 1_000), round_of(1_000, 10));
        assert!(rounds.bytes <= rounds.limit);
        assert!(!rounds.held(&key("b", 1, 1_000)), "b was dropped");
        assert!(rounds.held(&key("a", 1, 1_000)) && rounds.held(&key("c", 1, 1_000)));

        // Another length of round "c": forgetting the round forgets both.
        put(&mut rounds, &key("c", 1, 10), round_of(10, 1));
        assert!(rounds.cell_of(&key("c", 1, 1_000)).is_some());
        rounds.forget_round(&key("c", 1, 1_000));
        assert!(!rounds.held(&key("c", 1, 10)) && !rounds.held(&key("c", 1, 1_000)));
        assert_eq!(rounds.rounds.len(), 1);
        assert_eq!(rounds.bytes, one);

        // A batch that added nothing leaves nothing behind.
        let empty = rounds.cell(&key("d", 1, 1_000), 8_000);
        rounds.settle(&key("d", 1, 1_000), &empty, 0);
        assert!(!rounds.held(&key("d", 1, 1_000)));
        assert_eq!(rounds.bytes, one);
    }

    /// A new round is counted at its empty sums' size before any batch allocates them, making
    /// room at once: the held bytes never pass the limit while a batch runs.
    #[test]
    fn a_new_round_is_counted_before_its_sums_are_allocated() {
        let one = round_of(1_000, 10).bytes();
        let mut rounds = PreparedRounds {
            limit: 2 * one,
            ..PreparedRounds::default()
        };
        put(&mut rounds, &key("a", 1, 1_000), round_of(1_000, 10));
        put(&mut rounds, &key("b", 1, 1_000), round_of(1_000, 10));
        let big = key("big", 1, 1_500);
        let _cell = rounds.cell(&big, round_of(1_500, 0).sums_bytes());
        assert!(rounds.bytes <= rounds.limit);
        assert!(!rounds.held(&key("a", 1, 1_000)), "room made at once");
        assert!(rounds.held(&big));
    }

    /// A task's later round under the same policy drops its earlier ones (under another
    /// policy, as anyone may prepare, it does not); at most `max_rounds` rounds are held.
    #[test]
    fn a_later_round_of_a_task_drops_its_earlier_ones_and_rounds_are_counted() {
        let mut rounds = PreparedRounds {
            max_rounds: 3,
            ..PreparedRounds::default()
        };
        put(&mut rounds, &key("a", 1, 10), round_of(10, 1));
        let elsewhere = RoundKey {
            policy_sha256: "another".into(),
            ..key("a", 5, 10)
        };
        put(&mut rounds, &elsewhere, round_of(10, 1));
        assert!(rounds.held(&key("a", 1, 10)));
        rounds.forget_round(&elsewhere);
        put(&mut rounds, &key("a", 2, 10), round_of(10, 1));
        assert!(!rounds.held(&key("a", 1, 10)));
        for task in ["b", "c", "d"] {
            put(&mut rounds, &key(task, 1, 10), round_of(10, 1));
        }
        assert_eq!(rounds.rounds.len(), 3);
        assert!(!rounds.held(&key("a", 2, 10)), "the least recently used");
        let held: usize = rounds.rounds.values().map(|h| h.bytes).sum();
        assert_eq!(rounds.bytes, held);
    }

    /// The estimate counts every value of every group, every held input and the round itself.
    #[test]
    fn a_prepared_rounds_bytes_grow_with_values_and_inputs() {
        assert_eq!(round_of(0, 0).bytes(), ROUND_OVERHEAD_BYTES);
        assert_eq!(round_of(1_000, 0).bytes(), ROUND_OVERHEAD_BYTES + 8_000);
        assert_eq!(
            round_of(1_000, 3).bytes(),
            ROUND_OVERHEAD_BYTES + 8_000 + 3 * (INPUT_OVERHEAD_BYTES + HELD_SEED_BYTES)
        );
    }
}
