//! Sending an accepted assignment: its schedule (drawn before training, `crate::schedule`), the
//! seal of the update that was due at its send instant, and the whole send (seal, upload,
//! report) at that instant.

use confed_protocol::clock::{Clock, SystemClock};
use confed_protocol::device::{AssignmentResponse, ReportOutcome, ReportResponse};
use confed_protocol::envelope::RoundContext;
use confed_protocol::hpke::PublicKey;

use super::{AcceptedPolicy, DeviceClient, DeviceError, Model, too_close};
use crate::schedule::{DueUpdate, Schedule, draw_for};
use crate::tokens::AssignmentToken;

impl DeviceClient {
    /// The schedule of an accepted assignment: its token and send instants, drawn now (from the
    /// operating system's randomness, before anything reads the device's data) and kept in the
    /// state file before they are used, or the ones drawn when this device first received the
    /// same assignment. Call it as soon as the policy is accepted, before training.
    pub fn schedule(
        &self,
        assignment: &AssignmentResponse,
        policy: &AcceptedPolicy,
    ) -> Result<Schedule, DeviceError> {
        let now = SystemClock.now_millis();
        let key = assignment.assignment_id.reference().into_string();
        let mut state = self.state();
        let times = match state.sends.get(&key) {
            Some(times) => *times,
            None => {
                let times = draw_for(assignment, policy.policy.upload_window, now)
                    .map_err(|e| DeviceError::Training(format!("no randomness: {e}")))?;
                state.prune_sends(now.0);
                state.sends.insert(key.clone(), times);
                self.persist(&state)?;
                times
            }
        };
        Ok(Schedule::new(key, times, now, tokio::time::Instant::now()))
    }

    /// Forgets the schedule of a reported assignment.
    pub(super) fn forget_schedule(&self, assignment: &AssignmentResponse) {
        let key = assignment.assignment_id.reference().into_string();
        let mut state = self.state();
        if state.sends.remove(&key).is_some() {
            // Best effort: a schedule left behind is pruned a week later.
            let _ = self.persist(&state);
        }
    }

    /// Seals the due update, uploads it and reports `completed`: what a device does at its send
    /// instant (`Schedule::train_until` returns at it). `token` is the device token of a task
    /// that requires one (`token_for`, at `Schedule::token_at`).
    pub async fn send(
        &self,
        assignment: &AssignmentResponse,
        public_key: &PublicKey,
        policy: &AcceptedPolicy,
        model: &Model,
        due: &DueUpdate,
        token: Option<AssignmentToken>,
    ) -> Result<ReportResponse, DeviceError> {
        let envelope = match token {
            Some(token) => {
                self.seal_with_token(assignment, public_key, policy, model, due, token)?
            }
            None => self.seal(assignment, public_key, policy, model, due)?,
        };
        self.upload(assignment, envelope).await?;
        self.report(assignment, ReportOutcome::Completed, None)
            .await
    }

    /// Seals an update for the assignment: to the checked key, bound to the task, round,
    /// assignment, the accepted policy and the model the device trained from. The update is the
    /// one due at the send instant (`Schedule::train_until`): the model's exact tensors, finite,
    /// whatever training did and whenever it finished, so nothing the device sends, nor when,
    /// depends on its data but the values the enclave clips and noises.
    pub fn seal(
        &self,
        assignment: &AssignmentResponse,
        public_key: &PublicKey,
        policy: &AcceptedPolicy,
        model: &Model,
        update: &DueUpdate,
    ) -> Result<Vec<u8>, DeviceError> {
        if policy.policy.device_auth.is_some() {
            return Err(DeviceError::Token(
                "the task requires a device token: obtain one with `token_for` and seal with `seal_with_token`".into(),
            ));
        }
        self.seal_envelope(assignment, public_key, policy, model, update, None)
    }

    /// `seal` for a task that requires device tokens, with the token `token_for` obtained for
    /// this assignment (spent: it binds this envelope only).
    pub fn seal_with_token(
        &self,
        assignment: &AssignmentResponse,
        public_key: &PublicKey,
        policy: &AcceptedPolicy,
        model: &Model,
        update: &DueUpdate,
        token: AssignmentToken,
    ) -> Result<Vec<u8>, DeviceError> {
        self.seal_envelope(assignment, public_key, policy, model, update, Some(token))
    }

