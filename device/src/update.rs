//! What a device sends once it has accepted an assignment: always the model's exact tensors and
//! shapes, finite, with the round's metrics when it evaluates, under a policy that names
//! `health` the flag saying whether it sent zeros, and under one that names `weighting` the
//! example count its update trained on, whatever training did.
//!
//! A tenant or the operator chooses the model and the plan, so it can make training fail, raise or
//! overflow on a condition of a device's private data that it picked (a weight of 1e37 on one
//! feature). If what the device sends then differed (no upload, a `failed` report, an error text,
//! another size, a NaN the enclave would exclude), that difference would carry the condition's
//! bit out beside the noised release. So the device replaces anything it cannot send as trained
//! with a zero update of the model's shape and reports `completed` like any other; the problem
//! stays on the device (`WellFormedUpdate::problems`) for its own log (docs/privacy.md, "What
//! leaves a device").

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use thiserror::Error;

use confed_protocol::policy::{EVALUATION_TENSOR, EXAMPLES_TENSOR, HEALTH_TENSOR, Weighting};

/// The prefix of tensor names the protocol reserves (`EVALUATION_TENSOR`, `HEALTH_TENSOR`,
/// `EXAMPLES_TENSOR`).
const RESERVED_PREFIX: &str = "confed.";

/// Why the downloaded model cannot be trained from: a fault of the model (the same for every
/// device of the round, so reporting it tells nothing of any device's data).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ModelShapeError {
    #[error("the model is not safetensors: {0}")]
    NotSafetensors(String),
    #[error("model tensor {0} is not F32")]
    NotF32(String),
    #[error("the model has a tensor named {0}: names starting with `confed.` are reserved")]
    ReservedName(String),
    #[error("the model has no tensors")]
    Empty,
}

/// What went wrong between accepting the assignment and sealing: the device's own business,
/// never sent to the server (the update sent is a zero update, or zero metrics, instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrainingProblem {
    /// The training function failed (an exception, too few examples, ...): its text.
    TrainingFailed(String),
    /// The update is not safetensors: a programming error of the training code.
    NotSafetensors(String),
    /// The update's tensors differ from the model's (names, shapes or dtype): a programming
    /// error of the training code.
    WrongTensors(String),
    /// The update holds a NaN or an infinity (in this tensor).
    NonFinite(String),
    /// The evaluation function failed: its text.
    EvaluationFailed(String),
    /// The evaluation gave a NaN or an infinity.
    EvaluationNonFinite,
    /// Training had not finished at the send instant drawn before it started
    /// (`schedule::Schedule`): zeros were sent, and whatever it finished later was dropped.
    Late,
    /// Under a weighting policy, the training code gave no example count, or one that is not a
    /// finite number >= 0 (its text): a programming error of the training code.
    NoExampleCount(String),
}

impl TrainingProblem {
    /// A fault of the training code that no data would fix (the wrong tensors): a device should
    /// fail loudly on it, in its own log, after sending the zero update like any other.
    pub fn is_programming_error(&self) -> bool {
        matches!(
            self,
            Self::NotSafetensors(_) | Self::WrongTensors(_) | Self::NoExampleCount(_)
        )
    }
}

impl std::fmt::Display for TrainingProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TrainingFailed(why) => write!(f, "training failed: {why}"),
            Self::NotSafetensors(why) => write!(f, "the update is not safetensors: {why}"),
            Self::WrongTensors(why) => write!(f, "the update does not match the model: {why}"),
            Self::NonFinite(name) => write!(f, "the update's tensor {name} is not finite"),
            Self::EvaluationFailed(why) => write!(f, "evaluation failed: {why}"),
            Self::EvaluationNonFinite => write!(f, "the evaluation is not finite"),
            Self::Late => write!(
                f,
                "training had not finished at the send instant (drawn from the policy's upload window); zeros were sent"
            ),
            Self::NoExampleCount(why) => write!(
                f,
                "the task weighs updates by examples, but the training code gave {why} as its example count"
            ),
        }
    }
}

/// The model's tensors, names in safetensors (sorted) order, every one F32; whether every
/// update carries the health flag (`reporting_health`) and the example count (`weighing`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateShape {
    tensors: Vec<(String, Vec<usize>)>,
    health: bool,
    weighting: Option<Weighting>,
}

/// An update ready to seal: the model's exact tensors, finite, plus the metrics tensor in an
/// evaluation round. Only `UpdateShape::well_formed` makes one, so a sealed update always has
/// the size and shape the model fixes, whatever the device's data did.
#[derive(Debug, Clone)]
pub struct WellFormedUpdate {
    bytes: Vec<u8>,
    problems: Vec<TrainingProblem>,
    /// An analytics answer (`crate::analytics`), not a training update: sealed only under an
    /// analytics policy, and a training update never under one.
    answer: bool,
}

