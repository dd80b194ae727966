//! The unmask agreement: its size makes any two agreeing groups share a quorum (exhaustively for
//! n <= 7), receipts count only when valid, distinct, trusted and naming exactly the set, and the
//! included set's digest is the manifest's formula.

use super::*;
use crate::exchange::generate_signing_key;

/// Every subset of `0..n` of `size` members, as bit masks.
fn subsets(n: u32, size: u32) -> Vec<u32> {
    (0u32..1 << n).filter(|m| m.count_ones() == size).collect()
}

#[test]
fn two_agreeing_groups_always_share_a_quorum_so_an_honest_service_signed_both() {
    for n in 1..=7u16 {
        for t in 1..=n {
            let (a, q) = (agreement(t, n) as u32, quorum(t, n) as u32);
            assert!(a <= u32::from(n), "t {t} n {n}");
            let groups = subsets(u32::from(n), a);
            for x in &groups {
                for y in &groups {
                    assert!((x & y).count_ones() >= q, "t {t} n {n}: {x:b} {y:b}");
                }
            }
        }
    }
    // The layouts of the docs: 2-of-3 needs all 3, 3-of-5 all 5, 3-of-7 six.
    assert_eq!(
        [
            agreement(2, 3),
            agreement(3, 5),
            agreement(3, 7),
            agreement(2, 4)
        ],
        [3, 5, 6, 4]
    );
}

struct Services {
    ids: Vec<String>,
    keys: Vec<SigningKey>,
    verifying: Vec<VerifyingKey>,
}

impl Services {
    fn new(n: usize) -> Self {
        let keys: Vec<SigningKey> = (0..n).map(|_| generate_signing_key()).collect();
        Self {
            ids: (1..=n).map(|i| format!("ks{i}")).collect(),
            verifying: keys.iter().map(|k| *k.verifying_key()).collect(),
            keys,
        }
    }

    fn trusted(&self) -> Vec<TrustedSigner<'_>> {
        self.ids
            .iter()
            .zip(&self.verifying)
            .map(|(id, verifying_key)| TrustedSigner { id, verifying_key })
            .collect()
    }

    fn receipt(&self, i: usize, set: &IncludedSet<'_>) -> UnmaskReceipt {
        let mut receipt = UnmaskReceipt::for_set(&self.ids[i], set, SHAPE, 1_700_000_000);
        receipt.sign(&self.keys[i]);
        receipt
    }
}

const SHAPE: KeySetShape = KeySetShape {
    threshold: 3,
    shares: 5,
};

fn set<'a>(included_sha256: &'a str) -> IncludedSet<'a> {
    IncludedSet {
        task_id: "task-1",
        round: 4,
        key_id: "k1",
        commitment_sha256: "c0ffee",
        included_sha256,
        included: 120,
    }
}

#[test]
fn receipts_of_every_service_for_the_same_set_agree() {
    let services = Services::new(5);
    let digest = included_digest(&["a", "b"]);
    let receipts: Vec<UnmaskReceipt> = (0..5).map(|i| services.receipt(i, &set(&digest))).collect();
    let agreeing = check_agreement(&receipts, &set(&digest), &services.trusted(), SHAPE).unwrap();
    assert_eq!(agreeing, services.ids);
}

#[test]
fn fewer_than_the_agreement_or_receipts_that_do_not_count_are_refused() {
    let services = Services::new(5);
    let digest = included_digest(&["a", "b"]);
    let other = included_digest(&["a"]);
    let trusted = services.trusted();
    let good = |i: usize| services.receipt(i, &set(&digest));
    // Four of five: 3-of-5 needs all five.
    let four: Vec<UnmaskReceipt> = (0..4).map(good).collect();
    let refused = check_agreement(&four, &set(&digest), &trusted, SHAPE).unwrap_err();
    assert_eq!((refused.agreeing.len(), refused.needed), (4, 5));
    // The fifth, each way it can fail to count.
    let mut another_set = services.receipt(4, &set(&other));
    let mut forged = good(4);
    forged.included = 119;
    let repeated = good(0);
    let mut untrusted = good(4);
    untrusted.keyservice_id = "ks9".into();
    let mut other_shape = UnmaskReceipt::for_set(
        &services.ids[4],
        &set(&digest),
        KeySetShape {
            threshold: 3,
            shares: 3,
        },
        1,
    );
    other_shape.sign(&services.keys[4]);
    for (fifth, why) in [
        (another_set.clone(), "for another set"),
        (forged, "bad signature"),
        (repeated, "a second receipt"),
        (untrusted, "not a trusted key service"),
        (other_shape, "for another set"),
    ] {
        let mut receipts = four.clone();
        receipts.push(fifth);
        let refused = check_agreement(&receipts, &set(&digest), &trusted, SHAPE).unwrap_err();
        assert_eq!(refused.agreeing.len(), 4, "{why}");
        assert!(refused.refused[0].1.starts_with(why), "{why}: {refused:?}");
    }
    // The service that signed another set counts for that set, not this one.
    another_set.sign(&services.keys[4]);
    assert!(
        check_agreement(&[another_set], &set(&other), &trusted, SHAPE)
            .unwrap_err()
            .agreeing
            .len()
            == 1
    );
}

#[test]
fn a_verifying_key_listed_under_two_ids_counts_once() {
    let services = Services::new(5);
    let digest = included_digest(&["a"]);
    let mut trusted = services.trusted();
    let alias = "ks1-again".to_string();
    trusted.push(TrustedSigner {
        id: &alias,
        verifying_key: &services.verifying[0],
    });
    let mut receipts: Vec<UnmaskReceipt> =
        (0..4).map(|i| services.receipt(i, &set(&digest))).collect();
    let mut again = UnmaskReceipt::for_set(&alias, &set(&digest), SHAPE, 1);
    again.sign(&services.keys[0]);
    receipts.push(again);
    let refused = check_agreement(&receipts, &set(&digest), &trusted, SHAPE).unwrap_err();
    assert_eq!(refused.agreeing.len(), 4);
}

#[test]
fn the_included_digest_is_sha256_over_sorted_refs_one_per_line() {
    assert_eq!(
        included_digest(&["r1", "r2"]),
        crate::appraise::sha256_hex(b"r1\nr2\n")
    );
    assert_eq!(
        included_digest::<&str>(&[]),
        crate::appraise::sha256_hex(b"")
    );
}
