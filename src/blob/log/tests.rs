use super::*;

fn key(name: &str) -> BlobKey {
    BlobKey::new(format!(
        "tenants/t/tasks/x/rounds/1-1/contributions/{name}.cbor"
    ))
    .unwrap()
}

fn segment_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn a_stored_contribution_reads_back_by_the_key_put_new_returned() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open(dir.path().join("log")).unwrap();
    let first = log.put_new(key("a"), b"first bytes").await.unwrap();
    let second = log.put_new(key("b"), b"second").await.unwrap();
    assert!(first.as_str().starts_with("log/00000001/0/"), "{first:?}");
    assert!(first.as_str().ends_with(key("a").as_str()));
    assert_ne!(first, second);
    assert_eq!(log.get(&first).await.unwrap(), b"first bytes");
    assert_eq!(log.get(&second).await.unwrap(), b"second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_puts_are_all_durable_and_distinct() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(ContributionLog::open(dir.path().join("log")).unwrap());
    let puts = (0..64u32).map(|i| {
        let log = Arc::clone(&log);
        tokio::spawn(async move {
            let bytes = vec![i as u8; 1000 + i as usize];
            (
                log.put_new(key(&format!("d{i}")), &bytes).await.unwrap(),
                bytes,
            )
        })
    });
    for put in puts {
        let (stored, bytes) = put.await.unwrap();
        assert_eq!(log.get(&stored).await.unwrap(), bytes);
    }
}

#[tokio::test]
async fn a_reopened_log_reads_old_records_and_appends_to_a_new_segment() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let stored = {
        let log = ContributionLog::open(&path).unwrap();
        log.put_new(key("a"), b"kept").await.unwrap()
    };
    // A torn record after the last acknowledged one, as a crash mid-write leaves it.
    let mut torn = OpenOptions::new()
        .append(true)
        .open(path.join("segment-00000001.log"))
        .unwrap();
    std::io::Write::write_all(&mut torn, b"CFL1\x10\x00").unwrap();
    let log = ContributionLog::open(&path).unwrap();
    assert_eq!(log.get(&stored).await.unwrap(), b"kept");
    let next = log.put_new(key("b"), b"new").await.unwrap();
    assert!(next.as_str().starts_with("log/00000002/0/"), "{next:?}");
    assert_eq!(
        segment_files(&path),
        ["LOCK", "segment-00000001.log", "segment-00000002.log"]
    );
    drop(log);
    // A restart without uploads reuses the empty last segment.
    drop(ContributionLog::open(&path).unwrap());
    let _again = ContributionLog::open(&path).unwrap();
    assert_eq!(segment_files(&path).len(), 4, "three segments and LOCK");
    let second = ContributionLog::open(&path).unwrap_err();
    assert!(second.to_string().contains("another process"), "{second}");
}

#[tokio::test]
async fn a_full_segment_moves_on_to_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let log = ContributionLog::open_with_segment_bytes(path.clone(), 300).unwrap();
    let stored: Vec<BlobKey> = futures_util::future::join_all(
        (0..3).map(|i| log.put_new(key(&format!("k{i}")), &[7u8; 200])),
    )
    .await
    .into_iter()
    .map(Result::unwrap)
    .collect();
    assert_eq!(segment_files(&path).len(), 4, "three segments and LOCK");
    for key in &stored {
        assert_eq!(log.get(key).await.unwrap(), [7u8; 200]);
    }
}

#[tokio::test]
async fn a_corrupted_record_is_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log");
    let log = ContributionLog::open(&path).unwrap();
    let stored = log.put_new(key("a"), b"payload").await.unwrap();
    let segment = path.join("segment-00000001.log");
    let mut bytes = fs::read(&segment).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    fs::write(&segment, bytes).unwrap();
    drop(log);
    let log = ContributionLog::open(&path).unwrap();
    let error = log.get(&stored).await.unwrap_err().to_string();
    assert!(error.contains("do not match its digest"), "{error}");
    // A reader that authenticates the bytes itself (the enclave's AEAD) gets them unhashed,
    // corruption included: its tag check refuses them.
    assert_eq!(log.get_sealed(&stored).await.unwrap(), b"payloae");
}