impl WellFormedUpdate {
    /// The safetensors bytes to seal.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// What was replaced by zeros, and why: for the device's own log, never for the server.
    pub fn problems(&self) -> &[TrainingProblem] {
        &self.problems
    }

    /// The same bytes, with `problems` as the reason they are what they are.
    pub(crate) fn with_problems(self, problems: Vec<TrainingProblem>) -> Self {
        Self { problems, ..self }
    }

    /// An analytics answer's bytes (`crate::analytics`: the query's fixed shape).
    pub(crate) fn answer(bytes: Vec<u8>, problems: Vec<TrainingProblem>) -> Self {
        Self {
            bytes,
            problems,
            answer: true,
        }
    }

    /// Whether this is an analytics answer rather than a training update.
    pub fn is_answer(&self) -> bool {
        self.answer
    }
}

impl UpdateShape {
    /// The shape of updates to `model` (safetensors bytes, as downloaded).
    pub fn of_model(model: &[u8]) -> Result<Self, ModelShapeError> {
        let parsed = SafeTensors::deserialize(model)
            .map_err(|e| ModelShapeError::NotSafetensors(e.to_string()))?;
        let mut tensors = Vec::with_capacity(parsed.len());
        for (name, view) in parsed.tensors() {
            if name.starts_with(RESERVED_PREFIX) {
                return Err(ModelShapeError::ReservedName(name));
            }
            if view.dtype() != Dtype::F32 {
                return Err(ModelShapeError::NotF32(name));
            }
            tensors.push((name, view.shape().to_vec()));
        }
        if tensors.is_empty() {
            return Err(ModelShapeError::Empty);
        }
        tensors.sort();
        Ok(Self {
            tensors,
            health: false,
            weighting: None,
        })
    }

    /// Every update of this shape carries `HEALTH_TENSOR` (F32 `[1]`): `1` when the model's
    /// values were replaced by zeros, else `0`. On exactly when the task policy names `health`
    /// (`Model::update_shape` sets it): the enclave refuses an update with the flag
    /// under any other policy, and one without it under such a policy.
    pub fn reporting_health(self, health: bool) -> Self {
        Self { health, ..self }
    }

    /// Whether updates of this shape carry the health flag.
    pub fn reports_health(&self) -> bool {
        self.health
    }

    /// Every update of this shape carries `EXAMPLES_TENSOR` (F32 `[1]`): the examples the update
    /// trained on, at most the policy's `max_examples` (more weigh no more), `0` for zeros sent
    /// in its place. On exactly when the task policy names `weighting` (`Model::update_shape`).
    pub fn weighing(self, weighting: Option<Weighting>) -> Self {
        Self { weighting, ..self }
    }

    /// Whether updates of this shape carry the example count.
    pub fn weighs(&self) -> bool {
        self.weighting.is_some()
    }

    /// The model's tensors: (name, shape), in safetensors (name) order, all F32.
    pub fn tensors(&self) -> &[(String, Vec<usize>)] {
        &self.tensors
    }

    /// The update to seal, from what training gave (`trained`: the update's safetensors, the new
    /// weights minus the model's, or the training's error) and, in an evaluation round, what
    /// evaluation gave (`evaluation`: `[loss_sum, correct, examples]` or its error; `None`
    /// outside evaluation rounds). Whatever they hold, the result has exactly the model's
    /// tensors (re-encoded: nothing of the caller's bytes but the values passes), every value
    /// finite, and in an evaluation round the metrics tensor: a zero update where training
    /// failed, zero metrics where evaluation did, each with its problem noted. With
    /// `reporting_health`, the health flag says whether the model's values are zeros sent for a
    /// problem (failed evaluation alone does not set it: the update itself is the trained one).
    pub fn well_formed(
        &self,
        trained: Result<Vec<u8>, String>,
        evaluation: Option<Result<[f32; 3], String>>,
    ) -> WellFormedUpdate {
        self.well_formed_weighed(trained, evaluation, None)
    }

