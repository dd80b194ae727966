//! Reading a log's records for a peer, and checking that a newer head extends an older one:
//! what lets a witness move its kept head forward only along the same history (a restored log
//! that grows past the kept head on another history is a fork, not an extension).

use std::io::{BufRead, Seek, SeekFrom};
use std::path::Path;

use super::{LostHead, Record, SignedHead};

/// Records `from..` (at most `max`) of the log at `path`, reading from byte `start` where record
/// `start_seq` begins (`(0, 0)`: the file's start).
pub fn read_records(
    path: &Path,
    (start_seq, start): (u64, u64),
    from: u64,
    max: usize,
) -> std::io::Result<Vec<Record>> {
    let mut file = std::fs::File::open(path)?;
    file.seek(SeekFrom::Start(start))?;
    let mut reader = std::io::BufReader::new(file);
    let mut records = Vec::new();
    let mut line = Vec::new();
    let mut seq = start_seq;
    while records.len() < max {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 || line.last() != Some(&b'\n') {
            break;
        }
        if seq >= from {
            let record: Record = serde_json::from_slice(&line).map_err(std::io::Error::other)?;
            if record.seq != seq {
                return Err(std::io::Error::other(format!(
                    "record {seq} of the log says seq {}",
                    record.seq
                )));
            }
            records.push(record);
        }
        seq += 1;
    }
    Ok(records)
}

/// The `loss_acknowledged` record of the log at `path` that names exactly `lost`, if any.
pub fn find_acknowledgement(path: &Path, lost: &LostHead) -> std::io::Result<Option<Record>> {
    let reader = std::io::BufReader::new(std::fs::File::open(path)?);
    for line in reader.lines() {
        let line = line?;
        // Cheap filter before parsing: acknowledgements are rare.
        if !line.contains("\"acknowledged_loss\"") {
            continue;
        }
        let record: Record = serde_json::from_str(&line).map_err(std::io::Error::other)?;
        if record.decision.acknowledged_loss.as_ref() == Some(lost) {
            return Ok(Some(record));
        }
    }
    Ok(None)
}

/// The signed head a record ends.
pub fn head_of(keyservice_id: &str, record: &Record) -> SignedHead {
    SignedHead {
        keyservice_id: keyservice_id.to_string(),
        records: record.seq + 1,
        hash: record.hash.clone(),
        signature: record.signature.clone(),
    }
}
