//! Large updates, aggregated as they decrypt: a chunked envelope (`hpke::seal_chunked`) is opened
//! chunk by chunk and each chunk's values go straight into the sum, so a thread holds one chunk of
//! plaintext, not the whole update. Clipping needs the update's norm before it is added, so every
//! update is read twice (`Replay`), whatever it holds: decrypted once to measure it, and again
//! from the stored ciphertext, which the worker holds anyway, to add it.
//!
//! The safetensors header must fit in the first chunk and the data must start at a multiple of 4
//! bytes (the safetensors writer pads the header to 8); otherwise the update takes the buffered
//! path. The side tensors (an evaluation round's metrics, 12 bytes; a health policy's flag and a
//! weighting policy's example count, 4 bytes each) are copied aside as their chunk passes
//! (`ChunkedUpdate::metrics`, `health`, `examples`).

use std::cell::{OnceCell, RefCell};

use safetensors::Dtype;
use serde::Deserialize;

use super::accumulator::Replay;
use super::contribution::{Exclusion, Sides};
use super::health::FLAG_BYTES;
use crate::envelope::{self, EnvelopeRef};
use crate::hpke_awslc::Recipient;
use crate::policy::{EVALUATION_TENSOR, EXAMPLES_TENSOR, HEALTH_TENSOR};
use confed_worker_api::model::ModelSchema;

/// Where each tensor's data lies in the update and where its values go in the sum.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    /// Offset of the data region in the plaintext (8 + header length).
    data_start: usize,
    /// (begin, end) in the data region, the flat index of the first value and the tensor's
    /// index in schema order, sorted by begin.
    runs: Vec<(usize, usize, usize, usize)>,
    /// (begin, end) of the evaluation metrics tensor in the data region, if the update has one.
    metrics: Option<(usize, usize)>,
    /// (begin, end) of the health tensor in the data region, if the update has one.
    health: Option<(usize, usize)>,
    /// (begin, end) of the example count in the data region, if the update has one.
    examples: Option<(usize, usize)>,
}

/// Why a chunked update is not streamed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamProblem {
    /// Valid perhaps, but not streamable (header beyond the first chunk, unaligned data).
    Buffer,
    Excluded(Exclusion),
}

#[derive(Deserialize)]
struct TensorInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Where a side tensor lies in the data region, if the header names it: F32 of `shape`
/// (`bytes` long), else refused.
fn side(
    entries: &mut std::collections::HashMap<String, serde_json::Value>,
    name: &str,
    shape: &[usize],
    bytes: usize,
) -> Result<Option<(usize, usize)>, StreamProblem> {
    let not_tensors = StreamProblem::Excluded(Exclusion::NotSafetensors);
    let Some(entry) = entries.remove(name) else {
        return Ok(None);
    };
    let info: TensorInfo = serde_json::from_value(entry).map_err(|_| not_tensors.clone())?;
    if info.dtype != Dtype::F32 {
        return Err(StreamProblem::Excluded(Exclusion::WrongDtype));
    }
    if info.shape != shape {
        return Err(StreamProblem::Excluded(Exclusion::WrongTensors));
    }
    let (begin, end) = info.data_offsets;
    if end.checked_sub(begin) != Some(bytes) {
        return Err(not_tensors);
    }
    Ok(Some((begin, end)))
}

