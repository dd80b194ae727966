//! One contribution, from stored bytes to checked f32 tensors: CBOR envelope, HPKE open under
//! the round's associated data, safetensors with exactly the model's names, shapes and dtype,
//! every value finite. Any failure is an `Exclusion`: counted with its reason, never fatal.

use safetensors::{Dtype, SafeTensors};
use serde::Serialize;
use zeroize::Zeroizing;

use crate::envelope::{self, Envelope};
use crate::hpke_awslc::Recipient;
use crate::model::ModelSchema;

/// Why a contribution was left out of the sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Exclusion {
    /// Not a version-1 CBOR envelope.
    MalformedEnvelope,
    /// Sealed to a key other than the round's.
    WrongKey,
    /// Does not open under this task, round and assignment: wrong associated data (a ciphertext
    /// moved from another round or assignment), a wrong encapsulated key, or altered bytes. AEAD
    /// cannot tell these apart, by design.
    DecryptionFailed,
    /// The plaintext is not safetensors.
    NotSafetensors,
    /// Tensor names or shapes differ from the model's.
    WrongTensors,
    /// A tensor is not F32.
    WrongDtype,
    /// A value is NaN or infinite.
    NonFinite,
    /// The stored bytes could not be read (missing blob).
    Missing,
}

impl Exclusion {
    pub const ALL: [Exclusion; 8] = [
        Self::MalformedEnvelope,
        Self::WrongKey,
        Self::DecryptionFailed,
        Self::NotSafetensors,
        Self::WrongTensors,
        Self::WrongDtype,
        Self::NonFinite,
        Self::Missing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::MalformedEnvelope => "malformed_envelope",
            Self::WrongKey => "wrong_key",
            Self::DecryptionFailed => "decryption_failed",
            Self::NotSafetensors => "not_safetensors",
            Self::WrongTensors => "wrong_tensors",
            Self::WrongDtype => "wrong_dtype",
            Self::NonFinite => "non_finite",
            Self::Missing => "missing",
        }
    }
}

/// Where a round's contributions must be bound.
#[derive(Debug, Clone)]
pub struct Binding {
    pub task_id: String,
    pub round: u64,
    pub key_id: String,
}

/// Decrypts a stored envelope for `assignment_ref`.
pub fn open(
    recipient: &Recipient,
    binding: &Binding,
    assignment_ref: &str,
    stored: &[u8],
) -> Result<Zeroizing<Vec<u8>>, Exclusion> {
    let envelope = Envelope::from_cbor(stored).map_err(|_| Exclusion::MalformedEnvelope)?;
    if envelope.key_id != binding.key_id {
        return Err(Exclusion::WrongKey);
    }
    envelope::open_with(
        recipient,
        &envelope,
        &binding.task_id,
        binding.round,
        assignment_ref,
    )
    .map_err(|_| Exclusion::DecryptionFailed)
}

/// The f32 data of each model tensor, in the schema's (name) order, as little-endian bytes.
/// Returns the squared L2 norm over all tensors, computed in f64.
pub fn tensors<'a>(
    schema: &ModelSchema,
    plaintext: &'a [u8],
) -> Result<(Vec<&'a [u8]>, f64), Exclusion> {
    let parsed = SafeTensors::deserialize(plaintext).map_err(|_| Exclusion::NotSafetensors)?;
    if parsed.len() != schema.tensors().len() {
        return Err(Exclusion::WrongTensors);
    }
    let mut data = Vec::with_capacity(schema.tensors().len());
    let mut norm_squared = 0.0f64;
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
        norm_squared += squared_norm(view.data());
        data.push(view.data());
    }
    // Any NaN or infinity makes the sum of squares non-finite; f32 squares cannot overflow f64.
    if !norm_squared.is_finite() {
        return Err(Exclusion::NonFinite);
    }
    Ok((data, norm_squared))
}

/// Sum of squares of little-endian f32 values, in f64, in four lanes so it vectorizes.
fn squared_norm(bytes: &[u8]) -> f64 {
    let mut lanes = [0.0f64; 4];
    let mut quads = bytes.chunks_exact(16);
    for quad in &mut quads {
        for (lane, value) in lanes.iter_mut().zip(quad.chunks_exact(4)) {
            let v = f64::from(f32::from_le_bytes([value[0], value[1], value[2], value[3]]));
            *lane += v * v;
        }
    }
    let mut total: f64 = lanes.iter().sum();
    for value in quads.remainder().chunks_exact(4) {
        let v = f64::from(f32::from_le_bytes([value[0], value[1], value[2], value[3]]));
        total += v * v;
    }
    total
}
