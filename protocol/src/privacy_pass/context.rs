//! What binds a device token to the one contribution it authenticates (issue 29,
//! `docs/protocol.md`, "Device tokens").
//!
//! ```text
//! redemption_context = SHA-256("confed token context v1" 0x00 task_id 0x00 decimal(round) 0x00
//!                              assignment_ref 0x00)
//! TokenChallenge     = { token_type 0x0002, issuer_name, redemption_context, origin_info "" }
//! nonce              = SHA-256("confed token nonce v1" 0x00 enc)
//! nonce (masked)     = SHA-256("confed token nonce v2" 0x00 enc || SHA-256(seeds_1) || ...
//!                              || SHA-256(seeds_n))
//! ```
//!
//! In a masked task (docs/secure-aggregation.md) the nonce also binds the seeds the device
//! sealed to each key service (`seeds_j`, key service `j`'s item of the envelope's `seeds`), so
//! a key service adds a device's masks only for the seeds that device sealed: one that checks
//! the token needs its own item and the others' digests, not their bytes.
//!
//! The context names the task, the round and the assignment, so a token counts for one
//! contribution of one round of one task: spent in another round, task or assignment its challenge
//! digest differs. A job lists each assignment once, so no token can count twice in a release.
//! The nonce is the hash of the HPKE encapsulated key of the contribution's envelope
//! (`hpke_ephemeral`): whoever sees a token in an upload (the front end's operator) cannot attach
//! it to a contribution of its own, whose encapsulated key would differ. The issuer sees neither
//! (both are inside the blinded message), so it cannot tell where a token is spent.

use sha2::{Digest, Sha256};

use super::{TOKEN_TYPE_BLIND_RSA, TokenChallenge, TokenError};

pub const CONTEXT_LABEL: &str = "confed token context v1";
pub const NONCE_LABEL: &str = "confed token nonce v1";

/// The 32-byte redemption context of one assignment of `round` of `task_id`.
pub fn redemption_context(task_id: &str, round: u64, assignment_ref: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in [CONTEXT_LABEL, task_id, &round.to_string(), assignment_ref] {
        hasher.update(part.as_bytes());
        hasher.update([0u8]);
    }
    hasher.finalize().into()
}

/// The token nonce that binds a token to the envelope whose encapsulated key is `enc`.
pub fn token_nonce(enc: &[u8]) -> [u8; 32] {
    Sha256::new()
        .chain_update(NONCE_LABEL.as_bytes())
        .chain_update([0u8])
        .chain_update(enc)
        .finalize()
        .into()
}

pub const MASKED_NONCE_LABEL: &str = "confed token nonce v2";

/// The token nonce of a masked contribution: it binds the envelope's encapsulated key and the
/// SHA-256 of each key service's sealed seeds, service 1 first (`seeds_digest`).
pub fn masked_token_nonce(enc: &[u8], seeds_digests: &[[u8; 32]]) -> [u8; 32] {
    let mut hasher = Sha256::new()
        .chain_update(MASKED_NONCE_LABEL.as_bytes())
        .chain_update([0u8])
        .chain_update(enc);
    for digest in seeds_digests {
        hasher.update(digest);
    }
    hasher.finalize().into()
}

/// SHA-256 of one key service's sealed seeds, as the masked nonce takes it.
pub fn seeds_digest(sealed: &[u8]) -> [u8; 32] {
    Sha256::digest(sealed).into()
}

/// The challenge of one assignment under the issuer named `issuer_name`.
pub fn round_challenge(
    issuer_name: &str,
    task_id: &str,
    round: u64,
    assignment_ref: &str,
) -> TokenChallenge {
    TokenChallenge {
        token_type: TOKEN_TYPE_BLIND_RSA,
        issuer_name: issuer_name.to_string(),
        redemption_context: redemption_context(task_id, round, assignment_ref).to_vec(),
        origin_info: String::new(),
    }
}

/// The encoded challenge (what the token's challenge digest is the SHA-256 of).
pub fn encoded_round_challenge(
    issuer_name: &str,
    task_id: &str,
    round: u64,
    assignment_ref: &str,
) -> Result<Vec<u8>, TokenError> {
    round_challenge(issuer_name, task_id, round, assignment_ref).encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_separates_tasks_rounds_and_assignments_and_is_fixed_by_its_definition() {
        let base = redemption_context("task-a", 3, "ab");
        assert_ne!(base, redemption_context("task-a", 4, "ab"));
        assert_ne!(base, redemption_context("task-b", 3, "ab"));
        assert_ne!(base, redemption_context("task-a", 3, "ac"));
        // No ambiguity between the fields: the separator is part of the hash input.
        assert_ne!(
            redemption_context("task-a1", 3, "ab"),
            redemption_context("task-a", 13, "ab")
        );
        // The definition, spelled out for clients in other languages (docs/protocol.md).
        let expected: [u8; 32] =
            Sha256::digest(b"confed token context v1\0task-a\x003\0ab\0").into();
        assert_eq!(base, expected);
        let challenge = encoded_round_challenge("issuer.example", "task-a", 3, "ab").unwrap();
        let parsed = TokenChallenge::decode(&challenge).unwrap();
        assert_eq!(parsed.redemption_context, base.to_vec());
        assert_eq!(parsed.origin_info, "");
        let nonce: [u8; 32] = Sha256::digest(b"confed token nonce v1\0\x01\x02").into();
        assert_eq!(token_nonce(&[1, 2]), nonce);
    }

    #[test]
    fn the_masked_nonce_binds_every_services_seeds_and_differs_from_the_plain_one() {
        let digests = [seeds_digest(b"one"), seeds_digest(b"two")];
        let nonce = masked_token_nonce(&[1, 2], &digests);
        let mut spelled = b"confed token nonce v2\0\x01\x02".to_vec();
        spelled.extend_from_slice(&Sha256::digest(b"one"));
        spelled.extend_from_slice(&Sha256::digest(b"two"));
        assert_eq!(nonce, <[u8; 32]>::from(Sha256::digest(&spelled)));
        assert_ne!(nonce, token_nonce(&[1, 2]));
        let swapped = [digests[1], digests[0]];
        assert_ne!(nonce, masked_token_nonce(&[1, 2], &swapped));
        assert_ne!(nonce, masked_token_nonce(&[1, 2], &digests[..1]));
    }
}
