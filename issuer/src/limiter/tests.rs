use super::*;

const DAY: i64 = 86_400;

#[test]
fn a_device_gets_at_most_l_tokens_per_window_and_a_fresh_allowance_in_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
    let (alice, bob) = ([1u8; 32], [2u8; 32]);
    let grant = limiter.take(&alice, 3, || Seconds(10)).unwrap().unwrap();
    assert_eq!(grant.remaining, 2);
    assert_eq!(grant.window_ends_at, Seconds(DAY));
    assert_eq!(
        limiter.take(&alice, 3, || Seconds(20)).unwrap(),
        Err(Exhausted {
            remaining: 2,
            window_ends_at: Seconds(DAY)
        })
    );
    assert_eq!(
        limiter
            .take(&alice, 2, || Seconds(30))
            .unwrap()
            .unwrap()
            .remaining,
        0
    );
    assert_eq!(
        limiter
            .take(&bob, 5, || Seconds(30))
            .unwrap()
            .unwrap()
            .remaining,
        0
    );
    // The next window: a fresh allowance, and the past window's file is gone.
    assert_eq!(
        limiter
            .take(&alice, 5, || Seconds(DAY))
            .unwrap()
            .unwrap()
            .remaining,
        0
    );
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("window-"))
        .collect();
    assert_eq!(files, vec![format!("window-{DAY}-1.log")]);
}

#[test]
fn grants_survive_a_restart_and_a_torn_last_record_is_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let alice = [1u8; 32];
    {
        let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        limiter.take(&alice, 4, || Seconds(10)).unwrap().unwrap();
    }
    let path = dir.path().join(format!("window-{DAY}-0.log"));
    // A crash in the middle of the next append.
    let mut file = OpenOptions::new().append(true).open(&path).unwrap();
    file.write_all(&[7u8; 17]).unwrap();
    drop(file);
    let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
    assert_eq!(
        limiter.take(&alice, 2, || Seconds(11)).unwrap(),
        Err(Exhausted {
            remaining: 1,
            window_ends_at: Seconds(DAY)
        })
    );
    assert_eq!(
        limiter
            .take(&alice, 1, || Seconds(12))
            .unwrap()
            .unwrap()
            .remaining,
        0
    );
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        2 * RECORD_BYTES as u64
    );
}

#[test]
fn a_damaged_record_before_others_refuses_the_start_and_nothing_names_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let identity = [9u8; 32];
    {
        let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
        limiter.take(&identity, 1, || Seconds(10)).unwrap().unwrap();
        limiter
            .take(&[3u8; 32], 1, || Seconds(10))
            .unwrap()
            .unwrap();
    }
    let path = dir.path().join(format!("window-{DAY}-0.log"));
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(!bytes.windows(32).any(|w| w == identity));
    bytes[33] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
    assert!(matches!(
        limiter.take(&identity, 1, || Seconds(11)),
        Err(LimiterError::Damaged { record: 0, .. })
    ));
}

#[test]
fn a_request_stamped_before_the_rollover_counts_in_the_new_window_and_empties_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let limiter = Limiter::open(dir.path(), 3, DAY).unwrap();
    let device = [5u8; 32];
    limiter
        .take(&device, 3, || Seconds(DAY + 1))
        .unwrap()
        .unwrap();
    // A request read the clock just before midnight and got the lock after this one, or
    // the clock stepped back: it counts in the current window, whose count holds.
    assert_eq!(
        limiter.take(&device, 1, || Seconds(DAY - 1)).unwrap(),
        Err(Exhausted {
            remaining: 0,
            window_ends_at: Seconds(2 * DAY)
        })
    );
    assert_eq!(
        limiter.take(&device, 1, || Seconds(DAY + 2)).unwrap(),
        Err(Exhausted {
            remaining: 0,
            window_ends_at: Seconds(2 * DAY)
        })
    );
    assert!(dir.path().join(format!("window-{DAY}-1.log")).exists());
}

#[test]
fn a_second_limiter_on_the_same_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = Limiter::open(dir.path(), 3, DAY).unwrap();
    assert!(matches!(
        Limiter::open(dir.path(), 3, DAY),
        Err(LimiterError::Locked(_))
    ));
    drop(first);
    Limiter::open(dir.path(), 3, DAY).unwrap();
}

#[test]
fn window_file_names_give_their_index() {
    assert_eq!(window_index("window-86400-20424.log"), Some(20424));
    assert_eq!(window_index("window-60--3.log"), Some(-3));
    assert_eq!(window_index("limiter.key"), None);
}

#[test]
fn the_same_device_has_unrelated_rate_keys_in_different_windows_and_issuers() {
    let dir = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
    let second = Limiter::open(other.path(), 5, DAY).unwrap();
    let identity = [4u8; 32];
    assert_ne!(
        limiter.rate_key(0, &identity),
        limiter.rate_key(1, &identity)
    );
    assert_ne!(
        limiter.rate_key(0, &identity),
        second.rate_key(0, &identity)
    );
    // The key persists: the same issuer names the device the same way after a restart.
    let before = limiter.rate_key(0, &identity);
    drop(limiter);
    let reopened = Limiter::open(dir.path(), 5, DAY).unwrap();
    assert_eq!(before, reopened.rate_key(0, &identity));
}

#[test]
fn concurrent_requests_of_one_device_get_exactly_l_tokens_between_them() {
    let dir = tempfile::tempdir().unwrap();
    let limiter = Limiter::open(dir.path(), 5, DAY).unwrap();
    let device = [6u8; 32];
    let granted: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| limiter.take(&device, 1, || Seconds(10)).unwrap().is_ok()))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap() as usize)
            .sum()
    });
    assert_eq!(granted, 5);
    drop(limiter);
    let reopened = Limiter::open(dir.path(), 5, DAY).unwrap();
    assert_eq!(
        reopened.take(&device, 1, || Seconds(11)).unwrap(),
        Err(Exhausted {
            remaining: 0,
            window_ends_at: Seconds(DAY)
        })
    );
}

/// (Whether concurrent grants share syncs is measured by `cargo bench -p confed-issuer --bench
/// issuance`, which prints syncs a grant; a test cannot force the overlap without sleeping.)
#[test]
fn every_grant_answered_under_concurrency_is_in_the_file_and_no_grant_costs_two_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let limiter = Limiter::open(dir.path(), 3, DAY).unwrap();
    const THREADS: u8 = 8;
    const PER_THREAD: u8 = 25;
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let limiter = &limiter;
            scope.spawn(move || {
                for i in 0..PER_THREAD {
                    let mut device = [0u8; 32];
                    device[0] = thread;
                    device[1] = i;
                    limiter.take(&device, 2, || Seconds(10)).unwrap().unwrap();
                }
            });
        }
    });
    let grants = u64::from(THREADS) * u64::from(PER_THREAD);
    assert!(limiter.syncs() >= 1 && limiter.syncs() <= grants);
    drop(limiter);
    let path = dir.path().join(format!("window-{DAY}-0.log"));
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        grants * RECORD_BYTES as u64
    );
    let reopened = Limiter::open(dir.path(), 3, DAY).unwrap();
    for thread in 0..THREADS {
        let mut device = [0u8; 32];
        device[0] = thread;
        device[1] = PER_THREAD - 1;
        assert_eq!(
            reopened
                .take(&device, 1, || Seconds(11))
                .unwrap()
                .unwrap()
                .remaining,
            0
        );
    }
}
