//! Whether a simulation left work undone: once every simulated device has stopped, a fresh
//! device of the population checks in for a few seconds (`--settle-ms`: a round that completed a
//! moment ago opens the next one after its aggregation, well under a second on one machine). An assignment (declined at once, as any
//! device that will not serve it does) or an answer other than `no_task` means a round of the
//! population still wants contributions that no simulated device will make: `confed devices
//! simulate` then exits non-zero and says why, instead of leaving a round stuck part-way.

use std::time::Duration;

use confed_device::{Checkin, DeviceClient, DeviceError, ReportOutcome};

use super::simulate::{SimulationConfig, Summary, simulated_attributes};

/// What the population offers a device once the simulation has stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenWork {
    /// `no_task` throughout the settling time: every task of the population is finished (or waits on
    /// something other than devices, such as its aggregation).
    Nothing,
    /// A round that still collects: `task_id`'s round `round` assigned a device.
    Round { task_id: String, round: i64 },
    /// A round exists but the device was told to wait, for this reason (`round_full`: the
    /// round's slots are held by assignments nobody will finish before they time out;
    /// `min_separation`, `constraints_not_met`, ...).
    Waiting(String),
}

/// Asks the population as a fresh device would, every `every`, until something other than
/// `no_task` comes back or `settle` has passed.
pub async fn open_work(
    config: &SimulationConfig,
    settle: Duration,
    every: Duration,
) -> Result<OpenWork, DeviceError> {
    let client = DeviceClient::new(&config.server, &config.trust)?;
    let attributes = simulated_attributes();
    let deadline = tokio::time::Instant::now() + settle;
    loop {
        match client
            .checkin(&config.population, &config.client_version, &attributes)
            .await?
        {
            Checkin::Assigned(assignment) => {
                // Declined like any assignment a device will not serve: the slot frees at once.
                let _ = client
                    .report(&assignment, ReportOutcome::NotEligible, None)
                    .await;
                return Ok(OpenWork::Round {
                    task_id: assignment.task_id.clone(),
                    round: assignment.round,
                });
            }
            Checkin::Retry(retry) if retry.reason != "no_task" => {
                return Ok(OpenWork::Waiting(retry.reason));
            }
            Checkin::Retry(_) => {}
        }
        if tokio::time::Instant::now() + every > deadline {
            return Ok(OpenWork::Nothing);
        }
        tokio::time::sleep(every).await;
    }
}

/// Why the simulation stopped with `open` left, for the operator: which round, what the devices
/// did, and what to change.
pub fn explain(open: &OpenWork, summary: &Summary, config: &SimulationConfig) -> Option<String> {
    let devices = format!(
        "{} of {} devices made their {} contribution(s) (--rounds); {} stopped after {} answers in a row with no work for them (--idle-limit): {} assignments declined because the device had already contributed to that round (or to one too close under the task's min_separation){}. {} contributions in all",
        summary.finished_devices,
        summary.finished_devices + summary.idle_devices,
        config.rounds,
        summary.idle_devices,
        config.idle_limit,
        summary.declined,
        match summary.retries.is_empty() {
            true => String::new(),
            false => format!(
                "; retry answers: {}",
                summary
                    .retries
                    .iter()
                    .map(|(reason, n)| format!("{reason} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
        summary.contributions,
    );
    let more = "Run more devices (--devices) or let each contribute more (--rounds); a device contributes at most once a round, so a task of R rounds of G reports needs at least G devices and G x R contributions";
    Some(match open {
        OpenWork::Nothing => return None,
        OpenWork::Round { task_id, round } => format!(
            "the task did not finish: task {task_id} round {round} still collects contributions, but every simulated device has stopped. {devices}. {more}"
        ),
        OpenWork::Waiting(reason) if reason == "round_full" => format!(
            "the task did not finish: a round of population {:?} still collects, but its slots are held by assignments nobody will finish (they free when they time out, after the task's assignment_timeout_seconds), and every simulated device has stopped. {devices}. Run again once they have timed out, with more devices (--devices) or a longer --idle-limit",
            config.population
        ),
        OpenWork::Waiting(reason) => format!(
            "the population {:?} still has a task these devices cannot serve: a device checking in now is told {reason:?} (docs/protocol.md, check-in reasons: e.g. version_mismatch for --client-version, constraints_not_met for the task's device constraints). {devices}",
            config.population
        ),
    })
}
