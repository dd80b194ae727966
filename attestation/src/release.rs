//! Release commitments, key-service receipts and the enclave's release signature: what makes a
//! round's release happen once, and what lets anyone check that it came from an attested enclave
//! that t key services agreed to.
//!
//! - A **release commitment** names everything a round's release depends on: task, round, the
//!   task policy's hash, the base model's hash and the digest of the job's inputs. The enclave
//!   sends it with every share request; a key service records it in its ledger before it answers
//!   and, for a (task, round) that already has one, releases again only for the identical one.
//! - A **receipt** is a key service's signature over (itself, key, task, round, commitment
//!   digest, the enclave's per-job signing key, the image digest it appraised, its policy, time).
//! - The **release signature** is the enclave's signature, with that per-job key (bound into the
//!   attestation token every key service appraised), over the commitment digest and the hashes of
//!   the manifest and the average it releases.
//!
//! Every signed message is an ASCII text of `|`-separated fields after a version label; every
//! field is restricted so that `|` cannot occur in it. Signatures are ECDSA P-256 with SHA-256,
//! 64 bytes `r || s`, base64url without padding. Formats: docs/attestation.md.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use p256::ecdsa::signature::{Signer, Verifier};
use p256::ecdsa::{Signature, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::appraise::sha256_hex;

/// What one round's release depends on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseCommitment {
    pub task_id: String,
    pub round: u64,
    /// The task key the contributions are sealed to (two keys active at once must not yield
    /// two releases of one round).
    pub key_id: String,
    /// Lowercase hex SHA-256 of the task policy text.
    pub policy_sha256: String,
    /// Lowercase hex SHA-256 of the base model version (`round - 1`).
    pub model_sha256: String,
    /// Lowercase hex BLAKE3 over the job's inputs (docs/protocol.md, `inputs_digest`).
    pub inputs_digest: String,
}

fn is_hex64(text: &str) -> bool {
    confed_protocol::hex::is_digest_hex(text)
}

fn is_id(text: &str) -> bool {
    (1..=128).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl ReleaseCommitment {
    /// Every field well formed (ids of `A-Z a-z 0-9 . _ -`, digests 64 lowercase hex, round >= 1).
    pub fn check(&self) -> Result<(), String> {
        if !is_id(&self.task_id) {
            return Err("`commitment.task_id` must be 1-128 of A-Z a-z 0-9 . _ -".into());
        }
        if self.round == 0 {
            return Err("`commitment.round` must be at least 1".into());
        }
        if !is_id(&self.key_id) {
            return Err("`commitment.key_id` must be 1-128 of A-Z a-z 0-9 . _ -".into());
        }
        for (name, value) in [
            ("policy_sha256", &self.policy_sha256),
            ("model_sha256", &self.model_sha256),
            ("inputs_digest", &self.inputs_digest),
        ] {
            if !is_hex64(value) {
                return Err(format!(
                    "`commitment.{name}` must be 64 lowercase hex digits"
                ));
            }
        }
        Ok(())
    }

    /// The canonical text; its SHA-256 is the commitment digest.
    pub fn text(&self) -> String {
        format!(
            "confed-release-commitment-v1|{}|{}|{}|{}|{}|{}",
            self.task_id,
            self.round,
            self.key_id,
            self.policy_sha256,
            self.model_sha256,
            self.inputs_digest
        )
    }

    /// Lowercase hex SHA-256 of `text()`.
    pub fn digest(&self) -> String {
        sha256_hex(self.text().as_bytes())
    }
}

/// A key service's signed statement that it recorded a commitment and released its share for it
/// to an enclave holding `enclave_signing_key`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    pub keyservice_id: String,
    pub key_id: String,
    pub task_id: String,
    pub round: u64,
    /// `ReleaseCommitment::digest`.
    pub commitment_sha256: String,
    /// The enclave's per-job P-256 verifying key, SEC1 uncompressed, base64url.
    pub enclave_signing_key: String,
    /// The container image digest the key service appraised (`sha256:...`), or `none` (dev).
    pub image_digest: String,
    /// The name of the appraisal policy that accepted the evidence.
    pub policy: String,
    /// The key's threshold and number of shares, from this key service's share file: what the
    /// release quorum is computed from.
    pub threshold: u16,
    pub shares: u16,
    /// Unix seconds.
    pub at: i64,
    /// ECDSA P-256 / SHA-256 over `signed_text()`, base64url.
    pub signature: String,
}