fn layout(schema: &ModelSchema, first: &[u8], sides: Sides) -> Result<Layout, StreamProblem> {
    let not_tensors = StreamProblem::Excluded(Exclusion::NotSafetensors);
    let length = first
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or(StreamProblem::Buffer)?;
    let length = usize::try_from(length).map_err(|_| not_tensors.clone())?;
    let data_start = length.checked_add(8).ok_or(not_tensors.clone())?;
    let header = first.get(8..data_start).ok_or(StreamProblem::Buffer)?;
    if !data_start.is_multiple_of(4) {
        return Err(StreamProblem::Buffer);
    }
    let mut entries: std::collections::HashMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|_| not_tensors.clone())?;
    entries.remove("__metadata__");
    // The side tensors, not summed with the model: an evaluation round's metrics (F32 [3], 12
    // bytes) if the device sent them, under a health policy always the flag (F32 [1]) and under
    // a weighting policy always the example count (F32 [1]).
    let metrics = side(&mut entries, EVALUATION_TENSOR, &[3], 12)?;
    let health = side(&mut entries, HEALTH_TENSOR, &[1], FLAG_BYTES)?;
    let examples = side(&mut entries, EXAMPLES_TENSOR, &[1], FLAG_BYTES)?;
    if (metrics.is_some() && !sides.evaluating)
        || health.is_some() != sides.health
        || examples.is_some() != sides.weighting
    {
        return Err(StreamProblem::Excluded(Exclusion::WrongTensors));
    }
    if entries.len() != schema.tensors().len() {
        return Err(StreamProblem::Excluded(Exclusion::WrongTensors));
    }
    let mut runs = Vec::with_capacity(entries.len());
    let mut flat = 0usize;
    for (tensor, spec) in schema.tensors().iter().enumerate() {
        let entry = entries
            .remove(&spec.name)
            .ok_or(StreamProblem::Excluded(Exclusion::WrongTensors))?;
        let info: TensorInfo = serde_json::from_value(entry).map_err(|_| not_tensors.clone())?;
        if info.dtype != Dtype::F32 {
            return Err(StreamProblem::Excluded(Exclusion::WrongDtype));
        }
        if info.shape != spec.shape {
            return Err(StreamProblem::Excluded(Exclusion::WrongTensors));
        }
        let values: usize = spec.shape.iter().product();
        let (begin, end) = info.data_offsets;
        if end.checked_sub(begin) != Some(values * 4) {
            return Err(not_tensors);
        }
        runs.push((begin, end, flat, tensor));
        flat += values;
    }
    runs.sort_unstable();
    // The tensors tile the data region exactly, as safetensors requires.
    let mut spans: Vec<(usize, usize)> = runs.iter().map(|&(b, e, _, _)| (b, e)).collect();
    spans.extend(metrics);
    spans.extend(health);
    spans.extend(examples);
    spans.sort_unstable();
    let mut expected = 0;
    for &(begin, end) in &spans {
        if begin != expected {
            return Err(not_tensors);
        }
        expected = end;
    }
    Ok(Layout {
        data_start,
        runs,
        metrics,
        health,
        examples,
    })
}

/// One chunked contribution, readable again and again.
pub struct ChunkedUpdate<'a> {
    recipient: &'a Recipient,
    envelope: EnvelopeRef<'a>,
    chunk: usize,
    info: Vec<u8>,
    aad: Vec<u8>,
    schema: &'a ModelSchema,
    sides: Sides,
    layout: OnceCell<Result<Layout, StreamProblem>>,
    /// The metrics tensor's bytes, copied as they pass (each replay writes the same bytes).
    metrics: RefCell<[u8; 12]>,
    /// The health tensor's bytes, likewise.
    health: RefCell<[u8; FLAG_BYTES]>,
    /// The example count's bytes, likewise.
    examples: RefCell<[u8; FLAG_BYTES]>,
}

impl<'a> ChunkedUpdate<'a> {
    /// `None` unless the envelope is chunked in a streamable way.
    pub fn new(
        recipient: &'a Recipient,
        envelope: EnvelopeRef<'a>,
        context: &envelope::RoundContext,
        assignment_ref: &str,
        schema: &'a ModelSchema,
        sides: Sides,
    ) -> Option<Self> {
        let chunk = envelope.chunk? as usize;
        if !chunk.is_multiple_of(4) {
            return None;
        }
        Some(Self {
            recipient,
            info: envelope::info(envelope.key_id),
            aad: envelope::aad(context, assignment_ref),
            envelope,
            chunk,
            schema,
            sides,
            layout: OnceCell::new(),
            metrics: RefCell::new([0; 12]),
            health: RefCell::new([0; FLAG_BYTES]),
            examples: RefCell::new([0; FLAG_BYTES]),
        })
    }
}