#[tokio::test]
async fn a_key_pointing_at_another_record_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open(dir.path().join("log")).unwrap();
    let stored = log.put_new(key("a"), b"payload").await.unwrap();
    let forged = BlobKey::new(stored.as_str().replace("/a.cbor", "/b.cbor")).unwrap();
    let error = log.get(&forged).await.unwrap_err().to_string();
    assert!(error.contains("belongs to another object"), "{error}");
    let error = log.get_sealed(&forged).await.unwrap_err().to_string();
    assert!(error.contains("belongs to another object"), "{error}");
    let nowhere = BlobKey::new(format!("log/00000001/5/{}/{}", 60, key("a").as_str())).unwrap();
    assert!(log.get(&nowhere).await.is_err());
    // A key claiming a huge record at a real record's offset: refused before any buffer is
    // sized for it, on the blocking reader too.
    let offset = stored.as_str().split('/').nth(2).unwrap();
    let huge = format!(
        "log/00000001/{offset}/{}/{}",
        usize::MAX / 2,
        key("a").as_str()
    );
    let huge = BlobKey::new(huge).unwrap();
    let error = log.get_sealed(&huge).await.unwrap_err().to_string();
    assert!(error.contains("not of the key's length"), "{error}");
    let reader = log.sealed_reader().unwrap();
    let error = reader
        .get_sealed_into(&huge, Vec::new())
        .unwrap_err()
        .to_string();
    assert!(error.contains("not of the key's length"), "{error}");
    let missing_segment =
        BlobKey::new(stored.as_str().replacen("00000001", "00000009", 1)).unwrap();
    assert!(matches!(
        log.get(&missing_segment).await,
        Err(BlobError::NotFound(_))
    ));
}

#[tokio::test]
async fn a_key_that_is_not_a_log_key_is_not_found_and_keyed_puts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open(dir.path().join("log")).unwrap();
    assert!(matches!(
        log.get(&key("old")).await,
        Err(BlobError::NotFound(found)) if found == key("old").as_str()
    ));
    let refused = log.put(&key("x"), b"x").await.unwrap_err().to_string();
    assert!(refused.contains("put_new"), "{refused}");
}

/// Every segment ever read stayed open (open files grew ~144 an hour); the cache is bounded.
#[tokio::test]
async fn open_segment_readers_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open_with_segment_bytes(dir.path().join("log"), 64).unwrap();
    let mut stored = Vec::new();
    for i in 0..40u32 {
        stored.push(
            log.put_new(key(&format!("s{i}")), &[i as u8; 100])
                .await
                .unwrap(),
        );
    }
    for (i, key) in stored.iter().enumerate() {
        assert_eq!(log.get(key).await.unwrap(), vec![i as u8; 100]);
    }
    let segments = segment_files(&dir.path().join("log"))
        .iter()
        .filter(|n| n.starts_with("segment-"))
        .count();
    assert!(segments >= 40, "{segments} segments");
    assert!(log.readers.open_files() <= MAX_OPEN_READERS);
    // The least recently used went first: the newest still read without reopening.
    assert_eq!(log.get(&stored[39]).await.unwrap(), vec![39u8; 100]);
}