impl Receipt {
    pub fn signed_text(&self) -> String {
        format!(
            "confed-release-receipt-v1|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}",
            self.keyservice_id,
            self.key_id,
            self.task_id,
            self.round,
            self.commitment_sha256,
            self.enclave_signing_key,
            self.image_digest,
            self.policy,
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
}

/// The enclave's signature over one release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseSignature {
    /// The per-job verifying key (SEC1 uncompressed, base64url) the receipts name.
    pub enclave_signing_key: String,
    /// ECDSA P-256 / SHA-256 over `release_text(...)`, base64url.
    pub signature: String,
}

/// The text an enclave signs for a release.
pub fn release_text(
    commitment: &ReleaseCommitment,
    manifest_sha256: &str,
    average_sha256: &str,
) -> String {
    format!(
        "confed-release-v1|{}|{}|{}|{}|{}",
        commitment.task_id,
        commitment.round,
        commitment.digest(),
        manifest_sha256,
        average_sha256
    )
}

/// Everything that vouches for one release: the enclave's signature and the key services'
/// receipts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseProof {
    pub commitment: ReleaseCommitment,
    pub enclave: ReleaseSignature,
    pub receipts: Vec<Receipt>,
}

/// How many key services must have recorded a commitment before its release may be published:
/// `max(t, ceil((n + t) / 2))`. Any two sets of that size share at least t key services, so a
/// second commitment for the same round needs t of them to betray or lose their ledgers: the
/// one-release rule holds with up to t - 1 key services compromised or rolled back.
pub fn quorum(threshold: u16, shares: u16) -> usize {
    let (t, n) = (usize::from(threshold), usize::from(shares));
    t.max((n + t).div_ceil(2))
}

/// One key service whose receipts are trusted: its id and verifying key.
pub struct TrustedSigner<'a> {
    pub id: &'a str,
    pub verifying_key: &'a VerifyingKey,
}

/// What checking a proof found, one line per check (for `confed verify release`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProofCheck {
    pub lines: Vec<String>,
    pub failures: Vec<String>,
}

