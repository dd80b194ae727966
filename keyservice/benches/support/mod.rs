//! What the key-service benches share: a refusal record as a flood of cheap refusals writes it.

use confed_keyservice::audit::Decision;

/// The `n`th refusal of a flood, at Unix time `at` (about 1 KB as written).
pub(crate) fn refusal(n: u64, at: i64) -> Decision {
    Decision {
        key_id: "key-1".into(),
        failed_checks: vec!["aud".into()],
        token_sha256: format!("{n:064x}"),
        image_digest: Some(format!("sha256:{n:064x}")),
        nonce: format!("{n:043}"),
        task_id: format!("task-{}", n % 97),
        round: n / 97,
        policy: "production".into(),
        ..Decision::note(at, "ks1", "refused", "aud".into())
    }
}