/// Retention deletes only segments below the oldest one a row names, never the active one, and
/// never one written within `idle` (its record's row may be about to commit).
#[tokio::test]
async fn retired_segments_are_old_unreferenced_and_idle() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open_with_segment_bytes(dir.path().join("log"), 64).unwrap();
    let mut stored = Vec::new();
    for i in 0..4u32 {
        stored.push(
            log.put_new(key(&format!("r{i}")), &[i as u8; 100])
                .await
                .unwrap(),
        );
    }
    let count = || {
        segment_files(&dir.path().join("log"))
            .iter()
            .filter(|n| n.starts_with("segment-"))
            .count()
    };
    assert_eq!(count(), 4);
    let hour = std::time::Duration::from_secs(3600);
    assert_eq!(
        log.retire_unreferenced(None, hour).await.unwrap(),
        0,
        "all written just now"
    );
    let oldest = stored[2].as_str();
    let zero = std::time::Duration::ZERO;
    assert_eq!(
        log.retire_unreferenced(Some(oldest), zero).await.unwrap(),
        2
    );
    assert!(log.get(&stored[0]).await.is_err());
    assert_eq!(log.get(&stored[2]).await.unwrap(), vec![2u8; 100]);
    assert_eq!(
        log.retire_unreferenced(None, zero).await.unwrap(),
        1,
        "all but the active"
    );
    assert_eq!(log.get(&stored[3]).await.unwrap(), vec![3u8; 100]);
}

/// A disk that fills halfway through a record: the put fails as a full disk (507 upstream), and
/// the torn bytes do not stay: the segment is cut back, and the next record goes where it was.
#[tokio::test]
async fn a_record_torn_by_a_full_disk_is_cut_back_and_its_place_reused() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open(dir.path().join("log")).unwrap();
    let first = log.put_new(key("a"), b"first").await.unwrap();
    let segment = dir.path().join("log").join(segment_name(1));
    let before = fs::metadata(&segment).unwrap().len();
    log.fail_writes
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = log.put_new(key("b"), &[7u8; 5000]).await.unwrap_err();
    assert!(
        matches!(&failed, BlobError::Io { source, .. } if crate::blob::is_disk_full(source)),
        "{failed:?}"
    );
    assert_eq!(
        fs::metadata(&segment).unwrap().len(),
        before,
        "the torn record's bytes are gone"
    );
    let next = log.put_new(key("c"), b"after").await.unwrap();
    assert!(
        next.as_str()
            .starts_with(&format!("log/00000001/{before}/")),
        "{next:?}"
    );
    assert_eq!(log.get(&first).await.unwrap(), b"first");
    assert_eq!(log.get(&next).await.unwrap(), b"after");
}

/// A torn record with a later record already reserved after it: its range is punched out (it
/// reads as zeros and takes no space) and the later record is intact.
#[tokio::test]
async fn a_torn_record_before_a_later_one_is_punched_out() {
    let dir = tempfile::tempdir().unwrap();
    let log = ContributionLog::open(dir.path().join("log")).unwrap();
    let (segment, file, offset) = log.reserve(1 << 20).unwrap();
    let later = log.put_new(key("later"), b"later bytes").await.unwrap();
    file.write_all_at(&vec![0xAB; 1 << 19], offset).unwrap();
    let outcome = log.abandon(segment, &file, offset, 1 << 20);
    assert_ne!(
        outcome,
        reclaim::Reclaimed::Truncated,
        "a record follows it"
    );
    if outcome == reclaim::Reclaimed::Punched {
        let mut torn = vec![1u8; 1 << 19];
        file.read_exact_at(&mut torn, offset).unwrap();
        assert!(torn.iter().all(|&b| b == 0), "the torn bytes are gone");
    }
    assert_eq!(log.get(&later).await.unwrap(), b"later bytes");
}

/// One server per data directory: a second log on the directory is refused while the first is
/// open (the lock is the file's, `File::try_lock`), and opens once the first is dropped.
#[test]
fn a_second_log_on_the_same_directory_is_refused_until_the_first_closes() {
    let dir = tempfile::tempdir().unwrap();
    let first = ContributionLog::open(dir.path().join("log")).unwrap();
    let Err(refused) = ContributionLog::open(dir.path().join("log")) else {
        panic!("a second log opened while the first holds the lock");
    };
    assert!(
        refused
            .to_string()
            .contains("run one confed server per data directory"),
        "{refused}"
    );
    drop(first);
    ContributionLog::open(dir.path().join("log")).unwrap();
}