impl ReleaseProof {
    /// Checks the proof of a release of `manifest_sha256` / `average_sha256`: the enclave's
    /// signature, and valid receipts from distinct trusted key services, each for this
    /// commitment, key and enclave key, at least `quorum(t, n)` of them (t and n below).
    /// `commitment` is what the caller derived
    /// from the manifest itself; the proof's copy must equal it.
    ///
    /// The key set is the verifier's, never the receipts': `key_set` is the threshold t and the
    /// number of shares n its trust file pins, the quorum is `quorum(t, n)`, and a receipt that
    /// states another t or n (t key services whose share files say n = t would otherwise lower
    /// the quorum to t) is a failed check.
    pub fn check(
        &self,
        commitment: &ReleaseCommitment,
        manifest_sha256: &str,
        average_sha256: &str,
        trusted: &[TrustedSigner<'_>],
        key_set: KeySetShape,
    ) -> ProofCheck {
        let mut out = ProofCheck {
            lines: Vec::new(),
            failures: Vec::new(),
        };
        let record = |out: &mut ProofCheck, ok: bool, what: String| {
            if ok {
                out.lines.push(format!("ok: {what}"));
            } else {
                out.lines.push(format!("FAILED: {what}"));
                out.failures.push(what);
            }
        };
        record(
            &mut out,
            self.commitment == *commitment,
            format!(
                "the proof's commitment is the manifest's (digest {})",
                commitment.digest()
            ),
        );
        let enclave_key = decode_verifying_key(&self.enclave.enclave_signing_key);
        let signed = enclave_key.as_ref().is_some_and(|key| {
            verify_text(
                key,
                &release_text(commitment, manifest_sha256, average_sha256),
                &self.enclave.signature,
            )
        });
        record(
            &mut out,
            signed,
            format!(
                "the enclave's per-job key signed this manifest ({manifest_sha256}) and average ({average_sha256})"
            ),
        );
        let mut vouching: Vec<&str> = Vec::new();
        // A verifying key listed under two ids (a mistaken trust file) still counts once.
        let mut vouching_keys: Vec<&VerifyingKey> = Vec::new();
        for receipt in &self.receipts {
            let signer = trusted.iter().find(|t| t.id == receipt.keyservice_id);
            let problem = match signer {
                None => Some("not a trusted key service".to_string()),
                Some(signer)
                    if vouching.contains(&receipt.keyservice_id.as_str())
                        || vouching_keys.contains(&signer.verifying_key) =>
                {
                    Some("a second receipt from the same key service".into())
                }
                Some(signer) if !receipt.verify(signer.verifying_key) => {
                    Some("bad signature".into())
                }
                Some(_) if receipt.commitment_sha256 != commitment.digest() => {
                    Some("for another commitment".into())
                }
                Some(_)
                    if receipt.task_id != commitment.task_id
                        || receipt.round != commitment.round =>
                {
                    Some("for another task or round".into())
                }
                Some(_) if receipt.enclave_signing_key != self.enclave.enclave_signing_key => {
                    Some("issued to another enclave key".into())
                }
                Some(_) if receipt.key_id != commitment.key_id => {
                    Some("for another task key".into())
                }
                Some(_)
                    if (receipt.threshold, receipt.shares)
                        != (key_set.threshold, key_set.shares) =>
                {
                    record(
                        &mut out,
                        false,
                        format!(
                            "receipt of key service {} states threshold {} of {} shares; the trust file pins {} of {}",
                            receipt.keyservice_id,
                            receipt.threshold,
                            receipt.shares,
                            key_set.threshold,
                            key_set.shares
                        ),
                    );
                    Some("states another key set".into())
                }
                Some(_) => None,
            };
            match problem {
                None => {
                    vouching.push(&receipt.keyservice_id);
                    if let Some(signer) = signer {
                        vouching_keys.push(signer.verifying_key);
                    }
                    record(
                        &mut out,
                        true,
                        format!(
                            "receipt of key service {}: share released at {} to an enclave running image {} under policy `{}`",
                            receipt.keyservice_id, receipt.at, receipt.image_digest, receipt.policy
                        ),
                    );
                }
                Some(why) => out.lines.push(format!(
                    "ignored: receipt of key service {}: {why}",
                    receipt.keyservice_id
                )),
            }
        }
        let needed = quorum(key_set.threshold, key_set.shares);
        record(
            &mut out,
            vouching.len() >= needed,
            format!(
                "{} of the {needed} receipts needed from trusted key services (threshold {} of {} shares, from the trust file)",
                vouching.len(),
                key_set.threshold,
                key_set.shares
            ),
        );
        out
    }
}

/// The key set a verifier pins: the threshold t and the number of shares n (its trust file's,
/// never a receipt's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySetShape {
    pub threshold: u16,
    pub shares: u16,
}

impl KeySetShape {
    /// From a trust file's numbers; saturates (a threshold or share count beyond u16 cannot be
    /// met by any receipt set, so it fails closed).
    pub fn new(threshold: usize, shares: usize) -> Self {
        Self {
            threshold: u16::try_from(threshold).unwrap_or(u16::MAX),
            shares: u16::try_from(shares).unwrap_or(u16::MAX),
        }
    }
}

/// Signs a text with `key`: base64url of the 64-byte `r || s`.
pub fn sign_text(key: &SigningKey, text: &str) -> String {
    let signature: Signature = key.sign(text.as_bytes());
    URL_SAFE_NO_PAD.encode(signature.to_bytes())
}

