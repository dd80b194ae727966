//! A sums request's work (`unmask::sums`): every input checked and its seeds opened, then every
//! stream expanded and added, both on the cores this service has (the noise keys and draws, a
//! small part, on one).
//!
//! Inputs are checked in chunks, one thread a chunk (a token's signature and an HPKE open are
//! about 0.1 ms an input), and the first refusal in the request's order is the answer, whatever
//! the threads. The noise key absorbs the opened seeds in the request's order afterwards, and the
//! streams are added by `MaskSums::add_many`. Opened seeds and stream keys are wiped when
//! dropped. A round prepared while it collected (`unmask_prepare.rs`) leaves only the difference
//! between what it holds and the agreed set to open, add and subtract.

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
use crate::unmask_prepared::{PreparedRound, input_digest};

/// Threads of one request's mask sums: the machine's cores, at most 8 (beyond that a round of
/// megabyte updates is bound by memory, not AES).
pub(crate) fn sums_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// Fewest inputs a thread of the checking pass takes.
const MIN_INPUTS_PER_THREAD: usize = 64;

/// What every input of one request is checked and opened under.
pub(crate) struct Opener<'a> {
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
pub(crate) struct Opened {
    pub(crate) seeds: Vec<(usize, Seed)>,
    pub(crate) streams: StreamKeys,
}

