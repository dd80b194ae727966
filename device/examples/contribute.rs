//! One device cycle from the command line, the smallest complete program on `confed-device`:
//! check in, verify the key and the task policy, draw the send instant from the policy's upload
//! window, download the model, read an update file you trained elsewhere, and at the instant
//! seal it, upload it and report. Its release binary size is the device footprint
//! the README states.
//!
//! ```text
//! cargo run --release -p confed-device --example contribute -- \
//!     https://127.0.0.1:8080 my-population trust.json update.safetensors
//! ```

use std::time::{SystemTime, UNIX_EPOCH};

use confed_device::{Checkin, DeviceClient, Trained, load_trust};

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
    // Drawn before anything reads the update: when this device sends does not depend on it.
    let schedule = client.schedule(&assignment, &policy)?;
    let model = client.model(&assignment).await?;
    // An update file that is not the model's exact tensors, or not finite, or not read by the
    // send instant, is sent as a zero update (and reported completed): the server never learns
    // that anything went wrong. The device token (tasks that require one) is asked for at its
    // own drawn instant, neither at the assignment nor at the upload.
    let path = update.clone();
    let token = async {
        schedule.token_due().await;
        client.token_for(&assignment, &policy, &model).await
    };
    let shape = model.update_shape(&policy)?;
    let training = schedule.train_until(&shape, false, move |_| Trained {
        update: std::fs::read(path).map_err(|e| e.to_string()),
        metrics: None,
        // Under a weighting policy, the examples the update trained on (this example has one).
        examples: Some(1.0),
    });
    let (token, due) = tokio::join!(token, training);
    let token = token?;
    for problem in due.problems() {
        eprintln!("sending a zero update instead: {problem}");
    }
    client
        .send(&assignment, &key, &policy, &model, &due, token)
        .await?;
    println!(
        "contributed to round {} of task {}",
        assignment.round, assignment.task_id
    );
    Ok(())
}