/// Whether `signature` (base64url `r || s`) is `key`'s over `text`.
pub fn verify_text(key: &VerifyingKey, text: &str, signature: &str) -> bool {
    let Ok(bytes) = URL_SAFE_NO_PAD.decode(signature) else {
        return false;
    };
    let Ok(signature) = Signature::from_slice(&bytes) else {
        return false;
    };
    key.verify(text.as_bytes(), &signature).is_ok()
}

pub use crate::exchange::{decode_verifying_key, encode_verifying_key};

/// The value an enclave puts in its token's `eat_nonce` (besides the challenge nonce) to bind
/// its keys and the release it asks for: lowercase hex SHA-256 of
/// `"confed-enclave-keys-v1" || ephemeral X25519 public key (32) || signing key (SEC1, 65) ||
/// commitment digest (64 ASCII hex)`. A relayed token cannot be spent on another commitment.
pub fn key_binding(
    ephemeral_public_key: &[u8; 32],
    signing_key_sec1: &[u8],
    commitment_sha256: &str,
) -> String {
    let mut bytes = b"confed-enclave-keys-v1".to_vec();
    bytes.extend_from_slice(ephemeral_public_key);
    bytes.extend_from_slice(signing_key_sec1);
    bytes.extend_from_slice(commitment_sha256.as_bytes());
    sha256_hex(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::generate_signing_key;

    fn commitment() -> ReleaseCommitment {
        ReleaseCommitment {
            task_id: "t-1".into(),
            round: 2,
            key_id: "k1".into(),
            policy_sha256: "a".repeat(64),
            model_sha256: "b".repeat(64),
            inputs_digest: "c".repeat(64),
        }
    }

    struct Setup {
        services: Vec<(String, SigningKey)>,
        enclave: SigningKey,
        proof: ReleaseProof,
    }

    fn setup(receipts: usize) -> Setup {
        let services: Vec<(String, SigningKey)> = (1..=3)
            .map(|i| (format!("ks{i}"), generate_signing_key()))
            .collect();
        let enclave = generate_signing_key();
        let enclave_key = encode_verifying_key(enclave.verifying_key());
        let c = commitment();
        let receipts = services
            .iter()
            .take(receipts)
            .map(|(id, key)| {
                let mut r = Receipt {
                    keyservice_id: id.clone(),
                    key_id: "k1".into(),
                    task_id: c.task_id.clone(),
                    round: c.round,
                    commitment_sha256: c.digest(),
                    enclave_signing_key: enclave_key.clone(),
                    image_digest: "sha256:00".into(),
                    policy: "dev".into(),
                    threshold: 2,
                    shares: 3,
                    at: 100,
                    signature: String::new(),
                };
                r.sign(key);
                r
            })
            .collect();
        let proof = ReleaseProof {
            enclave: ReleaseSignature {
                enclave_signing_key: enclave_key,
                signature: sign_text(&enclave, &release_text(&c, "m", "a")),
            },
            commitment: c,
            receipts,
        };
        Setup {
            services,
            enclave,
            proof,
        }
    }

    fn check(s: &Setup, proof: &ReleaseProof, manifest: &str) -> ProofCheck {
        let keys: Vec<VerifyingKey> = s.services.iter().map(|(_, k)| *k.verifying_key()).collect();
        let trusted: Vec<TrustedSigner> = s
            .services
            .iter()
            .zip(&keys)
            .map(|((id, _), key)| TrustedSigner {
                id,
                verifying_key: key,
            })
            .collect();
        proof.check(
            &commitment(),
            manifest,
            "a",
            &trusted,
            KeySetShape::new(2, 3),
        )
    }

    #[test]
    fn a_signed_release_with_enough_receipts_verifies() {
        let s = setup(3);
        let result = check(&s, &s.proof, "m");
        assert!(result.failures.is_empty(), "{:?}", result.lines);
        assert_eq!(result.lines.len(), 6, "{:?}", result.lines);
    }

    #[test]
    fn forged_or_insufficient_proofs_fail_and_say_why() {
        let s = setup(3);
        assert!(!check(&s, &s.proof, "other manifest").failures.is_empty());
        let mut two = s.proof.clone();
        two.receipts.pop();
        assert!(
            check(&s, &two, "m").failures[0].contains("2 of the 3"),
            "threshold 2 of 3 shares needs all 3: {:?}",
            check(&s, &two, "m").failures
        );
        let mut other_key = s.proof.clone();
        other_key.receipts[0].key_id = "k2".into();
        other_key.receipts[0].sign(&s.services[0].1);
        assert!(!check(&s, &other_key, "m").failures.is_empty());
        let mut duplicated = s.proof.clone();
        duplicated.receipts[1] = duplicated.receipts[0].clone();
        assert!(!check(&s, &duplicated, "m").failures.is_empty());
        let mut other_enclave = s.proof.clone();
        let stranger = generate_signing_key();
        other_enclave.enclave = ReleaseSignature {
            enclave_signing_key: encode_verifying_key(stranger.verifying_key()),
            signature: sign_text(&stranger, &release_text(&commitment(), "m", "a")),
        };
        assert!(
            !check(&s, &other_enclave, "m").failures.is_empty(),
            "receipts were issued to another enclave key"
        );
        let mut tampered = s.proof.clone();
        tampered.receipts[0].round = 3;
        assert!(!check(&s, &tampered, "m").failures.is_empty());
        let _ = &s.enclave;
    }

    /// t colluding key services whose share files say n = t would lower the quorum to t if the
    /// receipts were believed: the verifier's own t and n decide, and such receipts fail.
    #[test]
    fn receipts_stating_another_key_set_are_a_failed_check() {
        let s = setup(3);
        let mut colluding = s.proof.clone();
        colluding.receipts.pop();
        for (receipt, (_, key)) in colluding.receipts.iter_mut().zip(&s.services) {
            receipt.shares = 2;
            receipt.sign(key);
        }
        let result = check(&s, &colluding, "m");
        assert!(
            result
                .failures
                .iter()
                .any(|f| f.contains("states threshold 2 of 2 shares; the trust file pins 2 of 3")),
            "{:?}",
            result.failures
        );
        assert!(
            result.failures.iter().any(|f| f.contains("0 of the 3")),
            "{:?}",
            result.failures
        );
        // The same three honest receipts verify only against the key set they were issued for.
        let trusted_keys: Vec<VerifyingKey> =
            s.services.iter().map(|(_, k)| *k.verifying_key()).collect();
        let trusted: Vec<TrustedSigner> = s
            .services
            .iter()
            .zip(&trusted_keys)
            .map(|((id, _), key)| TrustedSigner {
                id,
                verifying_key: key,
            })
            .collect();
        let as_two_of_two =
            s.proof
                .check(&commitment(), "m", "a", &trusted, KeySetShape::new(2, 2));
        assert!(!as_two_of_two.failures.is_empty());
    }

    #[test]
    fn the_quorum_makes_any_two_quorums_share_t_key_services() {
        assert_eq!(quorum(2, 3), 3);
        assert_eq!(quorum(3, 5), 4);
        assert_eq!(quorum(2, 2), 2);
        assert_eq!(quorum(5, 9), 7);
        for n in 1u16..=12 {
            for t in 1..=n {
                let q = quorum(t, n);
                assert!(q <= usize::from(n));
                assert!(
                    2 * q - usize::from(n) >= usize::from(t),
                    "t={t} n={n} q={q}"
                );
            }
        }
    }

    #[test]
    fn commitments_are_checked_field_by_field() {
        assert!(commitment().check().is_ok());
        let mut bad = commitment();
        bad.inputs_digest = "C".repeat(64);
        assert!(bad.check().unwrap_err().contains("inputs_digest"));
        let mut bad = commitment();
        bad.task_id = "a|b".into();
        assert!(bad.check().is_err());
        let mut bad = commitment();
        bad.round = 0;
        assert!(bad.check().is_err());
    }
}
