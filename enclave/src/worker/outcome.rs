//! What one job came to, and where its time went.

use std::time::Duration;

/// What one job came to.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    pub task_id: String,
    pub round: u64,
    pub included: u64,
    pub excluded: u64,
    pub epsilon_spent: Option<f64>,
    /// A partition's job: its (index, count). It releases nothing, and says nothing of its
    /// partition's outcomes (`included` and `excluded` are 0): only the release publishes them.
    pub partition: Option<(u32, u32)>,
    /// Where the job's time went, for operators' logs and the round benchmark.
    pub phases: Phases,
}

/// Wall-clock time of each step of one job (zero for a step the job skipped: a retried job
/// whose release was already committed neither reads, asks for the key nor aggregates).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Phases {
    /// The lease: the job, its base model and the list of contributions (for a worker that
    /// long-polls, this includes the wait for a job).
    pub lease: Duration,
    /// The first read and digest of the contributions the job lists without a digest (direct
    /// uploads); zero when the server digested them all.
    pub read: Duration,
    /// Attestation to the key services and the key's reconstruction.
    pub key: Duration,
    /// Reading (or taking from memory), checking, opening, validating, clipping and summing the
    /// contributions.
    pub open: Duration,
    /// A masked round's unmask: the key services' agreement and mask sums, and their removal.
    pub unmask: Duration,
    /// Noise and the average.
    pub noise: Duration,
    /// Committing the release (with its proof).
    pub release: Duration,
    /// Applying the average to the model and committing model N+1.
    pub update: Duration,
}

impl JobOutcome {
    /// What the job did, for logs and metrics: `released` (a round's release, or its model
    /// update after a retry) or `partition` (one partition sealed for its round's root).
    pub fn step(&self) -> &'static str {
        match self.partition {
            Some(_) => "partition",
            None => "released",
        }
    }
}

impl Phases {
    /// From the lease's answer to model N+1 committed: the job's own time (a long-polling
    /// worker's lease includes its wait for a job).
    pub fn after_lease(&self) -> Duration {
        self.read + self.key + self.open + self.unmask + self.noise + self.release + self.update
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "lease {:.0} ms, read {:.0} ms, key {:.0} ms, open {:.0} ms, unmask {:.0} ms, noise {:.0} ms, release {:.0} ms, update {:.0} ms",
            ms(self.lease),
            ms(self.read),
            ms(self.key),
            ms(self.open),
            ms(self.unmask),
            ms(self.noise),
            ms(self.release),
            ms(self.update)
        )
    }
}
