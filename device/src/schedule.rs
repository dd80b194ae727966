//! When a device sends, decided before it touches its data (docs/privacy.md, "Time";
//! docs/protocol.md, "Upload window").
//!
//! A model or plan someone else chose can make training slow or fast on a condition of the
//! device's data, and anyone who reads when the device uploads or reports would read that
//! condition. So, once the device accepts an assignment and before anything reads its data, it
//! draws two instants from the operating system's randomness: when it asks for its device token
//! (uniform between receiving the assignment and sending) and when it sends (uniform in the
//! policy's upload window after receiving the assignment). `Schedule` is the only way to an
//! update that `DeviceClient::seal` takes (`DueUpdate`): training runs on a blocking thread
//! while the schedule waits, and at the send instant the device takes whatever is ready, the
//! trained update or, if training is still running, a zero update of the model's shape made
//! beforehand, so the moment the seal starts and the bytes it seals have the same cost either way.

use crate::analytics::{AnalyticsError, Records};
use confed_protocol::analytics::AnalyticsQuery;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use confed_protocol::clock::Millis;
use confed_protocol::device::AssignmentResponse;
use confed_protocol::policy::UploadWindow;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::update::{TrainingProblem, UpdateShape, WellFormedUpdate};

/// What a device keeps of a drawn schedule in its state file (docs/protocol.md, "The device's
/// state file"): Unix milliseconds of receipt, token request and send. A device resuming an
/// assignment after a restart keeps its instants instead of drawing new ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendTimes {
    pub received_ms: i64,
    pub token_ms: i64,
    pub send_ms: i64,
}

/// How long before the assignment expires a send instant is moved to at the latest: time to
/// seal, upload and report (the server keeps 5 s between a window's end and the timeout).
pub const EXPIRY_ALLOWANCE: Duration = Duration::from_secs(2);

impl SendTimes {
    /// Draws the instants of an assignment received at `received` under `window`, from the
    /// uniform draws `send_unit` and `token_unit` in `[0, 1)`: the send instant in the window
    /// (moved to `EXPIRY_ALLOWANCE` before `expires` if it would fall later), the token request
    /// between receipt and the send instant.
    pub fn draw(
        received: Millis,
        window: UploadWindow,
        expires: Millis,
        send_unit: f64,
        token_unit: f64,
    ) -> Self {
        let latest = expires.minus(EXPIRY_ALLOWANCE).max(received);
        let send = received.plus(window.offset(send_unit)).min(latest);
        let span = (send.0 - received.0).max(0) as f64;
        let token_unit = if token_unit.is_finite() {
            token_unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let token = received.0 + ((token_unit * span).floor() as i64).min(send.0 - received.0);
        Self {
            received_ms: received.0,
            token_ms: token.max(received.0),
            send_ms: send.0,
        }
    }
}

/// A uniform draw in `[0, 1)` from the operating system: nothing the device's data decides.
pub(crate) fn uniform_unit() -> Result<f64, getrandom::Error> {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes)?;
    Ok((u64::from_le_bytes(bytes) >> 11) as f64 / (1u64 << 53) as f64)
}

/// Asked by the training code between steps: once set, the send instant has passed and nothing
/// training computes from here on will be sent.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// What the training code gives: the update's safetensors (the new weights minus the model's)
/// or why not, in an evaluation round the metrics `[loss_sum, correct, examples]` or why not,
/// and the examples the update trained on (what a weighting policy weighs it by; ignored
/// otherwise).
#[derive(Debug, Clone)]
pub struct Trained {
    pub update: Result<Vec<u8>, String>,
    pub metrics: Option<Result<[f32; 3], String>>,
    pub examples: Option<f64>,
}

/// An update that is due: what was ready at the send instant of one assignment. Only
/// `Schedule::train_until` makes one, and `DeviceClient::seal` takes it only for the assignment
/// its schedule was drawn for and not before its instant.
#[derive(Debug)]
pub struct DueUpdate {
    update: WellFormedUpdate,
    late: bool,
    /// The assignment's reference and send instant: what `seal` checks.
    pub(crate) assignment_ref: String,
    pub(crate) send_at: Instant,
}

impl DueUpdate {
    /// An update due now for `assignment_ref`: for tests of sealing only.
    #[cfg(test)]
    pub(crate) fn now(update: WellFormedUpdate, assignment_ref: String) -> Self {
        Self {
            update,
            late: false,
            assignment_ref,
            send_at: Instant::now(),
        }
    }

    pub fn update(&self) -> &WellFormedUpdate {
        &self.update
    }

    /// Training had not finished at the send instant: zeros were sent.
    pub fn late(&self) -> bool {
        self.late
    }

    /// Whether zeros were sent in place of the trained update (late, failed or non-finite).
    pub fn zeroed(&self) -> bool {
        self.late
            || self.update.problems().iter().any(|p| {
                !matches!(
                    p,
                    TrainingProblem::EvaluationFailed(_) | TrainingProblem::EvaluationNonFinite
                )
            })
    }

    /// What was replaced by zeros, and why: for the device's own log, never for the server.
    pub fn problems(&self) -> &[TrainingProblem] {
        self.update.problems()
    }
}

/// The latest a schedule waits, whatever a state file says: longer than any assignment lives.
const LONGEST_WAIT: Duration = Duration::from_secs(8 * 24 * 3600);

/// An accepted assignment's instants (`DeviceClient::schedule`), as monotonic deadlines.
#[derive(Debug, Clone)]
pub struct Schedule {
    assignment_ref: String,
    times: SendTimes,
    token_at: Instant,
    send_at: Instant,
}