    /// `well_formed` with the example count the training code gave (`examples`; `None` if it
    /// gave none). Under `weighing` the count must be a finite number >= 0, or the update is
    /// zeros (`TrainingProblem::NoExampleCount`); it is sent capped at `max_examples` (a count
    /// above weighs no more, and sends no more of the device's data), and as 0 with zeros.
    /// Without weighing the count is ignored.
    pub fn well_formed_weighed(
        &self,
        trained: Result<Vec<u8>, String>,
        evaluation: Option<Result<[f32; 3], String>>,
        examples: Option<f64>,
    ) -> WellFormedUpdate {
        let mut problems = Vec::new();
        let trained = trained.map_err(TrainingProblem::TrainingFailed);
        let counted = match (self.weighting, examples) {
            (None, _) => Ok(0.0),
            (Some(w), Some(n)) if n.is_finite() && n >= 0.0 => {
                Ok(n.min(f64::from(w.max_examples)) as f32)
            }
            (Some(_), Some(n)) => Err(TrainingProblem::NoExampleCount(n.to_string())),
            (Some(_), None) => Err(TrainingProblem::NoExampleCount("none".into())),
        };
        let checked = match (&trained, &counted) {
            (Err(problem), _) => Err(problem.clone()),
            (Ok(bytes), Ok(_)) => self.checked_values(bytes),
            (Ok(_), Err(problem)) => Err(problem.clone()),
        };
        let zeros;
        let zeroed = checked.is_err();
        let values: Vec<&[u8]> = match checked {
            Ok(values) => values,
            Err(problem) => {
                problems.push(problem);
                zeros = self.zeros();
                zeros.iter().map(Vec::as_slice).collect()
            }
        };
        let metrics = evaluation.map(|result| match result {
            Ok(m) if m.iter().all(|v| v.is_finite()) => m,
            Ok(_) => {
                problems.push(TrainingProblem::EvaluationNonFinite);
                [0.0; 3]
            }
            Err(why) => {
                problems.push(TrainingProblem::EvaluationFailed(why));
                [0.0; 3]
            }
        });
        let examples = match zeroed {
            true => 0.0,
            false => counted.unwrap_or(0.0),
        };
        let sides = Sides {
            metrics,
            zeroed: self.health.then_some(zeroed),
            examples: self.weighting.map(|_| examples),
        };
        WellFormedUpdate {
            bytes: self.encode(&values, sides),
            problems,
            answer: false,
        }
    }

    /// The update's values per model tensor (little-endian f32 bytes), if it is exactly the
    /// model's tensors and finite.
    fn checked_values<'a>(&self, bytes: &'a [u8]) -> Result<Vec<&'a [u8]>, TrainingProblem> {
        let parsed = SafeTensors::deserialize(bytes)
            .map_err(|e| TrainingProblem::NotSafetensors(e.to_string()))?;
        if parsed.len() != self.tensors.len() {
            return Err(TrainingProblem::WrongTensors(format!(
                "{} tensors, the model has {}",
                parsed.len(),
                self.tensors.len()
            )));
        }
        let mut values = Vec::with_capacity(self.tensors.len());
        for (name, shape) in &self.tensors {
            let view = parsed
                .tensor(name)
                .map_err(|_| TrainingProblem::WrongTensors(format!("no tensor {name}")))?;
            if view.dtype() != Dtype::F32 || view.shape() != shape.as_slice() {
                return Err(TrainingProblem::WrongTensors(format!(
                    "{name} is {:?} {:?}, the model's is F32 {shape:?}",
                    view.dtype(),
                    view.shape()
                )));
            }
            if !all_finite(view.data()) {
                return Err(TrainingProblem::NonFinite(name.clone()));
            }
            values.push(view.data());
        }
        Ok(values)
    }

    fn zeros(&self) -> Vec<Vec<u8>> {
        self.tensors
            .iter()
            .map(|(_, shape)| vec![0u8; 4 * shape.iter().product::<usize>()])
            .collect()
    }

    fn encode(&self, values: &[&[u8]], sides: Sides) -> Vec<u8> {
        let metric_bytes: Option<Vec<u8>> = sides
            .metrics
            .map(|m| m.iter().flat_map(|v| v.to_le_bytes()).collect());
        let flag_bytes: Option<[u8; 4]> =
            sides.zeroed.map(|z| f32::from(u8::from(z)).to_le_bytes());
        let example_bytes: Option<[u8; 4]> = sides.examples.map(f32::to_le_bytes);
        let mut views = Vec::with_capacity(self.tensors.len() + 3);
        for ((name, shape), data) in self.tensors.iter().zip(values) {
            views.push((name.as_str(), view(shape.clone(), data)));
        }
        if let Some(bytes) = &metric_bytes {
            views.push((EVALUATION_TENSOR, view(vec![3], bytes)));
        }
        if let Some(bytes) = &flag_bytes {
            views.push((HEALTH_TENSOR, view(vec![1], bytes)));
        }
        if let Some(bytes) = &example_bytes {
            views.push((EXAMPLES_TENSOR, view(vec![1], bytes)));
        }
        safetensors::serialize(views, None).expect("F32 tensors of checked shapes serialize")
    }
}

/// The tensors an update carries beside the model's, as `encode` writes them.
struct Sides {
    metrics: Option<[f32; 3]>,
    zeroed: Option<bool>,
    examples: Option<f32>,
}

/// Whether every little-endian f32 in `bytes` is finite: its exponent bits are not all ones.
/// Without an early exit, so the loop vectorizes (a NaN is the rare case).
fn all_finite(bytes: &[u8]) -> bool {
    const EXPONENT: u32 = 0x7f80_0000;
    !bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & EXPONENT == EXPONENT)
        .fold(false, |any, bad| any | bad)
}

fn view(shape: Vec<usize>, data: &[u8]) -> TensorView<'_> {
    TensorView::new(Dtype::F32, shape, data).expect("the data has the shape's length")
}

#[cfg(test)]
mod tests;
