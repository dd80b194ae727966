//! A sums request's work (`unmask::sums`): every input checked and its seeds opened, then every
//! stream expanded and added, both on the cores this service has (the noise keys and draws, a
//! small part, on one).
//!
//! Inputs are checked in chunks, one thread a chunk (a token's signature and an HPKE open are
//! about 0.1 ms an input), and the first refusal in the request's order is the answer, whatever
//! the threads. The noise key absorbs the opened seeds in the request's order afterwards, and the
//! streams are added by `MaskSums::add_many`. Opened seeds and stream keys are wiped when
//! dropped.

use confed_attestation::unmask_api::MaskedInput;
use confed_protocol::device_auth::DeviceAuth;
use confed_protocol::hpke::PrivateKey;
use confed_protocol::masking::{
    self, Layout, MaskContext, MaskSums, SealedSeeds, Seed, StreamKeys,
};
use confed_protocol::masking_noise::NoiseKeys;
use confed_protocol::policy::TaskPolicy;
use confed_protocol::privacy_pass::context::{masked_token_nonce, seeds_digest};

use crate::error::KeyServiceApiError as ApiError;

/// Threads of one request's mask sums: the machine's cores, at most 8 (beyond that a round of
/// megabyte updates is bound by memory, not AES).
fn sums_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Fewest inputs a thread of the checking pass takes.
const MIN_INPUTS_PER_THREAD: usize = 64;

/// What every input of one request is checked and opened under.
struct Opener<'a> {
    layout: Layout,
    auth: &'a DeviceAuth,
    masking_key: &'a PrivateKey,
    number: u8,
    task_id: &'a str,
    round: u64,
    policy_sha256: String,
    values: usize,
}

/// One input checked, its seeds opened.
struct Opened {
    seeds: Vec<(usize, Seed)>,
    streams: StreamKeys,
}

impl Opener<'_> {
    fn context<'c>(&'c self, reference: &'c str) -> Result<MaskContext<'c>, ApiError> {
        MaskContext::new(
            self.task_id,
            self.round,
            reference,
            &self.policy_sha256,
            self.values,
        )
        .map_err(|e| refuse(reference, e.to_string()))
    }

    /// Checks one input (its seeds' length and digest, its device token over them) and opens
    /// this service's seeds of it.
    fn open(&self, input: &MaskedInput) -> Result<Opened, ApiError> {
        let reference = input.assignment_ref.as_str();
        let decoded = input.decode().map_err(ApiError::BadRequest)?;
        let own_len = masking::sealed_len(&self.layout, self.number);
        if decoded.seeds.len() != own_len
            || decoded.seeds_digests.len() != usize::from(self.layout.services())
        {
            return Err(refuse(
                reference,
                format!(
                    "this service's sealed seeds are {own_len} bytes with {} digests",
                    self.layout.services()
                ),
            ));
        }
        if decoded.seeds_digests[usize::from(self.number) - 1] != seeds_digest(&decoded.seeds) {
            return Err(refuse(
                reference,
                "the seeds are not the ones their digest names".into(),
            ));
        }
        let nonce = masked_token_nonce(&decoded.enc, &decoded.seeds_digests);
        self.auth
            .verify_nonce(
                Some(&decoded.token),
                &nonce,
                self.task_id,
                self.round,
                reference,
            )
            .map_err(|e| refuse(reference, format!("the device token does not hold: {e}")))?;
        let context = self.context(reference)?;
        let seeds = masking::open_seeds(
            &self.layout,
            self.masking_key,
            &SealedSeeds::from_bytes(self.number, &decoded.seeds),
            &context,
        )
        .map_err(|e| refuse(reference, e.to_string()))?;
        let streams = StreamKeys::of(&seeds, &context);
        Ok(Opened { seeds, streams })
    }

    /// Every input opened, in order, on up to `threads` threads; the first refusal in order.
    fn open_all(&self, inputs: &[MaskedInput], threads: usize) -> Result<Vec<Opened>, ApiError> {
        let threads = threads.clamp(1, (inputs.len() / MIN_INPUTS_PER_THREAD).max(1));
        in_order_on_threads(inputs, threads, |input| self.open(input))
    }
}

