//! Records that were reserved but never made durable (a write or its fdatasync failed, e.g. on
//! a full disk): nothing refers to them (the caller writes its row only after a successful
//! put), but their bytes would stay in the segment until retention deletes it. A failed write
//! gives its bytes back at once: the segment is cut back when the record is its last one (no
//! record was reserved after it), and otherwise the range is punched out (it reads as zeros and
//! takes no space). What cannot be given back (a failed fdatasync poisons the log; the unsynced
//! records are left to retention with their segment) is counted.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::ContributionLog;

/// What became of an abandoned record's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reclaimed {
    /// The segment was cut back to the record's offset.
    Truncated,
    /// The range was punched out of the file.
    Punched,
    /// Left in place (counted): the file system refused both.
    Kept,
}

impl ContributionLog {
    /// Gives back the bytes of the record reserved at `offset` (`len` bytes) in `segment`,
    /// whose write failed.
    pub(super) fn abandon(&self, segment: u32, file: &File, offset: u64, len: u64) -> Reclaimed {
        let outcome = {
            let mut active = self.active.lock().unwrap_or_else(|e| e.into_inner());
            if active.segment == segment && active.end == offset + len {
                // Nothing was reserved after it: later records go where it was.
                match file.set_len(offset) {
                    Ok(()) => {
                        active.end = offset;
                        Reclaimed::Truncated
                    }
                    Err(_) => punch_hole(file, offset, len),
                }
            } else {
                punch_hole(file, offset, len)
            }
        };
        let how = match outcome {
            Reclaimed::Truncated => "truncated",
            Reclaimed::Punched => "punched",
            Reclaimed::Kept => "kept",
        };
        metrics::counter!("confed_contribution_log_abandoned_bytes_total", "reclaimed" => how)
            .increment(len);
        tracing::warn!(
            segment,
            offset,
            len,
            reclaimed = how,
            "contribution log: a record that failed to write was abandoned"
        );
        outcome
    }

    /// Counts the records of a failed fdatasync: they stay in their segment (the log refuses
    /// uploads until a restart, which starts a new segment) until retention deletes it.
    pub(super) fn count_unsynced(len: u64) {
        metrics::counter!("confed_contribution_log_abandoned_bytes_total", "reclaimed" => "kept")
            .increment(len);
    }
}

/// Frees `len` bytes at `offset` without changing the file's size.
fn punch_hole(file: &File, offset: u64, len: u64) -> Reclaimed {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Reclaimed::Kept;
    };
    // SAFETY: `fallocate` only reads its integer arguments; the descriptor belongs to `file`,
    // which is open for writing and outlives the call.
    let result = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
    };
    if result == 0 {
        Reclaimed::Punched
    } else {
        Reclaimed::Kept
    }
}
