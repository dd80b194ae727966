//! Opening contribution envelopes, inside the enclave only. The format and the sealing side are
//! `confed_protocol::envelope` (re-exported here, so the enclave names one module); opening uses
//! AWS-LC (`hpke_awslc`), the fast AEAD path of the aggregation loop.

pub use confed_protocol::envelope::*;
use zeroize::Zeroizing;

use crate::hpke::PrivateKey;
use crate::hpke_awslc::Recipient;

/// Opens an envelope for the task, round and assignment (by its stored ref) it was stored under
/// (enclave only). Convenience over `open_with` for one envelope.
pub fn open(
    private_key: &PrivateKey,
    envelope: &Envelope,
    context: &RoundContext,
    assignment_ref: &str,
) -> Result<Zeroizing<Vec<u8>>, EnvelopeError> {
    open_with(
        &Recipient::new(private_key)?,
        envelope,
        context,
        assignment_ref,
    )
}

/// Opens an envelope with a loaded recipient key (AWS-LC), in one piece or chunk by chunk.
pub fn open_with(
    recipient: &Recipient,
    envelope: &Envelope,
    context: &RoundContext,
    assignment_ref: &str,
) -> Result<Zeroizing<Vec<u8>>, EnvelopeError> {
    let info = info(&envelope.key_id);
    let aad = aad(context, assignment_ref);
    let (enc, ct) = (&envelope.encapsulated_key, &envelope.ciphertext);
    match envelope.chunk {
        None => Ok(recipient.open(enc, &info, &aad, ct)?),
        Some(chunk) => {
            let mut out = Zeroizing::new(Vec::with_capacity(ct.len()));
            recipient.open_chunks(enc, &info, &aad, ct, chunk as usize, |p| {
                out.extend_from_slice(p)
            })?;
            Ok(out)
        }
    }
}

/// `open_with` into a caller's buffer (cleared first): the aggregator reuses one buffer per
/// thread instead of allocating (and page-faulting) a new one per contribution.
pub fn open_into(
    recipient: &Recipient,
    envelope: &EnvelopeRef<'_>,
    context: &RoundContext,
    assignment_ref: &str,
    out: &mut Vec<u8>,
) -> Result<(), EnvelopeError> {
    let info = info(envelope.key_id);
    let aad = aad(context, assignment_ref);
    recipient.open_into(
        envelope.encapsulated_key,
        &info,
        &aad,
        envelope.ciphertext,
        envelope.chunk.map(|c| c as usize),
        out,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hpke;

    fn context(task: &str, round: u64) -> RoundContext {
        RoundContext {
            task_id: task.into(),
            round,
            policy_sha256: "p".repeat(64),
            model_sha256: "m".repeat(64),
        }
    }

    #[test]
    fn sealed_update_opens_only_for_its_assignment_and_round() {
        let (private, public) = hpke::generate_keypair();
        let envelope = seal(
            &public,
            "k1",
            &context("task", 3),
            &"a1".into(),
            b"update bytes",
        )
        .unwrap();
        let parsed = Envelope::from_cbor(&envelope.to_cbor()).unwrap();
        assert_eq!(parsed, envelope);
        let a1 = assignment_ref("a1");
        assert_eq!(
            open(&private, &parsed, &context("task", 3), &a1)
                .unwrap()
                .as_slice(),
            b"update bytes"
        );
        assert!(
            open(&private, &parsed, &context("task", 3), "a1").is_err(),
            "binds the ref, not the capability"
        );
        for (task, round, assignment) in [("task", 4, "a1"), ("other", 3, "a1"), ("task", 3, "a2")]
        {
            let reference = assignment_ref(assignment);
            assert!(
                open(&private, &parsed, &context(task, round), &reference).is_err(),
                "{task}/{round}/{assignment}"
            );
        }
        let mut other_policy = context("task", 3);
        other_policy.policy_sha256 = "q".repeat(64);
        let mut other_model = context("task", 3);
        other_model.model_sha256 = "n".repeat(64);
        for changed in [other_policy, other_model] {
            assert!(
                open(&private, &parsed, &changed, &a1).is_err(),
                "bound to the policy and the model"
            );
        }
    }

    #[test]
    fn large_updates_are_sealed_in_chunks_and_open_the_same() {
        let (private, public) = hpke::generate_keypair();
        let update: Vec<u8> = (0..CHUNK_THRESHOLD * 2 + 5)
            .map(|i| (i % 241) as u8)
            .collect();
        let envelope = seal(&public, "k1", &context("task", 1), &"a1".into(), &update).unwrap();
        assert_eq!(envelope.chunk, Some(CHUNK_THRESHOLD as u32));
        let parsed = Envelope::from_cbor(&envelope.to_cbor()).unwrap();
        assert_eq!(parsed, envelope);
        let opened = open(
            &private,
            &parsed,
            &context("task", 1),
            &assignment_ref("a1"),
        )
        .unwrap();
        assert_eq!(opened.as_slice(), update.as_slice());
        assert!(
            open(
                &private,
                &parsed,
                &context("task", 2),
                &assignment_ref("a1")
            )
            .is_err()
        );
        let mut odd_chunk = parsed.clone();
        odd_chunk.chunk = Some(100);
        assert!(Envelope::from_cbor(&odd_chunk.to_cbor()).is_err());
    }
}
