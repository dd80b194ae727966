#![allow(
    clippy::unwrap_used,
    reason = "a panic is a benchmark's failure report"
)]
//! A key service's start on a long audit log (`cargo bench -p confed-keyservice --bench
//! audit_start`): 200,000 signed records written as the service writes them (a checkpoint every
//! 1,000), then the start from the checkpoint (the prefix hashed against the digest the checkpoint
//! signed, the tail verified and replayed) and the start that verifies every record (what a
//! missing checkpoint, or `audit verify`, costs). The log is written on /dev/shm when it exists, so
//! building it is not bound by fsync; the starts read it from the page cache either way.

use std::sync::Arc;
use std::time::Instant;

mod support;

use confed_keyservice::audit::AuditLog;
use confed_keyservice::ledger::Ledger;

const RECORDS: u64 = 200_000;

fn main() {
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let path = dir.path().join("audit.jsonl");
    let key = Arc::new(confed_attestation::exchange::generate_signing_key());
    let started = Instant::now();
    {
        let mut ledger = Ledger::default();
        let (mut log, _) =
            AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut ledger).unwrap();
        for n in 0..RECORDS {
            log.append(support::refusal(n, 1_800_000_000 + n as i64))
                .unwrap();
            if log.head().records % 1000 == 0 {
                log.checkpoint(&ledger);
            }
        }
    }
    let bytes = std::fs::metadata(&path).unwrap().len();
    println!(
        "log of {RECORDS} signed records, {:.0} MB, written in {:.1} s",
        bytes as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    let start = |checkpoint: bool| {
        let started = Instant::now();
        let mut ledger = Ledger::default();
        if checkpoint {
            AuditLog::open_checkpointed(&path, "ks1", key.clone(), &mut ledger).unwrap();
        } else {
            AuditLog::open_ignoring_checkpoint(&path, "ks1", key.clone(), &mut ledger).unwrap();
        }
        started.elapsed().as_secs_f64()
    };
    start(true); // warm the page cache
    let with = (0..3).map(|_| start(true)).fold(f64::MAX, f64::min);
    println!("start from the checkpoint (prefix digest checked, tail verified): {with:.3} s");
    let all = start(false);
    println!("start verifying every record (no checkpoint): {all:.2} s");
}