impl Schedule {
    /// The schedule of `times` for the assignment `assignment_ref`, on a device whose wall
    /// clock reads `now` at the monotonic instant `at`: instants already past are due at once.
    pub(crate) fn new(assignment_ref: String, times: SendTimes, now: Millis, at: Instant) -> Self {
        let after = |ms: i64| {
            let wait = u64::try_from(ms.saturating_sub(now.0)).unwrap_or(0);
            at + Duration::from_millis(wait).min(LONGEST_WAIT)
        };
        Self {
            assignment_ref,
            times,
            token_at: after(times.token_ms),
            send_at: after(times.send_ms),
        }
    }

    pub fn times(&self) -> SendTimes {
        self.times
    }

    /// When to ask for the device token.
    pub fn token_at(&self) -> Instant {
        self.token_at
    }

    /// When to seal, upload and report.
    pub fn send_at(&self) -> Instant {
        self.send_at
    }

    /// Waits until the token instant (`DeviceClient::token_for` then).
    pub async fn token_due(&self) {
        tokio::time::sleep_until(self.token_at).await;
    }

    /// Runs `train` on a blocking thread and returns at the send instant with what is ready:
    /// the trained update made well formed, or, if training has not finished, a zero update of
    /// the model's shape (with zero metrics in an evaluation round) made before training
    /// started. `train` is told to stop (`Cancel`) once the instant has passed; whatever it
    /// returns after that is dropped. It never returns before the instant, whatever `train`
    /// did: fast, slow, failing or panicking.
    pub async fn train_until<F>(&self, shape: &UpdateShape, evaluating: bool, train: F) -> DueUpdate
    where
        F: FnOnce(&Cancel) -> Trained + Send + 'static,
    {
        // Everything sent late is made now, before training: at the instant only a choice is
        // left, and the seal that follows has the same bytes to work on either way.
        let late = shape
            .well_formed(Err(String::new()), evaluating.then_some(Ok([0.0; 3])))
            .with_problems(vec![TrainingProblem::Late]);
        let cancel = Cancel::default();
        let shape = shape.clone();
        let stop = cancel.clone();
        let mut training = tokio::task::spawn_blocking(move || {
            let trained = train(&stop);
            // Past the instant nothing of it is sent: no more work on it.
            if stop.is_cancelled() {
                return None;
            }
            let metrics = match (evaluating, trained.metrics) {
                (true, Some(metrics)) => Some(metrics),
                (true, None) => Some(Err("the training code gave no metrics".into())),
                (false, _) => None,
            };
            Some(shape.well_formed_weighed(trained.update, metrics, trained.examples))
        });
        // What is ready by the instant; an instant already past (a schedule resumed late) finds
        // nothing ready.
        let ready = match tokio::time::Instant::now() < self.send_at {
            true => tokio::time::timeout_at(self.send_at, &mut training)
                .await
                .ok(),
            false => None,
        };
        let (update, late) = match ready {
            Some(Ok(Some(update))) => {
                // Freed before the instant, not after it.
                drop(late);
                tokio::time::sleep_until(self.send_at).await;
                (update, false)
            }
            // The training code panicked: a failure, sent as zeros at the instant.
            Some(Ok(None) | Err(_)) => {
                let failed = late.with_problems(vec![TrainingProblem::TrainingFailed(
                    "the training code panicked".into(),
                )]);
                tokio::time::sleep_until(self.send_at).await;
                (failed, false)
            }
            None => (late, true),
        };
        cancel.cancel();
        DueUpdate {
            update,
            late,
            assignment_ref: self.assignment_ref.clone(),
            send_at: self.send_at,
        }
    }
}

impl Schedule {
    /// An analytics task's `train_until`: computes the answer to `query` from `records` on a
    /// blocking thread (`crate::analytics::answer`) and returns at the send instant with it,
    /// or, if it is not ready (or failed), with the failed answer made before it started: the
    /// query's fixed shape either way, sent at the instant drawn before the records were read.
    pub async fn answer_until(
        &self,
        query: &AnalyticsQuery,
        records: Records,
    ) -> Result<DueUpdate, AnalyticsError> {
        let failed = crate::analytics::failed_answer(query)?;
        let late = WellFormedUpdate::answer(failed.clone(), vec![TrainingProblem::Late]);
        let owned = query.clone();
        let mut computing =
            tokio::task::spawn_blocking(move || crate::analytics::answer(&owned, &records));
        let ready = match tokio::time::Instant::now() < self.send_at {
            true => tokio::time::timeout_at(self.send_at, &mut computing)
                .await
                .ok(),
            false => None,
        };
        let (update, late) = match ready {
            Some(outcome) => {
                let update = match outcome {
                    Ok(Ok(bytes)) => WellFormedUpdate::answer(bytes, Vec::new()),
                    Ok(Err(why)) => WellFormedUpdate::answer(
                        failed,
                        vec![TrainingProblem::TrainingFailed(why.to_string())],
                    ),
                    Err(_) => WellFormedUpdate::answer(
                        failed,
                        vec![TrainingProblem::TrainingFailed(
                            "the answer's computation panicked".into(),
                        )],
                    ),
                };
                tokio::time::sleep_until(self.send_at).await;
                (update, false)
            }
            None => {
                computing.abort();
                (late, true)
            }
        };
        Ok(DueUpdate {
            update,
            late,
            assignment_ref: self.assignment_ref.clone(),
            send_at: self.send_at,
        })
    }
}

/// The instants of `assignment` as the device first received it at `received` (wall clock).
pub(crate) fn draw_for(
    assignment: &AssignmentResponse,
    window: UploadWindow,
    received: Millis,
) -> Result<SendTimes, getrandom::Error> {
    Ok(SendTimes::draw(
        received,
        window,
        Millis(assignment.expires_at.saturating_mul(1000)),
        uniform_unit()?,
        uniform_unit()?,
    ))
}

#[cfg(test)]
mod tests;