/// `f` of every item, in order, on up to `threads` threads (one chunk of consecutive items a
/// thread): every result, or the first error in the items' order, whatever the threads.
fn in_order_on_threads<I: Sync, T: Send>(
    items: &[I],
    threads: usize,
    f: impl Fn(&I) -> Result<T, ApiError> + Sync,
) -> Result<Vec<T>, ApiError> {
    if threads <= 1 || items.len() <= 1 {
        return items.iter().map(&f).collect();
    }
    let per_thread = items.len().div_ceil(threads);
    let f = &f;
    let chunks: Vec<Result<Vec<T>, ApiError>> = std::thread::scope(|scope| {
        let running: Vec<_> = items
            .chunks(per_thread)
            .map(|chunk| scope.spawn(move || chunk.iter().map(f).collect()))
            .collect();
        running
            .into_iter()
            .map(|thread| {
                thread.join().unwrap_or_else(|_| {
                    Err(ApiError::Internal("a thread checking inputs failed".into()))
                })
            })
            .collect()
    });
    let mut all = Vec::with_capacity(items.len());
    for chunk in chunks {
        all.extend(chunk?);
    }
    Ok(all)
}

fn refuse(reference: &str, why: String) -> ApiError {
    ApiError::Forbidden(format!(
        "input {reference}: {why}; the whole request is refused"
    ))
}

/// Opens this service's seeds of every input, each under a token that binds them, and sums its
/// groups' streams. Any input that fails refuses the whole request: the set was agreed, and an
/// honest enclave included only inputs whose token it checked.
pub(crate) fn sum_masks(
    policy: &TaskPolicy,
    number: u8,
    masking_key: &PrivateKey,
    task_id: &str,
    round: u64,
    values: usize,
    inputs: &[MaskedInput],
) -> Result<MaskSums, ApiError> {
    let layout = policy.masking.as_ref().expect("a masked policy").layout();
    let auth = policy.device_auth.as_ref().ok_or_else(|| {
        ApiError::BadRequest("a masked task's policy requires device tokens".into())
    })?;
    // Seeds open only under the policy the device sealed them under (the context names it).
    let opener = Opener {
        layout: layout.clone(),
        auth,
        masking_key,
        number,
        task_id,
        round,
        policy_sha256: policy.sha256_hex(),
        values,
    };
    let threads = sums_threads();
    let opened = opener.open_all(inputs, threads)?;
    let mut sums =
        MaskSums::new(&layout, number, values).map_err(|e| ApiError::Internal(e.to_string()))?;
    let noise_variance = policy.masking.as_ref().and_then(|m| m.noise_variance);
    let mut noise_keys =
        noise_variance.map(|_| NoiseKeys::new(&layout.groups_of(number), inputs.len()));
    if let Some(keys) = noise_keys.as_mut() {
        for (input, opened) in inputs.iter().zip(&opened) {
            let reference = input.assignment_ref.as_str();
            keys.absorb(&opened.seeds, &opener.context(reference)?)
                .map_err(|e| refuse(reference, e.to_string()))?;
        }
    }
    let streams: Vec<StreamKeys> = opened.into_iter().map(|o| o.streams).collect();
    sums.add_many(&streams, layout.ring(), threads)
        .map_err(|e| ApiError::Internal(format!("the mask sums: {e}")))?;
    drop(streams);
    // Distributed noise: each group's draw, keyed by the group's seeds over this set, the same
    // at every holder and on every repeat (docs/secure-aggregation.md, "Distributed noise").
    if let (Some(variance), Some(keys)) = (noise_variance, noise_keys) {
        for ((group, sum), (keyed, key)) in sums.sums.iter_mut().zip(keys.finish()) {
            debug_assert_eq!(*group, keyed);
            confed_dp::distributed::noise_mask_sum(sum, variance, &key);
            // Reduced again in the ring of 2^32 (the noise is subtracted mod 2^64).
            for value in sum.iter_mut() {
                *value = layout.ring().reduce(*value);
            }
        }
    }
    Ok(sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the threads, the results keep the items' order, and of several failing items
    /// the answer is the first one's, even when a later chunk fails first.
    #[test]
    fn the_first_refusal_in_order_is_the_answer_on_any_number_of_threads() {
        let items: Vec<usize> = (0..200).collect();
        let double = |i: &usize| Ok::<usize, ApiError>(i * 2);
        for threads in [1, 2, 3, 4, 8, 300] {
            let all = in_order_on_threads(&items, threads, double).unwrap();
            assert_eq!(all, items.iter().map(|i| i * 2).collect::<Vec<_>>());
            let failing = |i: &usize| match *i {
                // The later chunk's item fails at once; the earlier one's only after its chunk
                // has run a while.
                150 => Err(ApiError::Forbidden("item 150".into())),
                60 => {
                    std::thread::yield_now();
                    Err(ApiError::Forbidden("item 60".into()))
                }
                i => Ok(i),
            };
            match in_order_on_threads(&items, threads, failing) {
                Err(ApiError::Forbidden(why)) => assert_eq!(why, "item 60", "{threads} threads"),
                other => panic!("{threads} threads: {other:?}"),
            }
        }
        assert!(
            in_order_on_threads(&[] as &[usize], 4, double)
                .unwrap()
                .is_empty()
        );
    }
}
