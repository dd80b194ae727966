//! One device cycle from the command line, the smallest complete program on `confed-device`:
//! check in, verify the key and the task policy, download the model, seal an update file you
//! trained elsewhere, upload it and report. Its release binary size is the device footprint
//! the README states.
//!
//! ```text
//! cargo run --release -p confed-device --example contribute -- \
//!     https://127.0.0.1:8080 my-population trust.json update.safetensors
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

use confed_device::{Checkin, DeviceClient, ReportOutcome, load_trust};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [server, population, trust, update] = args.as_slice() else {
        return Err("usage: contribute SERVER POPULATION TRUST_FILE UPDATE.safetensors".into());
    };
    let client = DeviceClient::new(server, &load_trust(std::path::Path::new(trust))?)?;
    let assignment = match client
        .checkin(population, "1.0.0", &Default::default())
        .await?
    {
        Checkin::Assigned(assignment) => assignment,
        Checkin::Retry(retry) => {
            println!(
                "nothing to do ({}); ask again in {}-{} s",
                retry.reason, retry.retry_window.min_seconds, retry.retry_window.max_seconds
            );
            return Ok(());
        }
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() as i64;
    let key = client.verified_key(&assignment, now)?;
    let policy = client.accepted_policy(&assignment, population)?;
    let model = client.model(&assignment).await?;
    // An update file that is not the model's exact tensors, or not finite, is sent as a zero
    // update (and reported completed): the server never learns that anything went wrong.
    let trained = std::fs::read(update).map_err(|e| e.to_string());
    let update = model.update_shape()?.well_formed(trained, None);
    for problem in update.problems() {
        eprintln!("sending a zero update instead: {problem}");
    }
    let envelope = client.seal(&assignment, &key, &policy, &model, &update)?;
    client.upload(&assignment, envelope).await?;
    client
        .report(&assignment, ReportOutcome::Completed, None)
        .await?;
    println!(
        "contributed to round {} of task {}",
        assignment.round, assignment.task_id
    );
    Ok(())
}
