//! Scans of envelopes as stored: the fields equal a full parse's, from a head and at most one
//! tail of a few KiB, whatever the order of the keys; anything else refused, never a panic.

use super::*;
use crate::envelope::{Envelope, EnvelopeRef};

fn envelope(ciphertext: usize, token: bool, chunk: Option<u32>) -> Envelope {
    Envelope {
        key_id: "key-1".into(),
        encapsulated_key: vec![7; 32],
        ciphertext: vec![9; ciphertext],
        chunk,
        token: token.then(|| vec![5; privacy_pass::TOKEN_BYTES]),
        seeds: None,
    }
}

/// Scans `bytes` as the front end does: its head, then its tail if asked.
fn scanned(bytes: &[u8]) -> Result<EnvelopeHeader, EnvelopeError> {
    let total = bytes.len() as u64;
    let head = &bytes[..total.min(HEAD_BYTES) as usize];
    match scan(head, total)? {
        Scan::Header(header) => Ok(header),
        Scan::NeedTail { at } => scan_with_tail(head, at, &bytes[at as usize..], total),
    }
}

fn same_as_parse(bytes: &[u8], header: &EnvelopeHeader) {
    let full = EnvelopeRef::parse(bytes).unwrap();
    assert_eq!(header.key_id, full.key_id);
    assert_eq!(header.encapsulated_key, full.encapsulated_key);
    assert_eq!(header.chunk, full.chunk);
    assert_eq!(header.token.as_deref(), full.token);
    assert_eq!(header.seeds.as_deref(), full.seeds);
    let (start, length) = header.ciphertext;
    assert_eq!(
        &bytes[start as usize..(start + length) as usize],
        full.ciphertext
    );
}

#[test]
fn a_token_after_a_megabyte_of_ciphertext_is_read_from_the_tail() {
    let bytes = envelope(1 << 20, true, None).to_cbor();
    let total = bytes.len() as u64;
    let Scan::NeedTail { at } = scan(&bytes[..HEAD_BYTES as usize], total).unwrap() else {
        panic!("the token follows the ciphertext");
    };
    assert!(
        total - at < 400,
        "only the fields after the ciphertext: {}",
        total - at
    );
    let header = scanned(&bytes).unwrap();
    assert_eq!(header.token, Some(vec![5; privacy_pass::TOKEN_BYTES]));
    same_as_parse(&bytes, &header);
}

#[test]
fn a_masked_envelopes_seeds_after_the_ciphertext_are_read_from_the_tail_and_bounded() {
    // 3-of-7's sealed seeds, the longest a layout makes (3,696 bytes), after the token.
    let mut masked = envelope(1 << 20, true, None);
    masked.seeds = Some(vec![3; 3_696]);
    let bytes = masked.to_cbor();
    let header = scanned(&bytes).unwrap();
    assert_eq!(header.seeds.as_deref().map(<[u8]>::len), Some(3_696));
    same_as_parse(&bytes, &header);
    for bad in [
        Vec::new(),
        vec![3; crate::masking::MAX_ENVELOPE_SEEDS_BYTES + 1],
    ] {
        masked.seeds = Some(bad);
        let bytes = masked.to_cbor();
        assert!(scanned(&bytes).unwrap_err().to_string().contains("`seeds`"));
        assert!(
            EnvelopeRef::parse(&bytes)
                .unwrap_err()
                .to_string()
                .contains("`seeds`")
        );
    }
}

#[test]
fn small_envelopes_and_any_key_order_scan_to_the_full_parse() {
    for (ciphertext, token, chunk) in [
        (16, false, None),
        (100, true, None),
        (5000, true, None),
        (3 * (64 * 1024 + 16), true, Some(64 * 1024)),
    ] {
        let bytes = envelope(ciphertext, token, chunk).to_cbor();
        same_as_parse(&bytes, &scanned(&bytes).unwrap());
    }
    // The token first, the ciphertext last: all in the head, no tail.
    let mut first = vec![0xa5];
    for (key, value) in [
        (
            "token",
            ciborium::Value::Bytes(vec![5; privacy_pass::TOKEN_BYTES]),
        ),
        ("v", ciborium::Value::Integer(2.into())),
        ("key_id", ciborium::Value::Text("k".into())),
        ("enc", ciborium::Value::Bytes(vec![7; 32])),
        ("ct", ciborium::Value::Bytes(vec![9; 100_000])),
    ] {
        ciborium::into_writer(&ciborium::Value::Text(key.into()), &mut first).unwrap();
        ciborium::into_writer(&value, &mut first).unwrap();
    }
    let total = first.len() as u64;
    assert!(matches!(
        scan(&first[..HEAD_BYTES as usize], total),
        Ok(Scan::Header(_))
    ));
    same_as_parse(&first, &scanned(&first).unwrap());
}

#[test]
fn what_a_full_parse_refuses_a_scan_refuses_and_nothing_panics() {
    let good = envelope(10_000, true, None).to_cbor();
    // Every truncation, and bytes after the map.
    for end in (0..good.len()).step_by(97) {
        assert!(scanned(&good[..end]).is_err(), "cut at {end}");
    }
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(scanned(&trailing).is_err());
    // More than TAIL_BYTES after the ciphertext.
    let mut long_tail = vec![0xa5];
    for (key, value) in [
        ("v", ciborium::Value::Integer(2.into())),
        ("ct", ciborium::Value::Bytes(vec![9; 100_000])),
        ("key_id", ciborium::Value::Text("k".repeat(13_000))),
        ("enc", ciborium::Value::Bytes(vec![7; 32])),
        (
            "token",
            ciborium::Value::Bytes(vec![5; privacy_pass::TOKEN_BYTES]),
        ),
    ] {
        ciborium::into_writer(&ciborium::Value::Text(key.into()), &mut long_tail).unwrap();
        ciborium::into_writer(&value, &mut long_tail).unwrap();
    }
    let error = scanned(&long_tail).unwrap_err().to_string();
    assert!(error.contains("at most 12288"), "{error}");
    // A wrong-length token, a short `enc`: refused by name.
    let mut bad = envelope(100, true, None);
    bad.token = Some(vec![1; 10]);
    assert!(
        scanned(&bad.to_cbor())
            .unwrap_err()
            .to_string()
            .contains("token")
    );
    // Pseudo-random bytes of every length up to 3 heads: errors, never panics.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for length in (0..3 * HEAD_BYTES as usize).step_by(61) {
        let bytes: Vec<u8> = (0..length)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let _ = scanned(&bytes);
    }
    // A head that is not the object's first bytes is refused, not misread.
    assert!(scan(&good[..10], good.len() as u64).is_err());
}
