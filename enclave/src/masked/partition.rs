//! A masked round in partitions (docs/secure-aggregation.md, "Partitioned masked rounds"; the
//! format in docs/protocol.md, "Sealed partition"): each partition's worker opens its range into
//! a `MaskedAggregator` and seals its wrapping sum, its outcomes and, for each input, a slot of
//! what the key services need of it (`BoundInput`); the root adds the sums and keeps the
//! included inputs' slots, then runs the round's one agreement and one sums request per key
//! service over the whole included set, as an unpartitioned round does.
//!
//! A slot is the ref (64 ASCII bytes), the envelope's `enc` (32), its token's length (u16,
//! big-endian) and the token padded to `TOKEN_BYTES`, and its `seeds` (the layout's length):
//! fixed by the policy (`masking::partition_slot_bytes`). The included inputs' slots come first,
//! sorted by ref, then zeros for the excluded ones, so a sealed partition's length depends on the
//! model, the policy and the range only, never on which inputs were included.

use confed_protocol::hpke::KEY_BYTES;
use confed_protocol::masking::{
    SLOT_FIXED_BYTES, SLOT_REF_BYTES as REF_BYTES, partition_slot_bytes,
};
use confed_protocol::privacy_pass::TOKEN_BYTES;
use zeroize::Zeroizing;

use super::{BoundInput, MaskedAggregator, STRIPE};
use crate::aggregate::partition::{INCLUDED, Partial, PartitionError, Shape};
use crate::aggregate::{Binding, Outcome};

fn not_masked() -> PartitionError {
    PartitionError::Foreign("an unmasked partition for a masked round".into())
}

impl Partial for MaskedAggregator {
    fn binding(&self) -> &Binding {
        &self.binding
    }

    fn shape(&self, _inputs: usize) -> Shape {
        Shape {
            values: self.values as u64,
            evaluation: false,
            health: false,
            table: None,
            masked_slot_bytes: Some(partition_slot_bytes(&self.layout) as u64),
        }
    }

    fn outcome(&self) -> &std::sync::Mutex<Outcome> {
        &self.outcome
    }

    /// The wrapping sum (8 bytes a value, little endian), the outcomes, one slot an input.
    fn into_body(
        self,
        outcomes: &[u8],
        shape: &Shape,
    ) -> Result<Zeroizing<Vec<u8>>, PartitionError> {
        let slot = shape.masked_slot_bytes.ok_or_else(not_masked)? as usize;
        let bound = self.unmask_inputs();
        let included = outcomes.iter().filter(|&&code| code == INCLUDED).count();
        if bound.len() != included {
            return Err(PartitionError::Incomplete(
                "the inputs kept for the key services are not the included ones".into(),
            ));
        }
        let mut body = Zeroizing::new(Vec::with_capacity(
            self.values * 8 + outcomes.len() * (1 + slot),
        ));
        for stripe in self.stripes {
            for value in stripe.into_inner().expect("masked stripe").iter() {
                body.extend_from_slice(&value.to_le_bytes());
            }
        }
        body.extend_from_slice(outcomes);
        for input in &bound {
            let start = body.len();
            let token_len = u16::try_from(input.token.len())
                .ok()
                .filter(|&len| usize::from(len) <= TOKEN_BYTES);
            let seeds_len = slot - SLOT_FIXED_BYTES;
            let (Some(token_len), REF_BYTES, KEY_BYTES, true) = (
                token_len,
                input.assignment_ref.len(),
                input.enc.len(),
                input.seeds.len() == seeds_len,
            ) else {
                return Err(PartitionError::Incomplete(format!(
                    "an included input's fields do not fit a slot of {slot} bytes"
                )));
            };
            body.extend_from_slice(input.assignment_ref.as_bytes());
            body.extend_from_slice(&input.enc);
            body.extend_from_slice(&token_len.to_be_bytes());
            body.extend_from_slice(&input.token);
            let padded = body.len() + TOKEN_BYTES - input.token.len();
            body.resize(padded, 0);
            body.extend_from_slice(&input.seeds);
            debug_assert_eq!(body.len() - start, slot);
        }
        let padded = body.len() + (outcomes.len() - included) * slot;
        body.resize(padded, 0);
        Ok(body)
    }

    fn absorb_state<'p>(
        &self,
        plain: &'p [u8],
        inputs: usize,
        shape: &Shape,
    ) -> Result<&'p [u8], PartitionError> {
        let slot = shape.masked_slot_bytes.ok_or_else(not_masked)? as usize;
        if slot != partition_slot_bytes(&self.layout) {
            return Err(not_masked());
        }
        let (sum, rest) = plain.split_at(self.values * 8);
        let (outcomes, slots) = rest.split_at(inputs);
        let included = outcomes.iter().filter(|&&code| code == INCLUDED).count();
        // An enclave seals the included inputs' slots sorted by ref, then zeros.
        let (kept, zeros) = slots.split_at(included * slot);
        if zeros.iter().any(|&b| b != 0)
            || !kept
                .chunks_exact(slot)
                .zip(kept.chunks_exact(slot).skip(1))
                .all(|(a, b)| a[..REF_BYTES] < b[..REF_BYTES])
        {
            return Err(PartitionError::Malformed(
                "its slots are not the included inputs' in order, then zeros".into(),
            ));
        }
        // Every slot read before anything is added: a bad one leaves the aggregator as it was.
        let mut parsed = Vec::with_capacity(included);
        for one in kept.chunks_exact(slot) {
            let (reference, rest) = one.split_at(REF_BYTES);
            let (enc, rest) = rest.split_at(KEY_BYTES);
            let (token_len, rest) = rest.split_at(2);
            let (token, seeds) = rest.split_at(TOKEN_BYTES);
            let token_len = usize::from(u16::from_be_bytes([token_len[0], token_len[1]]));
            let token = token.get(..token_len).ok_or_else(|| {
                PartitionError::Malformed(format!("a slot's token of {token_len} bytes"))
            })?;
            let assignment_ref = std::str::from_utf8(reference)
                .map_err(|_| PartitionError::Malformed("a slot's ref is not text".into()))?;
            parsed.push(BoundInput {
                assignment_ref: assignment_ref.to_string(),
                enc: enc.to_vec(),
                token: token.to_vec(),
                seeds: seeds.to_vec(),
            });
        }
        for (index, stripe) in self.stripes.iter().enumerate() {
            let mut stripe = stripe.lock().expect("masked stripe");
            let bytes = &sum[index * STRIPE * 8..(index * STRIPE + stripe.len()) * 8];
            for (value, word) in stripe.iter_mut().zip(bytes.chunks_exact(8)) {
                *value = value.wrapping_add(u64::from_le_bytes(word.try_into().expect("8 bytes")));
            }
        }
        self.bound.lock().expect("masked inputs").extend(parsed);
        Ok(outcomes)
    }
}
