//! One contribution, from stored bytes to checked f32 tensors: CBOR envelope, HPKE open under
//! the round's associated data, safetensors with exactly the model's names, shapes and dtype,
//! Any failure is an `Exclusion`: counted with its reason, never fatal. Every reason is one an
//! honest device's data cannot cause (docs/privacy.md, "What leaves a device"): a non-finite
//! value is not one of them (the aggregator includes such an update as a zero update).

use safetensors::{Dtype, SafeTensors};
use serde::Serialize;

use crate::envelope::{self, EnvelopeRef, RoundContext};
use crate::hpke_awslc::Recipient;
use crate::policy::{EVALUATION_TENSOR, EXAMPLES_TENSOR, HEALTH_TENSOR};
use confed_worker_api::model::ModelSchema;

/// Why a contribution was left out of the sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// Not a version-2 CBOR envelope.
    MalformedEnvelope,
    /// Sealed to a key other than the round's.
    WrongKey,
    /// Does not open under this task, round, assignment, task policy and model: wrong associated
    /// data (a ciphertext moved from another round or assignment, or a policy or model other than
    /// the one the device agreed to), a wrong encapsulated key, or altered bytes. AEAD cannot
    /// tell these apart, by design.
    DecryptionFailed,
    /// The plaintext is not safetensors.
    NotSafetensors,
    /// Tensor names or shapes differ from the model's.
    WrongTensors,
    /// A tensor is not F32.
    WrongDtype,
    /// The stored bytes could not be read (missing blob).
    Missing,
    /// The task requires device tokens and this contribution carries none that authenticates it
    /// (missing, under a key the policy does not name, for another task, round or assignment,
    /// not bound to this envelope, or forged): `device_auth::TokenRefusal`. Whether a device has
    /// a token is not something its data decides.
    Unauthenticated,
    /// An analytics task's plaintext is safetensors of the answer's tensors and shapes but not
    /// an answer an honest device writes (`confed_protocol::answer::AnswerProblem`: presence not
    /// 0 or 1, padding not zeros, a key outside the domain or not UTF-8, a repeated key, a value
    /// outside `[0, c]`); the device library builds answers from checked records.
    InvalidAnswer,
}

impl Exclusion {
    pub const ALL: [Exclusion; 9] = [
        Self::MalformedEnvelope,
        Self::WrongKey,
        Self::DecryptionFailed,
        Self::NotSafetensors,
        Self::WrongTensors,
        Self::WrongDtype,
        Self::Missing,
        Self::Unauthenticated,
        Self::InvalidAnswer,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MalformedEnvelope => "malformed_envelope",
            Self::WrongKey => "wrong_key",
            Self::DecryptionFailed => "decryption_failed",
            Self::NotSafetensors => "not_safetensors",
            Self::WrongTensors => "wrong_tensors",
            Self::WrongDtype => "wrong_dtype",
            Self::Missing => "missing",
            Self::Unauthenticated => "unauthenticated",
            Self::InvalidAnswer => "invalid_answer",
        }
    }
}

/// Where a round's contributions must be bound: the round's context (task, round, policy,
/// model) and the key they are sealed to; and the digest of the job's inputs
/// (`inputs::inputs_digest`), which keys the noise.
#[derive(Debug, Clone)]
pub struct Binding {
    pub context: RoundContext,
    pub key_id: String,
    pub inputs_digest: String,
}

/// The stored bytes as an envelope sealed to the round's key (parsed once per contribution).
pub fn parse<'a>(binding: &Binding, stored: &'a [u8]) -> Result<EnvelopeRef<'a>, Exclusion> {
    let envelope = EnvelopeRef::parse(stored).map_err(|_| Exclusion::MalformedEnvelope)?;
    if envelope.key_id != binding.key_id {
        return Err(Exclusion::WrongKey);
    }
    Ok(envelope)
}

/// Decrypts an envelope for `assignment_ref` into `plaintext` (cleared first).
pub fn open(
    recipient: &Recipient,
    binding: &Binding,
    assignment_ref: &str,
    envelope: &EnvelopeRef<'_>,
    plaintext: &mut Vec<u8>,
) -> Result<(), Exclusion> {
    envelope::open_into(
        recipient,
        envelope,
        &binding.context,
        assignment_ref,
        plaintext,
    )
    .map_err(|_| Exclusion::DecryptionFailed)
}

/// What opens a whole (not streamed) contribution: the round, its key, the policy's token
/// requirement, and the pooled plaintext buffers.
pub(crate) struct Opener<'a> {
    pub binding: &'a Binding,
    pub recipient: &'a Recipient,
    pub device_auth: Option<&'a confed_protocol::device_auth::DeviceAuth>,
    /// A masked round's layout: every envelope must carry its sealed seeds, and a token binds
    /// them (docs/secure-aggregation.md).
    pub masking: Option<&'a confed_protocol::masking::Layout>,
    pub buffers: &'a super::PlaintextBuffers,
}

