//! The token challenge of one round of one task: what a device's token must answer for its
//! contribution to count (issue 29, `docs/protocol.md`, "Device tokens").
//!
//! ```text
//! redemption_context = SHA-256("confed token context v1" 0x00 task_id 0x00 decimal(round) 0x00)
//! TokenChallenge     = { token_type 0x0002, issuer_name, redemption_context, origin_info "" }
//! ```
//!
//! A token is valid for exactly one (task, round): the context is what the device, the front end
//! and the enclave all compute from the task and round the contribution is sealed to, so a token
//! spent in another round or task fails the challenge-digest check. The issuer never sees the
//! challenge (its digest is inside the blinded message), so it cannot tell where a token is spent.

use sha2::{Digest, Sha256};

use super::{TOKEN_TYPE_BLIND_RSA, TokenChallenge, TokenError};

pub const CONTEXT_LABEL: &str = "confed token context v1";

/// The 32-byte redemption context of `round` of `task_id`.
pub fn redemption_context(task_id: &str, round: u64) -> [u8; 32] {
    let mut hasher = Sha256::new();
    for part in [CONTEXT_LABEL, task_id, &round.to_string()] {
        hasher.update(part.as_bytes());
        hasher.update([0u8]);
    }
    hasher.finalize().into()
}

/// The challenge of `round` of `task_id` under the issuer named `issuer_name`.
pub fn round_challenge(issuer_name: &str, task_id: &str, round: u64) -> TokenChallenge {
    TokenChallenge {
        token_type: TOKEN_TYPE_BLIND_RSA,
        issuer_name: issuer_name.to_string(),
        redemption_context: redemption_context(task_id, round).to_vec(),
        origin_info: String::new(),
    }
}

/// The encoded challenge (what the token's challenge digest is the SHA-256 of).
pub fn encoded_round_challenge(
    issuer_name: &str,
    task_id: &str,
    round: u64,
) -> Result<Vec<u8>, TokenError> {
    round_challenge(issuer_name, task_id, round).encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_separates_tasks_and_rounds_and_is_fixed_by_its_definition() {
        let base = redemption_context("task-a", 3);
        assert_ne!(base, redemption_context("task-a", 4));
        assert_ne!(base, redemption_context("task-b", 3));
        // No ambiguity between the fields: the separator is part of the hash input.
        assert_ne!(
            redemption_context("task-a1", 3),
            redemption_context("task-a", 13)
        );
        // The definition, spelled out for clients in other languages (docs/protocol.md).
        let expected: [u8; 32] = Sha256::digest(b"confed token context v1\0task-a\x003\0").into();
        assert_eq!(base, expected);
        let challenge = encoded_round_challenge("issuer.example", "task-a", 3).unwrap();
        let parsed = TokenChallenge::decode(&challenge).unwrap();
        assert_eq!(parsed.redemption_context, base.to_vec());
        assert_eq!(parsed.origin_info, "");
    }
}