impl ChunkedUpdate<'_> {
    /// The metrics tensor's bytes, once a replay has read the whole update (`None` if it has
    /// none, or before).
    pub fn metrics(&self) -> Option<[u8; 12]> {
        match self.layout.get() {
            Some(Ok(layout)) if layout.metrics.is_some() => Some(*self.metrics.borrow()),
            _ => None,
        }
    }

    /// The health tensor's bytes, once a replay has read the whole update (`None` if it has
    /// none, or before).
    pub fn health(&self) -> Option<[u8; FLAG_BYTES]> {
        match self.layout.get() {
            Some(Ok(layout)) if layout.health.is_some() => Some(*self.health.borrow()),
            _ => None,
        }
    }

    /// The example count's bytes, once a replay has read the whole update (`None` if it has
    /// none, or before).
    pub fn examples(&self) -> Option<[u8; FLAG_BYTES]> {
        match self.layout.get() {
            Some(Ok(layout)) if layout.examples.is_some() => Some(*self.examples.borrow()),
            _ => None,
        }
    }
}

impl Replay for ChunkedUpdate<'_> {
    type Error = StreamProblem;

    fn replay(&self, each: &mut dyn FnMut(usize, usize, &[u8])) -> Result<(), StreamProblem> {
        let mut position = 0usize;
        let mut problem = None;
        let opened = self.recipient.open_chunks(
            self.envelope.encapsulated_key,
            &self.info,
            &self.aad,
            self.envelope.ciphertext,
            self.chunk,
            |plain| {
                let start = position;
                position += plain.len();
                if problem.is_some() {
                    return;
                }
                let layout = match self
                    .layout
                    .get_or_init(|| layout(self.schema, plain, self.sides))
                {
                    Ok(layout) => layout,
                    Err(why) => {
                        problem = Some(why.clone());
                        return;
                    }
                };
                // This chunk's part of the data region, as offsets into the data region.
                let lo = start.max(layout.data_start) - layout.data_start;
                let hi = (start + plain.len()).saturating_sub(layout.data_start);
                for &(begin, end, flat, tensor) in &layout.runs {
                    let (a, b) = (begin.max(lo), end.min(hi));
                    if a < b {
                        let offset = a + layout.data_start - start;
                        each(
                            tensor,
                            flat + (a - begin) / 4,
                            &plain[offset..offset + (b - a)],
                        );
                    }
                }
                // The side tensors' bytes are copied aside as their chunk passes.
                let aside = |range: Option<(usize, usize)>, into: &mut [u8]| {
                    if let Some((begin, end)) = range {
                        let (a, b) = (begin.max(lo), end.min(hi));
                        if a < b {
                            let offset = a + layout.data_start - start;
                            into[a - begin..b - begin]
                                .copy_from_slice(&plain[offset..offset + (b - a)]);
                        }
                    }
                };
                aside(layout.metrics, &mut self.metrics.borrow_mut()[..]);
                aside(layout.health, &mut self.health.borrow_mut()[..]);
                aside(layout.examples, &mut self.examples.borrow_mut()[..]);
            },
        );
        if opened.is_err() {
            return Err(StreamProblem::Excluded(Exclusion::DecryptionFailed));
        }
        if let Some(problem) = problem {
            return Err(problem);
        }
        let layout = match self.layout.get() {
            Some(Ok(layout)) => layout,
            Some(Err(problem)) => return Err(problem.clone()),
            None => return Err(StreamProblem::Excluded(Exclusion::NotSafetensors)),
        };
        let total = layout
            .runs
            .iter()
            .map(|r| r.1)
            .chain(layout.metrics.map(|m| m.1))
            .chain(layout.health.map(|h| h.1))
            .chain(layout.examples.map(|e| e.1))
            .max()
            .unwrap_or(0);
        if position != layout.data_start + total {
            return Err(StreamProblem::Excluded(Exclusion::NotSafetensors));
        }
        Ok(())
    }
}
