//! The unmask agreement of masked rounds (docs/secure-aggregation.md, "Unmasking, once, for one
//! agreed set", and "Why the agreement"): before any key service returns mask sums for a round,
//! `agreement(t, n)` = `ceil((n + q) / 2)` of them must have signed one and the same included set.
//! Each signs one set per round, so two different sets would need two groups of that many
//! signers, which share at least `q` key services: more than the `q - 1` an attacker may hold,
//! so an honest service would have signed both. The receipts, their text and the check are
//! here, shared by the key services (which sign and check) and the enclave (which gathers);
//! the key services' endpoints and ledger are not built yet.

use p256::ecdsa::{SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::release::{KeySetShape, TrustedSigner, quorum, sign_text, verify_text};

/// The key services that must sign one included set before mask sums are returned:
/// `ceil((n + q) / 2)`, `q` the release quorum.
pub fn agreement(threshold: u16, shares: u16) -> usize {
    (usize::from(shares) + quorum(threshold, shares)).div_ceil(2)
}

/// The included set's digest: lowercase hex SHA-256 over the sorted refs, each followed by a
/// newline. The same formula as a manifest's `included_digest`, so a release names the set its
/// masks were removed for.
pub fn included_digest<S: AsRef<str>>(sorted_refs: &[S]) -> String {
    let mut hasher = Sha256::new();
    for r in sorted_refs {
        hasher.update(r.as_ref().as_bytes());
        hasher.update(b"\n");
    }
    confed_protocol::hex::encode(hasher.finalize())
}

/// The set a round's mask sums are for: what every receipt must name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncludedSet<'a> {
    pub task_id: &'a str,
    pub round: u64,
    pub key_id: &'a str,
    /// `ReleaseCommitment::digest` of the round's admitted commitment.
    pub commitment_sha256: &'a str,
    /// `included_digest` of the included refs.
    pub included_sha256: &'a str,
    pub included: u64,
}

/// A key service's signed statement that it agreed to unmask `included_sha256` for this round,
/// and will agree to no other set for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnmaskReceipt {
    pub keyservice_id: String,
    pub key_id: String,
    pub task_id: String,
    pub round: u64,
    pub commitment_sha256: String,
    pub included_sha256: String,
    /// How many refs the set holds.
    pub included: u64,
    /// The key's threshold and number of shares, from this key service's share file.
    pub threshold: u16,
    pub shares: u16,
    /// Unix seconds.
    pub at: i64,
    /// ECDSA P-256 / SHA-256 over `signed_text()`, base64url.
    pub signature: String,
}

impl UnmaskReceipt {
    /// A receipt of `keyservice_id` for `set` (unsigned: `sign` fills it).
    pub fn for_set(
        keyservice_id: &str,
        set: &IncludedSet<'_>,
        key_set: KeySetShape,
        at: i64,
    ) -> Self {
        Self {
            keyservice_id: keyservice_id.into(),
            key_id: set.key_id.into(),
            task_id: set.task_id.into(),
            round: set.round,
            commitment_sha256: set.commitment_sha256.into(),
            included_sha256: set.included_sha256.into(),
            included: set.included,
            threshold: key_set.threshold,
            shares: key_set.shares,
            at,
            signature: String::new(),
        }
    }

    pub fn signed_text(&self) -> String {
        format!(
            "confed-unmask-receipt-v1|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}",
            self.keyservice_id,
            self.key_id,
            self.task_id,
            self.round,
            self.commitment_sha256,
            self.included_sha256,
            self.included,
            self.threshold,
            self.shares,
            self.at
        )
    }

    /// Fills `signature`.
    pub fn sign(&mut self, key: &SigningKey) {
        self.signature = sign_text(key, &self.signed_text());
    }

    /// Whether the signature is `key`'s over this receipt.
    pub fn verify(&self, key: &VerifyingKey) -> bool {
        verify_text(key, &self.signed_text(), &self.signature)
    }

    /// Whether it names exactly `set` under `key_set`.
    fn names(&self, set: &IncludedSet<'_>, key_set: KeySetShape) -> bool {
        self.task_id == set.task_id
            && self.round == set.round
            && self.key_id == set.key_id
            && self.commitment_sha256 == set.commitment_sha256
            && self.included_sha256 == set.included_sha256
            && self.included == set.included
            && (self.threshold, self.shares) == (key_set.threshold, key_set.shares)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "{} key services agreed on this included set, {needed} must (refused receipts: {refused:?})",
    agreeing.len()
)]
pub struct AgreementError {
    /// The key services whose receipts counted.
    pub agreeing: Vec<String>,
    pub needed: usize,
    /// (key service, why) of every receipt that did not count.
    pub refused: Vec<(String, String)>,
}

/// Checks that `receipts` agree on `set`: valid signatures of distinct trusted key services (a
/// verifying key listed under two ids counts once), each naming exactly this set under the
/// verifier's `key_set` (never the receipts' own numbers), at least `agreement(t, n)` of them.
/// Returns the agreeing key services.
pub fn check_agreement(
    receipts: &[UnmaskReceipt],
    set: &IncludedSet<'_>,
    trusted: &[TrustedSigner<'_>],
    key_set: KeySetShape,
) -> Result<Vec<String>, AgreementError> {
    let mut agreeing: Vec<String> = Vec::new();
    let mut agreeing_keys: Vec<&VerifyingKey> = Vec::new();
    let mut refused = Vec::new();
    for receipt in receipts {
        let signer = trusted.iter().find(|t| t.id == receipt.keyservice_id);
        let problem = match signer {
            None => Some("not a trusted key service"),
            Some(signer)
                if agreeing.contains(&receipt.keyservice_id)
                    || agreeing_keys.contains(&signer.verifying_key) =>
            {
                Some("a second receipt from the same key service")
            }
            Some(signer) if !receipt.verify(signer.verifying_key) => Some("bad signature"),
            Some(_) if !receipt.names(set, key_set) => {
                Some("for another set, round, commitment or key set")
            }
            Some(_) => None,
        };
        match (problem, signer) {
            (None, Some(signer)) => {
                agreeing.push(receipt.keyservice_id.clone());
                agreeing_keys.push(signer.verifying_key);
            }
            (problem, _) => refused.push((
                receipt.keyservice_id.clone(),
                problem.unwrap_or("not a trusted key service").to_string(),
            )),
        }
    }
    let needed = agreement(key_set.threshold, key_set.shares);
    if agreeing.len() < needed {
        return Err(AgreementError {
            agreeing,
            needed,
            refused,
        });
    }
    Ok(agreeing)
}

#[cfg(test)]
#[path = "unmask_tests.rs"]
mod tests;