impl Opener<'_> {
    /// Parses a stored contribution (`None`: missing), checks its token when the policy asks
    /// (before anything is decrypted), opens it into a pooled buffer and hands the plaintext to
    /// `add`, which checks it whole and adds it or excludes it.
    pub(crate) fn open_then(
        &self,
        assignment_ref: &str,
        stored: Option<&[u8]>,
        add: impl FnOnce(&[u8]) -> Result<(), Exclusion>,
    ) -> Result<(), Exclusion> {
        let stored = stored.ok_or(Exclusion::Missing)?;
        let envelope = parse(self.binding, stored)?;
        // Seeds the key services cannot cut into their sealed seeds would fail the whole
        // unmask: such an input is not included.
        if let Some(layout) = self.masking
            && envelope
                .seeds
                .is_none_or(|seeds| confed_protocol::masking::split_seeds(layout, seeds).is_err())
        {
            return Err(Exclusion::MalformedEnvelope);
        }
        if let Some(auth) = self.device_auth {
            authenticate(auth, self.binding, assignment_ref, &envelope, self.masking)?;
        }
        self.buffers.with(|plaintext| {
            open(
                self.recipient,
                self.binding,
                assignment_ref,
                &envelope,
                plaintext,
            )?;
            add(plaintext)
        })
    }
}

/// Checks an envelope's token for `assignment_ref` against the policy's requirement; in a masked
/// round (`masking`) its nonce must bind the envelope's sealed seeds too.
pub fn authenticate(
    device_auth: &confed_protocol::device_auth::DeviceAuth,
    binding: &Binding,
    assignment_ref: &str,
    envelope: &EnvelopeRef<'_>,
    masking: Option<&confed_protocol::masking::Layout>,
) -> Result<(), Exclusion> {
    let nonce = match masking {
        Some(layout) => confed_protocol::envelope::masked_nonce_of(
            layout,
            envelope.encapsulated_key,
            envelope.seeds,
        )
        .ok_or(Exclusion::Unauthenticated)?,
        None => confed_protocol::privacy_pass::context::token_nonce(envelope.encapsulated_key),
    };
    device_auth
        .verify_nonce(
            envelope.token,
            &nonce,
            &binding.context.task_id,
            binding.context.round,
            assignment_ref,
        )
        .map_err(|_| Exclusion::Unauthenticated)
}

/// The tensors a round's updates carry beside the model's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sides {
    /// The round evaluates: an update may carry `EVALUATION_TENSOR` (F32 `[3]`).
    pub evaluating: bool,
    /// The policy names `health`: every update carries `HEALTH_TENSOR` (F32 `[1]`).
    pub health: bool,
    /// The policy names `weighting`: every update carries `EXAMPLES_TENSOR` (F32 `[1]`).
    pub weighting: bool,
}

/// An update's model tensors (schema order) and the side tensors it carries.
pub struct Tensors<'a> {
    pub model: Vec<&'a [u8]>,
    pub metrics: Option<&'a [u8]>,
    pub health: Option<&'a [u8]>,
    pub examples: Option<&'a [u8]>,
}

/// One side tensor of `parsed`, if present: F32 of `shape`, else refused.
fn side<'a>(
    parsed: &SafeTensors<'a>,
    name: &str,
    shape: &[usize],
) -> Result<Option<&'a [u8]>, Exclusion> {
    let Ok(view) = parsed.tensor(name) else {
        return Ok(None);
    };
    if view.dtype() != Dtype::F32 {
        return Err(Exclusion::WrongDtype);
    }
    if view.shape() != shape {
        return Err(Exclusion::WrongTensors);
    }
    Ok(Some(view.data()))
}

/// The f32 data of each model tensor, in the schema's (name) order, as little-endian bytes,
/// after checking names, shapes and dtype; and the side tensors `sides` allows. In an
/// evaluation round the device's evaluation tensor, if it sent one (`EVALUATION_TENSOR`, F32
/// `[3]`): a device may leave it out (it then adds nothing to the metrics), but an evaluation
/// tensor in any other round is refused as `WrongTensors`. Under a health policy the health
/// tensor (`HEALTH_TENSOR`, F32 `[1]`) is required, always, and refused otherwise; so is the
/// example count (`EXAMPLES_TENSOR`, F32 `[1]`) under a weighting policy. Non-finite
/// values are found while summing (one pass), and make the update a zero update, not an
/// exclusion.
pub fn tensors<'a>(
    schema: &ModelSchema,
    plaintext: &'a [u8],
    sides: Sides,
) -> Result<Tensors<'a>, Exclusion> {
    let parsed = SafeTensors::deserialize(plaintext).map_err(|_| Exclusion::NotSafetensors)?;
    let expected = schema.tensors().len();
    let metrics = side(&parsed, EVALUATION_TENSOR, &[3])?;
    let health = side(&parsed, HEALTH_TENSOR, &[1])?;
    let examples = side(&parsed, EXAMPLES_TENSOR, &[1])?;
    if (metrics.is_some() && !sides.evaluating)
        || health.is_some() != sides.health
        || examples.is_some() != sides.weighting
    {
        return Err(Exclusion::WrongTensors);
    }
    let sides_sent = [metrics, health, examples].iter().flatten().count();
    if parsed.len() != expected + sides_sent {
        return Err(Exclusion::WrongTensors);
    }
    let mut data = Vec::with_capacity(expected);
    for spec in schema.tensors() {
        let view = parsed
            .tensor(&spec.name)
            .map_err(|_| Exclusion::WrongTensors)?;
        if view.dtype() != Dtype::F32 {
            return Err(Exclusion::WrongDtype);
        }
        if view.shape() != spec.shape.as_slice() {
            return Err(Exclusion::WrongTensors);
        }
        data.push(view.data());
    }
    Ok(Tensors {
        model: data,
        metrics,
        health,
        examples,
    })
}