impl<'a> Opener<'a> {
    /// The opener of this service's (`number`'s) seeds under a masked `policy`, which requires
    /// device tokens, for round `round` of `task_id` and vectors of `values` values.
    pub(crate) fn new(
        policy: &'a TaskPolicy,
        number: u8,
        masking_key: &'a PrivateKey,
        (task_id, round): (&'a str, u64),
        values: usize,
    ) -> Result<Self, ApiError> {
        let layout = policy
            .masking
            .as_ref()
            .ok_or_else(|| ApiError::BadRequest("the task's policy masks nothing".into()))?
            .layout();
        let auth = policy.device_auth.as_ref().ok_or_else(|| {
            ApiError::BadRequest("a masked task's policy requires device tokens".into())
        })?;
        // Seeds open only under the policy the device sealed them under (the context names it).
        Ok(Self {
            layout,
            auth,
            masking_key,
            number,
            task_id,
            round,
            policy_sha256: policy.sha256_hex(),
            values,
        })
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    pub(crate) fn number(&self) -> u8 {
        self.number
    }

    pub(crate) fn values(&self) -> usize {
        self.values
    }

    pub(crate) fn context<'c>(&'c self, reference: &'c str) -> Result<MaskContext<'c>, ApiError> {
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
    pub(crate) fn open(&self, input: &MaskedInput) -> Result<Opened, ApiError> {
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
    fn open_all(&self, inputs: &[&MaskedInput], threads: usize) -> Result<Vec<Opened>, ApiError> {
        let threads = threads.clamp(1, (inputs.len() / MIN_INPUTS_PER_THREAD).max(1));
        in_order_on_threads(inputs, threads, |input| self.open(input))
    }

    /// Every input opened, each on its own (a refusal is that input's), in order, on up to
    /// `threads` threads.
    pub(crate) fn open_each(
        &self,
        inputs: &[&MaskedInput],
        threads: usize,
    ) -> Result<Vec<Result<Opened, ApiError>>, ApiError> {
        let threads = threads.clamp(1, (inputs.len() / MIN_INPUTS_PER_THREAD).max(1));
        in_order_on_threads(inputs, threads, |input| Ok(self.open(input)))
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

/// One input's opened seeds, by group.
type InputSeeds = Vec<(usize, Seed)>;

/// A sums request's answer, and how much of it was prepared ahead.
pub(crate) struct Summed {
    pub(crate) sums: MaskSums,
    /// Inputs whose streams were added while the round collected.
    pub(crate) prepared: usize,
    /// Inputs added ahead that the set leaves out (or sent with other bytes), subtracted.
    pub(crate) subtracted: usize,
}

/// Opens this service's seeds of every input, each under a token that binds them, and sums its
/// groups' streams. Any input that fails refuses the whole request: the set was agreed, and an
/// honest enclave included only inputs whose token it checked.
///
/// With `prepared` (the round's inputs added while it collected, under the same policy and
/// values), only the inputs it does not hold with the same bytes are opened and added, and the
/// ones it holds that the set leaves out are subtracted: the answer is the same bytes either way
/// (every prepared input passed the same checks, under the same policy, with the same bytes).
pub(crate) fn sum_masks(
    opener: &Opener<'_>,
    inputs: &[MaskedInput],
    prepared: Option<PreparedRound>,
    noise_variance: Option<u64>,
) -> Result<Summed, ApiError> {
    let layout = opener.layout();
    let threads = sums_threads();
    let (mut summed, seeds) = match prepared {
        Some(prepared) => from_prepared(opener, prepared, inputs, threads)?,
        None => {
            let all: Vec<&MaskedInput> = inputs.iter().collect();
            let opened = opener.open_all(&all, threads)?;
            let mut sums = MaskSums::new(layout, opener.number, opener.values)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            let (seeds, streams): (Vec<_>, Vec<_>) =
                opened.into_iter().map(|o| (o.seeds, o.streams)).unzip();
            sums.add_many(&streams, layout.ring(), threads)
                .map_err(|e| ApiError::Internal(format!("the mask sums: {e}")))?;
            let summed = Summed {
                sums,
                prepared: 0,
                subtracted: 0,
            };
            (summed, seeds)
        }
    };
    // Distributed noise: each group's draw, keyed by the group's seeds over this set in the
    // request's order, the same at every holder and on every repeat
    // (docs/secure-aggregation.md, "Distributed noise").
    if let Some(variance) = noise_variance {
        let mut keys = NoiseKeys::new(&layout.groups_of(opener.number), inputs.len());
        for (input, seeds) in inputs.iter().zip(&seeds) {
            let reference = input.assignment_ref.as_str();
            keys.absorb(seeds, &opener.context(reference)?)
                .map_err(|e| refuse(reference, e.to_string()))?;
        }
        for ((group, sum), (keyed, key)) in summed.sums.sums.iter_mut().zip(keys.finish()) {
            debug_assert_eq!(*group, keyed);
            confed_dp::distributed::noise_mask_sum(sum, variance, &key);
            // Reduced again in the ring of 2^32 (the noise is subtracted mod 2^64).
            for value in sum.iter_mut() {
                *value = layout.ring().reduce(*value);
            }
        }
    }
    Ok(summed)
}

/// The sums of `inputs` from a prepared round: its sums, plus the inputs it does not hold with
/// these bytes (opened and checked now, the first refusal in the request's order as ever),
/// minus the ones it holds that are not among them. Every input's seeds, in order.
fn from_prepared(
    opener: &Opener<'_>,
    prepared: PreparedRound,
    inputs: &[MaskedInput],
    threads: usize,
) -> Result<(Summed, Vec<InputSeeds>), ApiError> {
    let layout = opener.layout();
    let ring = layout.ring();
    let PreparedRound {
        mut sums,
        inputs: mut held,
    } = prepared;
    let mut seeds: Vec<Option<InputSeeds>> = Vec::with_capacity(inputs.len());
    let mut fresh = Vec::new();
    let mut stale = Vec::new();
    for (at, input) in inputs.iter().enumerate() {
        match held.remove(&input.assignment_ref) {
            Some(kept) if kept.digest == input_digest(input) => seeds.push(Some(kept.seeds)),
            other => {
                if let Some(kept) = other {
                    stale.push((input.assignment_ref.clone(), kept));
                }
                fresh.push(at);
                seeds.push(None);
            }
        }
    }
    stale.extend(held);
    let prepared_count = inputs.len() - fresh.len();
    let fresh_inputs: Vec<&MaskedInput> = fresh.iter().map(|&at| &inputs[at]).collect();
    let opened = opener.open_all(&fresh_inputs, threads)?;
    let mut streams = Vec::with_capacity(opened.len());
    for (&at, opened) in fresh.iter().zip(opened) {
        streams.push(opened.streams);
        seeds[at] = Some(opened.seeds);
    }
    let internal = |e: confed_protocol::masking::MaskingError| {
        ApiError::Internal(format!("the prepared mask sums: {e}"))
    };
    sums.add_many(&streams, ring, threads).map_err(internal)?;
    if !stale.is_empty() {
        let stale_streams = stale
            .iter()
            .map(|(reference, kept)| Ok(StreamKeys::of(&kept.seeds, &opener.context(reference)?)))
            .collect::<Result<Vec<_>, ApiError>>()?;
        sums.subtract_many(&stale_streams, ring, threads)
            .map_err(internal)?;
    }
    let seeds = seeds
        .into_iter()
        .map(|s| s.ok_or_else(|| ApiError::Internal("an input's seeds went missing".into())))
        .collect::<Result<_, _>>()?;
    let summed = Summed {
        sums,
        prepared: prepared_count,
        subtracted: stale.len(),
    };
    Ok((summed, seeds))
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
