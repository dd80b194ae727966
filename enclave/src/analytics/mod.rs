//! Analytics rounds inside the enclave (docs/analytics.md): open each contribution as for
//! training, read it as an answer to the task's query (`confed_protocol::answer`: every check an
//! honest device's answer passes), add its slots to the round's exact table (`table.rs`), then
//! noise every value once, select an open domain's keys by its threshold and release the result
//! in the average's place (`release.rs`). The exact table never leaves this module.

pub mod partition;
pub mod release;
pub mod table;

use std::sync::Mutex;

use confed_protocol::analytics::AnalyticsQuery;
use confed_protocol::answer::{AnswerLayout, AnswerProblem};
use confed_protocol::device_auth::DeviceAuth;
use rayon::prelude::*;

use crate::aggregate::contribution::{self, Binding, Exclusion};
use crate::aggregate::{AggregateError, Outcome, PlaintextBuffers};
use crate::hpke::PrivateKey;
use crate::hpke_awslc::Recipient;
use table::Table;

pub use release::{AnalyticsParams, AnalyticsRelease};

pub struct AnalyticsAggregator {
    binding: Binding,
    /// The query's answer layout (read at fixed offsets).
    layout: AnswerLayout,
    recipient: Recipient,
    table: Table,
    outcome: Mutex<Outcome>,
    device_auth: Option<DeviceAuth>,
    buffers: PlaintextBuffers,
}

/// The exclusion an answer's problem is counted under: its format's, or `invalid_answer`.
fn exclusion_of(problem: &AnswerProblem) -> Exclusion {
    match problem {
        AnswerProblem::Format(_) => Exclusion::NotSafetensors,
        AnswerProblem::Tensors | AnswerProblem::Shape(_) => Exclusion::WrongTensors,
        _ => Exclusion::InvalidAnswer,
    }
}

impl AnalyticsAggregator {
    pub fn new(
        binding: Binding,
        query: AnalyticsQuery,
        private_key: &PrivateKey,
    ) -> Result<Self, AggregateError> {
        let recipient =
            Recipient::new(private_key).map_err(|e| AggregateError::Key(e.to_string()))?;
        let layout = AnswerLayout::new(&query)
            .map_err(|e| AggregateError::Unsupported(format!("the query's answers: {e}")))?;
        Ok(Self {
            binding,
            table: Table::new(&query),
            layout,
            recipient,
            outcome: Mutex::default(),
            device_auth: None,
            buffers: PlaintextBuffers::default(),
        })
    }

    /// Adds only contributions whose device token the policy's `device_auth` accepts.
    pub fn authenticating(mut self, device_auth: Option<DeviceAuth>) -> Self {
        self.device_auth = device_auth;
        self
    }

    /// Adds one stored contribution (`None`: its bytes were missing). Safe to call from many
    /// threads at once.
    pub fn add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let result = self.try_add(assignment_ref, stored);
        self.outcome
            .lock()
            .expect("analytics outcome")
            .record(assignment_ref, result);
        result
    }

    fn try_add(&self, assignment_ref: &str, stored: Option<&[u8]>) -> Result<(), Exclusion> {
        let opener = contribution::Opener {
            binding: &self.binding,
            recipient: &self.recipient,
            device_auth: self.device_auth.as_ref(),
            masking: None,
            buffers: &self.buffers,
        };
        opener.open_then(assignment_ref, stored, |plaintext| {
            self.add_opened(plaintext)
        })
    }

    /// Adds an opened answer's slots (checked whole first: an answer is in the table whole or
    /// not at all). A failed device's answer has no slots: it adds nothing. `add` calls it after
    /// decryption; benchmarks call it to measure the table alone.
    pub fn add_opened(&self, plaintext: &[u8]) -> Result<(), Exclusion> {
        let answer = self.layout.read(plaintext).map_err(|e| exclusion_of(&e))?;
        for (key, value) in answer.slots() {
            self.table.add(key, value);
        }
        Ok(())
    }

    /// Adds a batch across all cores.
    pub fn add_batch(&self, batch: &[(String, Option<Vec<u8>>)]) {
        batch.par_iter().for_each(|(assignment_ref, stored)| {
            let _ = self.add(assignment_ref, stored.as_deref());
        });
    }

    /// Contributions included and excluded so far.
    pub fn counts(&self) -> (usize, usize) {
        let outcome = self.outcome.lock().expect("analytics outcome");
        (outcome.included.len(), outcome.excluded.len())
    }
}

#[cfg(test)]
mod partition_tests;
#[cfg(test)]
mod tests;