    fn seal_envelope(
        &self,
        assignment: &AssignmentResponse,
        public_key: &PublicKey,
        policy: &AcceptedPolicy,
        model: &Model,
        update: &DueUpdate,
        token: Option<AssignmentToken>,
    ) -> Result<Vec<u8>, DeviceError> {
        // Only the update due for this assignment, and not before its instant: nothing else
        // makes a `DueUpdate`, so "drawn before training, sent at the instant" holds for every
        // caller of the crate.
        if update.assignment_ref != assignment.assignment_id.reference().as_str() {
            return Err(DeviceError::Training(
                "this update is due for another assignment".into(),
            ));
        }
        if tokio::time::Instant::now() < update.send_at {
            return Err(DeviceError::Training(
                "this update is not due yet: seal it at its send instant (Schedule::train_until returns then)".into(),
            ));
        }
        // A training update under an analytics policy would answer a question nobody asked with
        // data the query never bounded; an answer under a training policy is nobody's update.
        if policy.policy.analytics.is_some() != update.update().is_answer() {
            return Err(DeviceError::UntrustedPolicy(
                "an analytics task is answered with Schedule::answer_until, a training task with Schedule::train_until".into(),
            ));
        }
        // And an answer to this policy's query, not another's.
        if let Some(query) = &policy.policy.analytics {
            confed_protocol::answer::Answer::read(query, update.update().bytes()).map_err(|e| {
                DeviceError::UntrustedPolicy(format!(
                    "the answer is not one to this task's query: {e}"
                ))
            })?;
        }
        let update = update.update().bytes();
        // The device's privacy unit is one contribution per round: once it has sealed an update
        // for a round it declines further assignments to it, even if this upload never gets a
        // success answer (a server that stores the bytes and answers an error must not get a
        // second update for the same round).
        let separation = policy
            .policy
            .mechanism()
            .map_err(|e| DeviceError::UntrustedPolicy(e.to_string()))?
            .min_separation();
        {
            let mut state = self.state();
            if let Some(refusal) = too_close(
                &state.served,
                &assignment.task_id,
                assignment.round,
                separation,
            ) {
                return Err(refusal);
            }
            state
                .served
                .insert((assignment.task_id.clone(), assignment.round));
            if separation > 1 {
                state.separated.insert(
                    assignment.task_id.clone(),
                    (
                        policy.policy.population.clone(),
                        separation,
                        policy.policy.rounds,
                    ),
                );
            }
            // Kept before anything is sealed: a device that forgot it served this round could
            // serve it (or one too close) again after a restart. The round stays recorded in
            // memory either way.
            self.persist(&state)?;
        }
        let context = RoundContext {
            task_id: assignment.task_id.clone(),
            round: confed_protocol::ids::wire_round(assignment.round).ok_or(
                DeviceError::UntrustedPolicy(format!("round {} is not a round", assignment.round)),
            )?,
            policy_sha256: policy.sha256.clone(),
            model_sha256: model.sha256.clone(),
        };
        let envelope = match token {
            Some(AssignmentToken {
                ephemeral,
                token,
                masking: Some(secrets),
            }) => {
                let masked = crate::masked::masked_update(
                    &policy.policy,
                    context.round,
                    assignment.assignment_id.reference().as_str(),
                    &secrets,
                    update,
                )?;
                confed_protocol::envelope::seal_masked(
                    confed_protocol::envelope::MaskedBinding {
                        ephemeral,
                        token: &token,
                        seeds: &secrets.sealed,
                    },
                    public_key,
                    &assignment.encryption.key_id,
                    &context,
                    &assignment.assignment_id,
                    &masked,
                )?
            }
            Some(_) if policy.policy.masking.is_some() => {
                return Err(DeviceError::Token(
                    "the task masks its updates: obtain the token with `token_for`, which draws the mask seeds".into(),
                ));
            }
            Some(token) => confed_protocol::envelope::seal_with_token(
                token.ephemeral,
                &token.token,
                public_key,
                &assignment.encryption.key_id,
                &context,
                &assignment.assignment_id,
                update,
            )?,
            None => confed_protocol::envelope::seal_with(
                self.sealer.as_ref(),
                public_key,
                &assignment.encryption.key_id,
                &context,
                &assignment.assignment_id,
                update,
            )?,
        };
        Ok(envelope.to_cbor())
    }
}
